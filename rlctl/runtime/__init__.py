"""What runs on the ranks, below every recipe: the run directory and checkpoint layout, distributed
start-up and collectives, RNG state, and the one fit loop that sft, grpo and ppo share.

Nothing here imports torch at module level except the modules that need it on the ranks; the launcher
and convert read the layout (:mod:`rlctl.runtime.layout`) without torch.
"""
