"""Agentic RL: tools, environments and interactions (tools.py, torch-free loading), and the multi-turn
rollout loop around them."""
