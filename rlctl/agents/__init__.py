"""Agentic RL: tools, environments and multi-turn trajectories (layer 5, beside rollout).

- :mod:`.spec`: what ``--tools`` / ``--env`` / ``--interaction`` name (a .py file or a verl tool YAML,
  TRL-style environments, verl interactions), loaded torch-free (the pre-launch checks use it);
  :mod:`.build` and :mod:`.loading` read the files, :mod:`.sources` attach each kind to a trajectory
- :mod:`.episode`: one trajectory's tools and state; :mod:`.calls`: a call, its outcome and the texts the
  model sees; :mod:`.runner`: a batch's calls in parallel with timeouts; :mod:`.tools`: these names gathered
- :mod:`.guard`: a user's code with a timeout, its outcome a typed :class:`~.guard.Result`
- :mod:`.sync_host`: sync tools and environments on the main thread of a worker process of their own
  (as TRL calls them on its main thread), a call over its timeout killed with its process
- :mod:`.parse`: tool calls out of a response, in the chat template's format (no torch)
- :mod:`.trajectory`: a trajectory's tokens, loss mask and conversation; appended turns as a token delta
- :mod:`.loop`: the multi-turn loop over any rollout engine, token ids in and out
"""
