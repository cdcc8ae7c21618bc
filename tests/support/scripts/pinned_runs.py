"""Short seeded CPU runs whose every non-timing metric and sample a refactoring must leave unchanged.

``python tests/support/scripts/pinned_runs.py OUT [NAME ...]`` runs each configuration of :data:`RUNS` (all
when no NAME) through the CLI on the checkout this file lies in (PYTHONPATH: that checkout) and writes
``OUT/NAME.json``: the metrics.jsonl records without their timings, and samples.jsonl.
``python tests/support/scripts/pinned_runs.py --compare A B`` tells every difference between two such folders
(exit 1 when any). To hold a change against the code before it: record on a copy of that commit
(``git archive BASE | tar -x -C DIR``, then this script copied into DIR and run with ``PYTHONPATH=DIR``),
record on the change, compare. Exact equality holds on one machine; figures from another CPU or torch
build can differ in the last bits, so they are not kept as a test's expected values.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from tests.support.cli import run_cli  # noqa: E402
from tests.support.rl import REWARDS, arith_rows, failure, rl_args  # noqa: E402
from tests.support.sft import chat_rows, write_jsonl  # noqa: E402

TIMING = ("time/", "tokens_per_s", "samples_per_s")  # and "time", the record's clock


def timing(key: str) -> bool:
    return key == "time" or key.startswith(TIMING)


def _rl(model: Path, tmp: Path, run: Path, *extra: str) -> list[str]:
    data = write_jsonl(tmp / "data.jsonl", arith_rows(32))
    val = write_jsonl(tmp / "val.jsonl", arith_rows(4, seed=9))
    common = ("--rollout", "hf", "--samples-every", "1", "--set", "checkpoint.export_hf=false")
    return rl_args(model, data, run, *common, "--val-data", str(val), *extra)


def grpo_packed(models, tmp, run):
    return "grpo", _rl(models["tiny"], tmp, run, "--max-steps", "3", "--kl-coef", "0.001", "--eval-every", "2")


def grpo_unshared(models, tmp, run):
    """Packed rows without shared prefixes: eager attention cannot run per-block masks (FSDPEngine.shares_prefix)."""
    return "grpo", _rl(models["tiny"], tmp, run, "--max-steps", "2", "--set", "model.attn=eager")


def grpo_vl(models, tmp, run):
    """A tiny Qwen2-VL on pictures (examples/vlm_colors): images in the rollout, shared-prefix passes with sdpa."""
    sys.path.insert(0, str(REPO / "examples" / "vlm_colors"))
    import colors

    data = colors.write_rl_parquet(tmp / "rl.parquet", colors.make_pictures(8, seed=3))
    return "grpo", [
        "--model", str(models["vl"]), "--data", str(data), "--output-dir", str(run), "--device", "cpu",
        "--nproc", "2", "--batch-size", "4", "--n", "4", "--max-prompt-len", "128", "--max-response-len", "6",
        "--lr", "1e-2", "--rollout", "hf", "--reward", f"{REWARDS}:digits", "--set", "model.attn=sdpa",
        "--max-steps", "2", "--samples-every", "1", "--set", "checkpoint.export_hf=false",
    ]  # fmt: skip


def grpo_dynamic(models, tmp, run):
    args = _rl(models["tiny"], tmp, run, "--max-steps", "3", "--dynamic-sampling", "--set", "algo.dynamic_max_rounds=3")
    args[args.index("--reward") + 1] = f"{REWARDS}:digits_when_odd"
    return "grpo", args


def grpo_remax(models, tmp, run):
    return "grpo", _rl(models["tiny"], tmp, run, "--max-steps", "2", "--set", "algo.adv=remax")


def grpo_split(models, tmp, run):
    extra = ("--max-steps", "3", "--batch-size", "2", "--n", "4", "--rollout-procs", "1", "--max-staleness", "1")
    return "grpo", _rl(models["tiny"], tmp, run, *extra, "--eval-every", "2")


def grpo_split_random_init(models, tmp, run):
    """A split run of a randomly initialised model: every rollout engine loads RUN/rollout_init."""
    extra = ("--max-steps", "2", "--batch-size", "2", "--n", "4", "--rollout-procs", "1")
    extra += ("--set", "model.random_init=true")
    return "grpo", _rl(models["tiny"], tmp, run, *extra, "--eval-every", "1")


def ppo(models, tmp, run):
    extra = ("--max-steps", "3", "--n", "4", "--mini-batch-size", "2", "--kl-coef", "0.001")
    return "ppo", _rl(models["tiny"], tmp, run, *extra, "--set", "algo.critic_lr=5e-3", "--set", "algo.kl_target=0.01")


def grpo_tools(models, tmp, run):
    """The tool-calling run of tests/agents/test_agent_runs.py, with --max-turns left to its default."""
    from tests.agents.conftest import TOOLS_FILE

    tools = tmp / "tools.py"
    tools.write_text(TOOLS_FILE)
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in ((3, 4), (1, 6), (2, 5), (0, 7))]
    data = write_jsonl(tmp / "data.jsonl", rows * 2)
    reward = REPO / "tests" / "support" / "agent_rewards.py"
    return "grpo", [
        "--model", str(models["agent"]), "--data", str(data), "--output-dir", str(run), "--device", "cpu",
        "--nproc", "2", "--batch-size", "2", "--n", "4", "--max-prompt-len", "160", "--max-response-len", "96",
        "--lr", "1e-3", "--reward", f"{reward}:answered", "--tools", str(tools), "--rollout", "hf",
        "--max-steps", "2", "--set", "checkpoint.export_hf=false", "--samples-every", "1",
    ]  # fmt: skip


def sft(models, tmp, run):
    data = write_jsonl(tmp / "chat.jsonl", chat_rows(24))
    return "sft", [
        "--model", str(models["tiny"]), "--data", str(data), "--output-dir", str(run), "--device", "cpu",
        "--nproc", "2", "--batch-size", "4", "--max-len", "128", "--max-steps", "4", "--lr", "1e-3",
        "--set", "checkpoint.export_hf=false",
    ]  # fmt: skip


RUNS = {
    f.__name__: f
    for f in (grpo_packed, grpo_unshared, grpo_vl, grpo_dynamic, grpo_remax, grpo_split, grpo_split_random_init)
    + (ppo, grpo_tools, sft)
}


def models(tmp: Path, names: list[str]) -> dict[str, Path]:
    from rlctl.testing import build_tiny_model

    out = {"tiny": build_tiny_model(tmp / "tiny", seed=0)}
    if "grpo_tools" in names:
        from tests.agents.conftest import _memorize

        out["agent"] = build_tiny_model(tmp / "agent", seed=0, tools=True)
        _memorize(out["agent"])
    if "grpo_vl" in names:
        from rlctl.testing import build_tiny_vl_model

        out["vl"] = build_tiny_vl_model(tmp / "vl", seed=0)
    return out


def outcome(run: Path) -> dict:
    """A run's records without timings, and its samples."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kept = [{k: v for k, v in r.items() if not timing(k)} for r in records]
    samples = run / "samples.jsonl"
    lines = samples.read_text().splitlines() if samples.is_file() else []
    return {"metrics": kept, "samples": [json.loads(line) for line in lines]}


