"""The :class:`Plan` type and its JSON form (plan.json in a run directory: the record of how the job was planned).

A plan records its choices as data: each :class:`Decision` names what was decided (a config key such as
``parallel.backend``, or a plan fact such as ``rejected``), the value chosen, and why in words; the
memory :class:`Verdict` and the ``advice`` (what would fit) are fields of their own. Code reads the keys
and values; only the rendering (:attr:`Plan.reasons`, rlctl.plan.render) reads the words.

No torch import and nothing of the planner: a rank or a tool reads a plan without planning.
``Plan.from_dict(plan.to_dict()) == plan``, through JSON too; a dict with an unknown or a missing
key is a one-line :class:`~rlctl.errors.UserError`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rlctl.errors import UserError
from rlctl.estimate.result import MemoryEstimate
from rlctl.estimate.settings import check_keys


@dataclass(frozen=True)
class Decision:
    """One choice of the plan: ``key`` (a config key such as ``parallel.backend``, or a plan fact:
    ``model``, ``options``, ``rejected``, ``parallel``, ``offload``), the ``value`` chosen (JSON: a
    string, number, bool, list or dict), and ``why``: the choice in words, as `rlctl plan` prints it."""

    key: str
    value: Any
    why: str

    def to_dict(self) -> dict:
        return {"key": self.key, "value": self.value, "why": self.why}

    @classmethod
    def from_dict(cls, d: dict) -> Decision:
        check_keys("plan decision", d, ("key", "value", "why"))
        return cls(d["key"], d["value"], d["why"])


@dataclass(frozen=True)
class Verdict:
    """The memory estimate's answer for the plan."""

    fits: bool
    why: str  # fits: the peak and the headroom; does not fit: each limit it overflows, "; "-joined

    @classmethod
    def of(cls, est: MemoryEstimate) -> Verdict:
        problems = est.problems
        return cls(not problems, "; ".join(problems) if problems else est.fit_summary)

    @property
    def text(self) -> str:
        return f"{'fits' if self.fits else 'does not fit'}: {self.why}"


@dataclass
class Plan:
    method: str
    model: str  # catalog name or path
    params: int
    device: str  # cuda | cpu
    gpu: str  # catalog GPU type, or "cpu"
    gpus: int  # devices the job uses (0 on CPU)
    nodes: int
    nproc_per_node: int
    backend: str  # fsdp | megatron
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    sp: int  # Ulysses sequence parallel size (FSDP engine)
    sequence_parallel: bool
    rollout: str | None  # hf | vllm | sglang; None for sft
    rollout_tp: int
    rollout_mem_fraction: float
    rollout_eval_mem_fraction: float  # split runs: the evaluation engine's share of a trainer GPU (0: none)
    micro_batch_size: int
    activation_checkpointing: bool
    selective_checkpointing: bool  # MLPs recomputed, attention kept (FSDP)
    offload_activations: bool  # saved activations in pinned host memory (FSDP)
    shard: bool  # FSDP2 sharding; False: the plain module on one device
    offload_params: bool
    offload_optimizer: bool
    dtype: str
    attn: str
    lora_rank: int
    decisions: list[Decision]  # in the order they are explained
    warnings: list[str]
    verdict: Verdict
    advice: list[str]  # the changes that would make an unfit plan fit, each one way (empty when it fits)
    estimate: MemoryEstimate
    fits: bool  # the estimate fits (the verdict's answer, kept apart for readers of plan.json)

    def decided(self, key: str) -> Any:
        """The value of the last decision on ``key`` (KeyError when the plan made none)."""
        for d in reversed(self.decisions):
            if d.key == key:
                return d.value
        raise KeyError(key)

    @property
    def reasons(self) -> list[str]:
        """The plan in words, one line per decision, then the estimate's verdict and what would fit."""
        lines = [d.why for d in self.decisions] + [f"estimate: {self.verdict.text}"]
        return lines + ([advice_line(self.advice)] if self.advice else [])

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "estimate"}
        out["decisions"] = [d.to_dict() for d in self.decisions]
        out["warnings"], out["advice"] = list(self.warnings), list(self.advice)
        out["verdict"] = {"fits": self.verdict.fits, "why": self.verdict.why}
        out["reasons"] = self.reasons  # derived, for people reading plan.json; from_dict does not read it
        out["estimate"] = self.estimate.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        """The inverse of :meth:`to_dict`; an unknown or missing key is a UserError."""
        check_keys("plan", d, [f.name for f in fields(cls)] + ["reasons"])
        kw = {k: v for k, v in d.items() if k != "reasons"}
        kw["decisions"] = [Decision.from_dict(x) for x in d["decisions"]]
        kw["warnings"], kw["advice"] = list(d["warnings"]), list(d["advice"])
        verdict = check_keys("plan verdict", d["verdict"], ("fits", "why"))
        kw["verdict"] = Verdict(verdict["fits"], verdict["why"])
        kw["estimate"] = MemoryEstimate.from_dict(d["estimate"])
        return cls(**kw)


def advice_line(advice: list[str]) -> str:
    """What would fit, in one line: each way, joined by "; or"."""
    return "what would fit: " + "; or ".join(advice)


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write ``plan`` as JSON to ``path`` atomically (a reader sees the old file or the new one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(plan.to_dict(), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_plan(path: str | Path) -> Plan:
    """The plan saved at ``path``; a missing or unreadable file is a one-line UserError."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"no plan at {path}: run the job (or its --dry-run) to plan it again") from None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the plan {path}: {e}; delete it and plan again") from None
    try:
        return Plan.from_dict(data)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
