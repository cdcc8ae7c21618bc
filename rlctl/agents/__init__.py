"""Agentic RL: tools, environments and multi-turn trajectories (layer 5, beside rollout).

- :mod:`.tools`: tools from a .py file or a verl tool YAML, TRL-style environments, verl interactions, and
  running a batch's calls in parallel with timeouts (torch-free loading: the pre-launch checks use it)
- :mod:`.sync_host`: sync tools and environments on the main thread of a worker process of their own
  (as TRL calls them on its main thread), a call over its timeout killed with its process
- :mod:`.parse`: tool calls out of a response, in the chat template's format (no torch)
- :mod:`.trajectory`: a trajectory's tokens, loss mask and conversation; appended turns as a token delta
- :mod:`.loop`: the multi-turn loop over any rollout engine, token ids in and out
"""
