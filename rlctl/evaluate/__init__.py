"""Evaluating and talking to a model outside a training run: `rlctl eval` and `rlctl chat`.

* :mod:`rlctl.evaluate.passk`: the unbiased pass@k estimator;
* :mod:`rlctl.evaluate.source`: MODEL_OR_RUN -> a Hugging Face model directory (a run's ``hf/`` export,
  or its latest checkpoint converted as ``rlctl convert fsdp-to-hf`` would);
* :mod:`rlctl.evaluate.run`: the data, rewards and prompt rendering of training, on a rollout engine;
* :mod:`rlctl.evaluate.chat`: a chat session over a rollout engine (its text printed through
  :func:`rlctl.terminal.inert`).

Only :mod:`passk` and :mod:`source`'s checks are light; the rest import torch.
"""