def record(out: Path, names: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ms = models(Path(tmp), names)
        for name in names:
            work = Path(tmp) / name
            work.mkdir()
            method, args = RUNS[name](ms, work, work / "run")
            res = run_cli(method, *args)
            if res.returncode != 0:
                raise SystemExit(f"{name} failed:\n{failure(res, work / 'run')}")
            (out / f"{name}.json").write_text(json.dumps(outcome(work / "run"), indent=1, sort_keys=True) + "\n")
            print(f"{name}: recorded", flush=True)


def differences(a: dict, b: dict) -> list[str]:
    """Every metric or sample that differs between two outcomes (exact equality)."""
    out = []
    if len(a["metrics"]) != len(b["metrics"]):
        out.append(f"{len(a['metrics'])} records vs {len(b['metrics'])}")
    for ra, rb in zip(a["metrics"], b["metrics"]):
        for k in sorted(set(ra) | set(rb)):
            if not timing(k) and ra.get(k) != rb.get(k):
                out.append(f"step {ra.get('step')} {ra.get('kind', 'train')} {k}: {ra.get(k)!r} vs {rb.get(k)!r}")
    if a["samples"] != b["samples"]:
        out.append("samples.jsonl differs")
    return out


def compare(a: Path, b: Path) -> int:
    bad = 0
    for f in sorted(a.glob("*.json")):
        other = b / f.name
        diffs = (
            differences(json.loads(f.read_text()), json.loads(other.read_text())) if other.is_file() else ["missing"]
        )
        print(f"{f.stem}: {'equal' if not diffs else 'DIFFERENT'}")
        for d in diffs[:20]:
            print(f"  {d}")
        bad += bool(diffs)
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.argv[1] == "--compare":
        raise SystemExit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    record(Path(sys.argv[1]), sys.argv[2:] or list(RUNS))
