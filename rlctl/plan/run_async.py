"""Whether streaming pays for a job, from what can be known of it: :func:`run_parts` reads the cost model's
inputs (:class:`rlctl.plan.streaming.StreamParts`) from a GRPO run's own metrics.jsonl, :func:`run_decision`
applies :func:`rlctl.plan.streaming.streaming_decision` to them and names what was assumed; `rlctl report`
prints it. :func:`planned_decision` is the plan's word before a run (`rlctl grpo ... --rollout-procs 1
--dry-run`): what the model needs and where the answer will come from.

Read from a run (steady steps: the first is warm-up and left out when there are more):

- ``U``: ``time/update + time/logprobs`` (the trainer's work per batch); ``S``: ``time/weight_sync``;
- a colocated or ``fixed`` split run: ``R_lock`` is ``time/rollout`` (the batch's lockstep rollout); every
  group of a lockstep batch ends with the batch, so its latency is ``time/rollout`` too; ``G`` is
  ``time/rollout`` less ``time/tools`` (the batch's waits for its tools, recorded by a multi-turn run on
  the process that ran the agent loop), else ``time/rollout``;
- a ``stream`` run: the group latencies recorded per update (``async/group_latency_mean`` and ``_max``),
  ``G`` the update interval (``time/step``) less the rollout's idle seconds (``async/idle_rollout_s``), and
  ``R_lock`` the mean batch's slowest group (a lockstep batch waits for it).

What no single run measures is assumed, and the reason says so: a run does not split lockstep decoding
from streaming decoding (``G = R_lock`` for a lockstep run), and 2 synchronous processes are taken to
halve the rollout and the update (the all-reduce not counted).
"""

from __future__ import annotations

import statistics

from rlctl.config.schema import RolloutConfig, TrainConfig
from rlctl.plan.streaming import StreamParts, streaming_decision
from rlctl.plan.types import Decision


def _section(cfg: dict, name: str) -> dict:
    return cfg.get(name) or {}


def _steady(rows: list[dict], key: str) -> list[float]:
    """``key`` of each training step that has it, the first step left out when there are more."""
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and r.get("kind") != "eval"]
    return vals[1:] if len(vals) > 1 else vals


def _mean(rows: list[dict], key: str) -> float:
    vals = _steady(rows, key)
    return statistics.fmean(vals) if vals else 0.0


def _procs(cfg: dict) -> tuple[int, int, list[str]]:
    """(rollout processes, trainer processes) of the run, and the assumption when config.yaml does not say:
    a colocated run's processes do both; a split run's last ``rollout.procs`` only generate."""
    nproc, procs = int(_section(cfg, "hardware").get("nproc", 0)), int(_section(cfg, "rollout").get("procs", 0))
    said = [] if nproc else ["1 process (config.yaml names no hardware.nproc)"]
    nproc = max(nproc, procs + 1, 1)
    if procs:
        return procs, nproc - procs, said
    return nproc, nproc, said


def run_parts(rows: list[dict], cfg: dict) -> tuple[StreamParts, list[str]] | None:
    """The cost model's inputs read from a run's step records and its config (module docstring), and the
    assumptions made; None when the run recorded no rollout (not an RL run)."""
    rollout, train = _section(cfg, "rollout"), _section(cfg, "train")
    stream = rollout.get("procs", 0) and rollout.get("mode") == "stream"
    if not _steady(rows, "time/rollout") and not (stream and _steady(rows, "async/group_latency_mean")):
        return None
    roll_p, train_p, assumed = _procs(cfg)
    update = (_mean(rows, "time/update") + _mean(rows, "time/logprobs")) * train_p
    if stream:
        lat = tuple(_steady(rows, "async/group_latency_mean"))
        lockstep = _mean(rows, "async/group_latency_max")
        generate = max(0.0, _mean(rows, "time/step") - _mean(rows, "async/idle_rollout_s"))
        assumed += [
            "a lockstep batch takes its mean slowest group's latency",
            "group latencies: the per-update means (the tail within a batch not recorded)",
        ]
    else:
        lockstep = _mean(rows, "time/rollout") * roll_p
        lat = (lockstep,)
        if _steady(rows, "time/tools"):  # the lockstep batch's tool waits: streaming overlaps them
            generate = max(0.0, lockstep - _mean(rows, "time/tools") * roll_p)
            assumed.append("streaming decodes a batch in the lockstep rollout less its tool waits (time/tools)")
        else:
            generate = lockstep
            assumed.append("streaming decodes a batch as fast as lockstep (no tool waits recorded to split off)")
    if roll_p > 1 or train_p > 1:
        assumed.append(f"times of {roll_p} rollout / {train_p} trainer processes scaled linearly to one")
    assumed.append("2 synchronous processes halve the rollout and the update (all-reduce not counted)")
    parts = StreamParts(
        lockstep_rollout_s=lockstep,
        stream_generate_s=generate,
        update_s=update,
        sync_s=_mean(rows, "time/weight_sync"),
        dp_update_s=update / 2,
        dp_rollout_s=lockstep / 2,
        group_latencies=lat,
        max_staleness=int(rollout.get("max_staleness", RolloutConfig.max_staleness)),
        batch=int(train.get("batch_size", TrainConfig.batch_size)),
    )
    return parts, assumed


def with_flags(d: Decision, assumed: list[str], source: str) -> Decision:
    """The decision with the flags that ask for it and what it rests on, in its value and its reason."""
    value = dict(d.value)
    if value["mode"] == "stream":
        value["flags"] = f"--rollout-procs 1 --rollout-mode stream --max-staleness {value['max_staleness']}"
    why = f"{d.why} ({source}; assumed: {'; '.join(assumed)})"
    return Decision(d.key, value, why)


def run_decision(rows: list[dict], cfg: dict) -> Decision | None:
    """``rollout.mode`` from the run's own record (None: not an RL run, nothing to decide from)."""
    got = run_parts(rows, cfg)
    if got is None:
        return None
    parts, assumed = got
    return with_flags(streaming_decision(parts), assumed, "from this run's metrics.jsonl")


NEEDED = (
    "the batch's lockstep rollout (time/rollout) and its tool waits (time/tools)",
    "the update (time/update + time/logprobs)",
    "the weight sync (time/weight_sync)",
    "the group latencies (a stream run's async/group_latency_*)",
)


def planned_decision(mode: str, max_staleness: int, *, multi_turn: bool) -> Decision:
    """Before a run: what the cost model needs, and where the answer comes from. Nothing is predicted here:
    the plan estimates memory, not the seconds of a rollout or an update, so the decision is left to
    `rlctl report` of a first run (:func:`run_decision`)."""
    tools = (
        "with tools the lockstep batch waits for its slowest call each turn, which streaming overlaps; "
        if multi_turn
        else "single-turn, no tools: streaming pays only when responses are long-tailed; "
    )
    why = (
        f"rollout.mode={mode} at --max-staleness {max_staleness}, not predicted: whether streaming pays needs "
        f"{'; '.join(NEEDED)}, measured, not known before a run ({tools}docs/async.md). "
        "`rlctl report RUN` of a first run (of a few steps) says it and the --max-staleness it needs"
    )
    return Decision("rollout.mode", {"mode": mode, "max_staleness": max_staleness, "predicted": False}, why)
