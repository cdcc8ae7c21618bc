"""`rlctl bench compare --peer trl`: the same work through TRL and through rlctl, interleaved, with ratios.

Three kinds of work, on the same model, the same prompts or chats, the same sizes:

* ``rollout``: rlctl's rollout engine (``hf`` by default) against generation done the way TRL's
  ``GRPOTrainer`` does it without vLLM (:class:`TrlGenerate`: each prompt repeated ``n`` times,
  left-padded, ``model.generate`` with TRL's generation config), both in
  :func:`rlctl.bench.rollout.bench_rollout`'s worker processes, repetitions interleaved;
* ``sft``: ``rlctl sft`` (via :mod:`rlctl.bench.train`, i.e. ``launch_job``) against TRL's
  ``SFTTrainer`` on the same chats: one process each, ``batch_size`` conversations per step, the
  loss on the answers only on both sides (TRL gets prompt/completion rows), no activation
  checkpointing. With ``lengths="fixed"`` every sequence is ``seq_len`` tokens, so padding and
  packing change nothing; with ``"spread"`` TRL runs twice, padded (its default) and with
  ``packing=True``, and rlctl packs as it always does;
* ``grpo``: ``rlctl grpo`` against TRL's ``GRPOTrainer``: ``batch`` prompts x ``n`` samples per
  optimizer step, one optimizer step per generation, no KL term (TRL's default ``beta=0``), the
  built-in ``length`` reward on both sides. Neither runs a separate log-prob pass before the update
  (one optimizer step per batch: the update's own forward gives the old log-probs on both sides).

rlctl runs with its default plan (micro batch and packing as ``rlctl plan`` chooses, no speed flag):
the figure is what a user gets. TRL with packing runs at the same ``per_device_train_batch_size``
(issue 11's setting): TRL packs best-fit-decreasing into rows of ``seq_len`` and, padding free,
concatenates the batch's rows into one row of up to batch x seq_len tokens, whose sdpa attention
(a block-diagonal mask from transformers' ``create_causal_mask``) costs that row's square; see
benchmarks/sft_vs_trl.py, which also runs TRL's more favourable one-row-per-step setting.

Each training run is a fresh process and the runs alternate (rlctl, TRL, then TRL, rlctl, ...), so
drift hits both alike. A step's time is its period in the training loop on both sides: from the
end of the previous step to the end of this one (TRL: ``on_step_end`` callbacks; rlctl: the wall
clock stamps of consecutive metrics.jsonl records), so data loading, generation and logging count
alike. Tokens are every token of the step's sequences, padding excluded, on both sides (rlctl's
``tokens`` metric; TRL's ``num_tokens``: the attention mask's sum, or the padding-free row's length).
Two figures: tokens/s, the median over the steps after each run's first; and tokens per CPU second,
all the tokens of the steps after the first over the CPU seconds (user + system) the training
process spent in them (TRL: ``time.process_time`` in the callback; rlctl: its ranks' CPU time,
sampled by :class:`rlctl.bench.common.CpuClock` and read at the metrics records' ``time``), which a
shared machine disturbs less. The ratios are rlctl / TRL (above 1: rlctl is faster).

For SFT with ``--lengths spread`` this is benchmarks/sft_vs_trl.py's measurement: the same chats
(:func:`rlctl.bench.chats.make_chats`: whole chats log-uniform from 32 to seq_len tokens; fixed
lengths keep rlctl.bench.train's data), the same definitions, the same TRL settings, and the same
model when given ``--model runs/bench-sft/model --seq-len 1024``. Left different: here the first
step of a run is the warm-up (there the first two, but one for TRL with packing), with few steps
(``--steps``) a padded TRL step's cost swings with its longest chat, and the script's rlctl CPU
seconds come from /proc at each metrics record, here from 20 ms samples interpolated.

TRL runs in ``python -m rlctl.bench.compare trl-sft|trl-grpo SPEC OUT`` with the same thread count
as rlctl's ranks.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlctl.bench.common import CpuClock, child_env, median
from rlctl.bench.models import BenchModel
from rlctl.errors import UserError, did_you_mean

PEERS = ("trl",)
WORK = ("rollout", "sft", "grpo")


@dataclass
class CompareSettings:
    peer: str = "trl"
    work: list[str] = field(default_factory=lambda: list(WORK))
    reps: int = 2
    steps: int = 3
    device: str = "cpu"
    engine: str = "hf"  # rlctl's rollout engine
    prompts: int = 4  # rollout / grpo: prompts per batch
    n: int = 4
    prompt_len: int = 32
    max_tokens: int = 32
    batch_size: int = 8  # sft: sequences per step
    seq_len: int = 128
    lengths: str = "fixed"  # sft: fixed | spread (see rlctl.bench.train); spread adds a TRL run with packing
    seed: int = 0

    def check(self) -> None:
        if self.peer not in PEERS:
            raise UserError(
                f"unknown --peer {self.peer!r}{did_you_mean(self.peer, PEERS)}; supported: {', '.join(PEERS)}"
            )
        for w in self.work:
            if w not in WORK:
                raise UserError(f"unknown work {w!r}{did_you_mean(w, WORK)}; choose from {', '.join(WORK)}")
        if importlib.util.find_spec("trl") is None:
            raise UserError(
                "`rlctl bench compare --peer trl` needs TRL, which is not installed here: pip install trl "
                "(or pip install 'rlctl[bench]')"
            )
        from rlctl.bench.train import LENGTHS

        if self.lengths not in LENGTHS:
            raise UserError(f"unknown --lengths {self.lengths!r}; use {' or '.join(LENGTHS)}")
        if self.reps < 1 or self.steps < 2:
            raise UserError("--reps must be at least 1 and --steps at least 2 (the first step of a run warms up)")


# ---------------------------------------------------------------------------------------------
# The peer's generation (runs inside a rollout worker process)


class TrlGenerate:
    """Sampling as TRL's GRPOTrainer does it without vLLM, behind rlctl's rollout interface."""

    name = "trl"

    def __init__(self, model_path: str, *, device: str, dtype: str, seed: int = 0):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlctl.rollout.base import default_stop_token_ids, torch_dtype

        self.torch = torch
        self.device = torch.device(device)
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(dtype)).to(self.device).eval()
        self.eos_ids = sorted(default_stop_token_ids(model_path))
        torch.manual_seed(seed)

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling):
        from transformers import GenerationConfig

        from rlctl.rollout import Sample

        torch = self.torch
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        prompts = [p for p in prompt_token_ids for _ in range(n)]  # TRL's RepeatSampler: n copies of a prompt
        width = max(len(p) for p in prompts)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_ids[0]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        config = GenerationConfig(
            max_new_tokens=sampling.max_tokens,
            do_sample=True,
            pad_token_id=pad,
            bos_token_id=self.tok.bos_token_id,
            eos_token_id=self.eos_ids,
            temperature=sampling.temperature or 1.0,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),
            min_p=None,
            repetition_penalty=1.0,
            disable_compile=True,
        )
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        samples = []
        for row, completion in enumerate(out[:, width:].tolist()):
            stop = next((i for i, t in enumerate(completion) if t in self.eos_ids), None)
            tokens = completion[: stop + 1] if stop is not None else completion
            samples.append(Sample(row // n, tokens, [], "stop" if stop is not None else "length"))
        return samples

    def close(self) -> None:
        self.model = None


# ---------------------------------------------------------------------------------------------
# TRL training runs (in a subprocess: python -m rlctl.bench.compare trl-sft|trl-grpo SPEC OUT)


def _step_timer():
    """A TrainerCallback recording each optimizer step's period and TRL's cumulative num_tokens.

    A step's period runs from the previous step's end to its own (data loading, generation,
    logging: the whole loop); the first step's, from its beginning. ``cpu`` holds the CPU seconds
    (user + system, all threads) of this process over the same periods.
    """
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.cpu, self.tokens, self._last = [], [], [], None

        def on_step_begin(self, args, state, control, **kw):
            if self._last is None:
                self._last = (time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kw):
            now = (time.perf_counter(), time.process_time())
            self.times.append(now[0] - self._last[0])
            self.cpu.append(now[1] - self._last[1])
            self._last = now

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "num_tokens" in logs:
                self.tokens.append(float(logs["num_tokens"]))

    return StepTimer()


def _common_args(spec: dict, out_dir: str) -> dict:
    return {
        "output_dir": out_dir,
        "max_steps": spec["steps"],
        "learning_rate": spec["lr"],
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "seed": spec["seed"],
        "use_cpu": spec["device"] == "cpu",
        "bf16": spec["device"] == "cuda",
        "gradient_accumulation_steps": 1,
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
        "disable_tqdm": True,
    }


def trl_sft(spec: dict, out_dir: str):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    # prompt/completion rows: TRL's loss then covers the answer only, as rlctl's does
    data = Dataset.from_list([{"prompt": r["messages"][:1], "completion": r["messages"][1:]} for r in rows])
    args = SFTConfig(
        **_common_args(spec, out_dir),
        per_device_train_batch_size=spec["batch"],
        max_length=spec["seq_len"],
        packing=spec["packing"],
        shuffle_dataset=False,
        gradient_checkpointing=False,
    )
    return SFTTrainer(model=spec["model"], args=args, train_dataset=data)


def trl_grpo(spec: dict, out_dir: str):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlctl.rewards.builtin import length_score

    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    target = spec["max_tokens"]

    def length_reward(completions, **kw):
        return [length_score("", c[-1]["content"], "", {"target_length": target}) for c in completions]

    args = GRPOConfig(
        **_common_args(spec, out_dir),
        per_device_train_batch_size=spec["batch"] * spec["n"],
        num_generations=spec["n"],
        max_completion_length=spec["max_tokens"],
        steps_per_generation=1,
        num_iterations=1,
        beta=0.0,
        temperature=1.0,
        shuffle_dataset=False,
        gradient_checkpointing=False,
    )
    return GRPOTrainer(model=spec["model"], reward_funcs=length_reward, args=args, train_dataset=data)


def run_trl(kind: str, spec_path: str, out_path: str) -> None:
    import resource

    spec = json.loads(Path(spec_path).read_text())
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = {"sft": trl_sft, "grpo": trl_grpo}[kind](spec, out_dir)
        timer = _step_timer()
        trainer.add_callback(timer)
        trainer.train()
    tokens = [b - a for a, b in zip([0.0] + timer.tokens, timer.tokens)]
    steps = [
        {"step": i + 1, "time/step": t, "cpu_s": c, "tokens": k, "tokens_per_s": k / t}
        for i, (t, c, k) in enumerate(zip(timer.times, timer.cpu, tokens))
    ]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out_path).write_text(json.dumps({"steps": steps, "peak_rss_bytes": peak}))


def _trl_process(kind: str, spec: dict, work: Path) -> dict:
    import os

    spec_path, out_path = work / f"trl-{kind}.json", work / f"trl-{kind}-out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "rlctl.bench.compare", f"trl-{kind}", str(spec_path), str(out_path)],
        env=child_env(int(os.environ.get("OMP_NUM_THREADS") or 1)),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else ""
        raise UserError(f"the TRL {kind} run failed (exit {proc.returncode}): {last}")
    return json.loads(out_path.read_text())


# ---------------------------------------------------------------------------------------------
# The comparison


def periods(records: list[dict], clock: CpuClock | None = None) -> list[dict]:
    """rlctl's steps timed like TRL's: from one step's metrics record to the next (the whole loop);
    the first step by its own ``time/step``. ``cpu_s``: the ranks' CPU seconds over the same
    period (the first step: none, it is a warm-up)."""
    out, last = [], None
    for r in records:
        seconds = r["time/step"] if last is None else r["time"] - last
        row = {"step": r["step"], "time/step": seconds, "tokens": r["tokens"], "tokens_per_s": r["tokens"] / seconds}
        if clock is not None and clock.samples and last is not None:
            row["cpu_s"] = clock.at(r["time"]) - clock.at(last)
        last = r["time"]
        out.append(row)
    return out


def _side(runs: list[list[dict]], peak_rss: list[int]) -> dict:
    steady = [r for steps in runs for r in steps[1:]]
    cpu = sum(r.get("cpu_s", 0.0) for r in steady)
    return {
        "tokens_per_s": median(r["tokens_per_s"] for r in steady),
        # all the steady steps' tokens over their CPU seconds (benchmarks/sft_vs_trl.py's figure)
        "tokens_per_cpu_s": sum(r["tokens"] for r in steady) / cpu if cpu > 0 else None,
        "step_s": median(r["time/step"] for r in steady),
        "tokens_per_step": median(r["tokens"] for r in steady),
        "peak_rss_bytes": max(peak_rss) if peak_rss else None,
        "runs": runs,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def compare_rollout(model: BenchModel, s: CompareSettings, log) -> dict:
    from rlctl.bench.rollout import RolloutSettings, bench_rollout

    rs = RolloutSettings(
        prompts=s.prompts,
        n=s.n,
        prompt_len=s.prompt_len,
        max_tokens=s.max_tokens,
        reps=s.reps * 2,
        device=s.device,
        dtype="fp32" if s.device == "cpu" else "bf16",
        seed=s.seed,
    )
    ours, peer = bench_rollout(model.path, [s.engine, "trl"], rs, log=log)
    for row in (ours, peer):
        if row.get("error"):
            raise UserError(f"rollout compare: {row['engine']}: {row['error']}")
    return {
        "work": "rollout",
        "rlctl": ours,
        s.peer: peer,
        "ratio_tokens_per_s": _ratio(ours["tokens_per_s"], peer["tokens_per_s"]),
        "ratio_tokens_per_s_distinct": _ratio(ours["tokens_per_s_distinct"], peer["tokens_per_s_distinct"]),
        "ratio_ttft": _ratio(ours["ttft_s"], peer["ttft_s"]),
    }


def compare_training(method: str, model: BenchModel, s: CompareSettings, work: Path, log) -> dict:
    from rlctl.bench.train import is_rank, prepare_job, run_job, write_data

    ts = _train_settings(method, s)
    data = write_spread_chats(model, s, work) if method == "sft" and s.lengths == "spread" else None
    data = data or write_data(model.path, ts, work)
    spec = {
        "model": str(model.path),
        "data": str(data),
        "steps": s.steps,
        "lr": cfg_lr(method),
        "seed": s.seed,
        "device": s.device,
        "batch": ts.batch,
        "seq_len": s.seq_len,
        "n": s.n,
        "max_tokens": s.max_tokens,
        "packing": False,
    }
    sides = ["rlctl", s.peer] + ([f"{s.peer}_packing"] if method == "sft" and s.lengths == "spread" else [])
    runs: dict[str, list] = {side: [] for side in sides}
    rss: dict[str, list] = {side: [] for side in sides}
    for rep in range(s.reps):
        for side in sides[rep % len(sides) :] + sides[: rep % len(sides)]:  # rotated: drift hits every side alike
            log(f"{method}: repetition {rep + 1}/{s.reps}, {side}")
            if side == "rlctl":
                cfg, plan = prepare_job(model, ts, work / f"rlctl-{rep}", data=data)
                with CpuClock(is_rank) as clock:
                    records, sampler = run_job(cfg, plan)
                runs[side].append(periods(records, clock))
                rss[side].append(max(sampler.peak.values(), default=0))
            else:
                out = _trl_process(method, {**spec, "packing": side.endswith("_packing")}, work)
                runs[side].append(out["steps"])
                rss[side].append(out["peak_rss_bytes"])
    row = {"work": method, **{side: _side(runs[side], rss[side]) for side in sides}}
    return _with_ratios(row, s.peer)


def _train_settings(method: str, s: CompareSettings):
    """rlctl's side of the comparison as a bench train job: one process, the plan's micro-batch, no
    activation checkpointing and (RL) no KL term, as the peer runs it."""
    from rlctl.bench.train import TrainSettings

    is_rl = method != "sft"
    return TrainSettings(
        method=method,
        steps=s.steps,
        device=s.device,
        nproc=1,
        seed=s.seed,
        seq_len=s.seq_len,
        lengths=s.lengths,
        batch_size=s.prompts if is_rl else s.batch_size,
        n=s.n,
        prompt_len=s.prompt_len,
        max_tokens=s.max_tokens,
        rollout=s.engine,
        micro_batch_size=0,  # the plan's choice, as a user gets it
        sets=["parallel.activation_checkpointing=false"] + (["algo.kl_coef=0"] if is_rl else []),
    )


def _with_ratios(row: dict, peer: str) -> dict:
    """``row`` with rlctl's throughput and step time over the peer's (and over the peer's with packing)."""
    row["ratio_tokens_per_s"] = _ratio(row["rlctl"]["tokens_per_s"], row[peer]["tokens_per_s"])
    row["ratio_tokens_per_cpu_s"] = _ratio(row["rlctl"]["tokens_per_cpu_s"], row[peer]["tokens_per_cpu_s"])
    row["ratio_step_s"] = _ratio(row["rlctl"]["step_s"], row[peer]["step_s"])
    if f"{peer}_packing" in row:
        packed = row[f"{peer}_packing"]
        row["ratio_tokens_per_s_packing"] = _ratio(row["rlctl"]["tokens_per_s"], packed["tokens_per_s"])
        row["ratio_tokens_per_cpu_s_packing"] = _ratio(row["rlctl"]["tokens_per_cpu_s"], packed["tokens_per_cpu_s"])
    return row


def write_spread_chats(model: BenchModel, s: CompareSettings, work: Path) -> Path:
    """benchmarks/sft_vs_trl.py's chats (:func:`rlctl.bench.chats.make_chats`), enough that TRL with
    packing (``batch_size`` rows of ~seq_len tokens a step) does not run out within ``steps``."""
    from transformers import AutoTokenizer

    from rlctl.bench.chats import make_chats

    tok = AutoTokenizer.from_pretrained(str(model.path))
    chats = make_chats(max(2, 5 * s.steps) * s.batch_size, s.seq_len, tok, seed=s.seed)
    path = work / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    return path


def cfg_lr(method: str) -> float:
    """The learning rate of rlctl's preset for ``method`` (TRL gets the same)."""
    from rlctl.config import build_config
    from rlctl.presets import method_layers

    return build_config(method, method_layers(method, None)).train.lr


def bench_compare(model: BenchModel, s: CompareSettings, *, log=lambda msg: None) -> list[dict]:
    """Every requested kind of work through rlctl and the peer; one row each."""
    try:
        import trl
    except ImportError:
        raise UserError(
            "bench compare runs TRL as the peer, which is not installed: pip install 'rlctl[bench]'"
        ) from None

    s.check()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlctl-bench-compare-") as tmp:
        for w in s.work:
            log(f"comparing {w} with {s.peer} {trl.__version__}")
            if w == "rollout":
                rows.append(compare_rollout(model, s, log))
            else:
                d = Path(tmp) / w
                d.mkdir()
                rows.append(compare_training(w, model, s, d, log))
            rows[-1]["peer_version"] = trl.__version__
    return rows


if __name__ == "__main__":
    kind = sys.argv[1].removeprefix("trl-")
    run_trl(kind, sys.argv[2], sys.argv[3])
