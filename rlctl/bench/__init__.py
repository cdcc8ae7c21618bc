"""`rlctl bench`: throughput, MFU and memory of rlctl's own code paths, measured in one run.

* :mod:`rlctl.bench.rollout`: generated tokens/s, time to first token, shared-prefix effect and
  peak memory of each rollout engine (one worker process per engine, repetitions interleaved);
* :mod:`rlctl.bench.train`: a real ``sft``/``grpo``/``ppo`` run through ``launch_job`` on synthetic
  data: tokens/s, the step-time split, MFU, peak memory beside the plan's estimate;
* :mod:`rlctl.bench.convert`: ``fsdp-to-hf`` GB/s and peak RSS beside a plain copy;
* :mod:`rlctl.bench.compare`: the same work through TRL and rlctl, interleaved, with ratios;
* :mod:`rlctl.bench.mfu`: the FLOP counting convention; :mod:`rlctl.bench.models`: ``--model``
  (``tiny``, a local directory, a catalog name with random weights); :mod:`rlctl.bench.tables` and
  :mod:`rlctl.bench.plot`: tables and bar charts. Every command returns one JSON-ready dict
  (see :func:`rlctl.bench.common.envelope`).
"""
