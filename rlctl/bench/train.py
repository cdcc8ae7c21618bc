"""`rlctl bench train`: a real ``sft`` / ``grpo`` / ``ppo`` / ``dpo`` / ``rm`` run on synthetic data, measured.

The job is configured and planned by :func:`rlctl.job.resolve_job`, checked by :func:`rlctl.checks.check_job`
and started by :func:`rlctl.launch.launch_job`, the code path of ``rlctl sft|grpo|ppo``. The data is random text
written by this module: SFT chats (a short fixed question, a random answer) long enough to fill
``seq_len`` tokens (cut there with ``data.truncation=right``; with ``lengths="spread"`` the answers
are log-uniform between 16 and ``seq_len`` tokens, as in real chat data, so packing matters), preference
pairs (dpo, rm: the same question, a chosen and a rejected random answer of about ``seq_len / 2`` tokens), RL
prompts of about ``prompt_len`` tokens scored by the built-in ``length`` reward. ``teacher`` (grpo / ppo)
makes the RL run on-policy distillation (``algo.teacher``; a catalog name with random weights written to
disk, as the teacher is loaded from its files). Then, from the run's metrics.jsonl:

* tokens/s and the step time (median over the steps after the first, which warms up), split into
  rollout / log-probs / update / weight sync for the RL recipes (their ``time/*`` metrics);
* MFU (:mod:`rlctl.bench.mfu`) against the devices' peak: the catalog's bf16 figure on GPUs, an
  fp32 matmul peak measured in this run on CPUs;
* peak memory of the busiest rank beside the plan's estimate (``plan.estimate.peak_bytes``, what
  ``rlctl estimate memory`` prints for the same settings) and ``(measured - estimated) / measured``.
  Measured from outside, sampled: on GPUs the memory in use on each GPU (``nvidia-smi``, CUDA
  context included, as in the estimate) less its use before the job; on CPUs each rank's RSS
  (psutil) less the RSS of a process that only imports the recipe (the interpreter and libraries,
  which the CPU estimate leaves out). When the recipe logs ``mem/peak_bytes`` (and ``mem/base_bytes``) those are used.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rlctl.bench import mfu as M
from rlctl.bench.common import ProcessSampler, median, relative_error, run_measured, timeline_points
from rlctl.bench.models import BenchModel, token_space
from rlctl.errors import UserError
from rlctl.names import PAIR_METHODS, Method, choices

METHODS = choices(Method)
LENGTHS = ("fixed", "spread")
SPLIT_KEYS = ("time/rollout", "time/logprobs", "time/update", "time/weight_sync")
TEACHER_KEY = "time/teacher"  # on-policy distillation (algo.distill=sampled): the teacher's scoring pass
RECIPE_PEAK_KEY = "mem/peak_bytes"  # per-rank peak, logged by the recipe (max over ranks)
RECIPE_BASE_KEY = "mem/base_bytes"  # the same process before the model was built


@dataclass
class TrainSettings:
    method: str = "sft"
    steps: int = 3
    device: str | None = None  # cpu | cuda; None: the plan decides
    nproc: int = 0  # processes per node (0 = the plan's choice)
    gpus: int = 0
    gpu: str = ""
    batch_size: int = 0  # 0 = 8 sequences (sft) / 4 prompts (rl)
    seq_len: int = 128  # sft: tokens per sequence (the longest, with lengths="spread")
    lengths: str = "fixed"  # sft: fixed (every sequence seq_len tokens) | spread (log-uniform, 16 to seq_len)
    n: int = 4  # rl: samples per prompt
    prompt_len: int = 32  # rl: prompt tokens (about)
    max_tokens: int = 32  # rl: response tokens at most
    rollout: str | None = None  # hf | vllm | sglang; None: the plan decides
    micro_batch_size: int = 0
    lora_rank: int = 0
    teacher: str = ""  # rl: on-policy distillation's teacher (algo.teacher); "" = none
    sets: list[str] = field(default_factory=list)
    seed: int = 0

    def check(self) -> None:
        if self.method not in METHODS:
            from rlctl.errors import did_you_mean

            raise UserError(
                f"unknown --method {self.method!r}{did_you_mean(self.method, METHODS)}; use {', '.join(METHODS)}"
            )
        if self.steps < 1:
            raise UserError(f"--steps must be at least 1, got {self.steps}")
        if self.lengths not in LENGTHS:
            raise UserError(f"unknown --lengths {self.lengths!r}; use {' or '.join(LENGTHS)}")
        if self.teacher and not self.is_rl:
            raise UserError(
                f"--teacher is on-policy distillation, an RL run: use --method grpo or ppo, not {self.method}"
            )

    @property
    def is_rl(self) -> bool:
        return self.method not in ("sft", *PAIR_METHODS)

    @property
    def is_pairs(self) -> bool:
        return self.method in PAIR_METHODS

    @property
    def batch(self) -> int:
        return self.batch_size or (4 if self.is_rl else 8)


# ---------------------------------------------------------------------------------------------
# Synthetic data


def random_text(tok, allowed: list[int], tokens: int, rng: random.Random) -> str:
    """Text of random tokens; it re-tokenizes to about ``tokens`` tokens (byte-level BPE merges differ)."""
    return tok.decode([rng.choice(allowed) for _ in range(tokens)], skip_special_tokens=True)


def text_of_at_most(tok, allowed: list[int], tokens: int, rng: random.Random) -> str:
    """Random text that re-tokenizes to ``tokens`` tokens or fewer (cut until it does)."""
    text = random_text(tok, allowed, tokens, rng)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    keep = min(tokens, len(ids))
    while keep >= 1 and len(tok(text, add_special_tokens=False)["input_ids"]) > tokens:
        text = tok.decode(ids[:keep], skip_special_tokens=True)  # the first `keep` tokens, fewer each round
        keep -= 1
    return text


def write_data(model_path: Path, s: TrainSettings, out: Path) -> Path:
    """Write the synthetic dataset for ``s.method`` to ``out/data.jsonl``."""
    allowed, tok = token_space(model_path)
    rng = random.Random(s.seed)
    rows_needed = s.batch * s.steps
    if s.is_pairs:  # a short question, two random answers of about half seq_len (rm refuses a longer row)
        rows = [
            {
                "prompt": "Write some text.",
                "chosen": text_of_at_most(tok, allowed, s.seq_len // 2, rng),
                "rejected": text_of_at_most(tok, allowed, s.seq_len // 2, rng),
            }
            for _ in range(rows_needed)
        ]
    elif not s.is_rl:  # a short question and a random answer, cut at seq_len (data.truncation=right)

        def answer_tokens() -> int:  # fixed: more than fits, so every sequence is seq_len; spread: like real chats
            return 2 * s.seq_len if s.lengths == "fixed" else round(2 ** rng.uniform(4, math.log2(max(17, s.seq_len))))

        rows = [
            {
                "messages": [
                    {"role": "user", "content": "Write some text."},
                    {"role": "assistant", "content": random_text(tok, allowed, answer_tokens(), rng)},
                ]
            }
            for _ in range(rows_needed)
        ]
    else:
        rows = [
            {
                "prompt": random_text(tok, allowed, s.prompt_len, rng),
                "answer": "",
                "extra_info": {"target_length": s.max_tokens},
            }
            for _ in range(rows_needed)
        ]
    path = out / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job_options(model: BenchModel, s: TrainSettings, data: Path, prompt_tokens: int, run_dir: Path) -> dict:
    """The options of ``rlctl <method>`` that this benchmark sets (None = the preset's)."""
    opts = {
        "model.name": str(model.path),
        "model.random_init": model.random_init or None,
        "data.path": str(data),
        "hardware.device": s.device,
        "hardware.nproc": s.nproc or None,
        "hardware.gpus": s.gpus or None,
        "hardware.gpu": s.gpu or None,
        "output_dir": str(run_dir),
        "train.max_steps": s.steps,
        "train.batch_size": s.batch,
        "train.micro_batch_size": s.micro_batch_size or None,
        "train.seed": s.seed,
        "lora.rank": s.lora_rank or None,
        "checkpoint.export_hf": False,
        "data.val_fraction": 0.0,
        "data.shuffle": False,
    }
    if s.is_rl:
        opts.update(
            {
                "rollout.n": s.n,
                "rollout.max_prompt_len": prompt_tokens,
                "rollout.max_response_len": s.max_tokens,
                "rollout.engine": s.rollout,
                "reward.fn": "length",
                "algo.teacher": s.teacher or None,
            }
        )
    else:
        opts.update({"train.max_len": s.seq_len, "data.truncation": "right"})
    return opts


# ---------------------------------------------------------------------------------------------
# Memory and peak FLOP/s, measured from outside the ranks


def import_baseline_bytes(method: str, rollout: str | None) -> int:
    """Peak RSS of a process that only imports ``rlctl.recipes.<method>`` (torch, transformers, ...)
    and the rollout engine's module (vLLM's libraries for the vllm engine)."""
    code = f"import rlctl.recipes.{method}" + (f"\nimport rlctl.rollout.{rollout}" if rollout else "")
    _, rss, _ = run_measured(code)
    return rss


def is_rank(cmdline: list[str]) -> bool:
    """A rank runs ``python -m rlctl.recipes.<method>``; torchrun's own command names it too."""
    return "torch.distributed.run" not in cmdline and any(part.startswith("rlctl.recipes.") for part in cmdline)


def device_peak(plan, world: int) -> dict:
    """Peak FLOP/s of the ``world`` devices of the job, and where the figure comes from."""
    if plan.device == "cuda":
        one = M.gpu_peak_flops(plan.gpu)
        return {"flops": one * world, "per_device_flops": one, "source": f"catalog: {plan.gpu} dense bf16"}
    threads = int(os.environ.get("OMP_NUM_THREADS") or 1)  # what launch_job gives each rank
    one = M.measure_cpu_peak(threads)
    cores = os.cpu_count() or 1
    usable = min(world * threads, cores) / threads  # ranks beyond the cores share them
    return {
        "flops": one * usable,
        "per_device_flops": one,
        "threads_per_process": threads,
        "source": f"measured fp32 matmul, {threads} thread(s) per process x {usable:g} processes",
    }


# ---------------------------------------------------------------------------------------------
# From metrics.jsonl to the result


def step_records(metrics_path: Path) -> list[dict]:
    from rlctl.metrics import read_metrics

    return [r for r in read_metrics(metrics_path) if "step" in r and r.get("kind") != "eval"]


def critic_flops_params(spec) -> int:
    """PPO's critic: the policy's body with a one-output value head instead of the lm_head."""
    return M.flops_params(spec) - spec.vocab_size * spec.hidden_size + spec.hidden_size


def step_flops(spec, cfg, record: dict, sequences: int, teacher=None) -> dict[str, float]:
    """Model FLOPs of one step by phase (see rlctl.bench.mfu for the convention); ``teacher``: the ModelSpec of
    on-policy distillation's teacher, one forward of every sampled token (in the update with algo.distill=full,
    each epoch)."""
    tokens = float(record.get("tokens") or 0)
    seq = tokens / max(1, sequences)
    train, fwd = M.train_flops_per_token(spec, seq), M.forward_flops_per_token(spec, seq)
    if cfg.method == "sft" or cfg.method == "rm" or (cfg.method == "dpo" and cfg.pref.precompute_ref):
        return {"update": tokens * train}  # dpo's precomputed reference pass runs before the first step
    if cfg.method == "dpo":  # the reference's forward every step
        return {"update": tokens * train + tokens * fwd}
    from rlctl.recipes.rl.update import skips_old_logprobs

    a = cfg.algo
    # the actor's old log-probs (skipped when every batch gets one optimizer step and no KL term reads them), the
    # reference's; read from the config, not from time/logprobs, which PPO's values pass records too
    passes = (not skips_old_logprobs(cfg)) + (a.kl_coef > 0)
    out = {
        "rollout": tokens * fwd,  # every token of every sample goes through the engine once
        "logprobs": tokens * fwd * passes,
        "update": tokens * train * a.ppo_epochs,
    }
    if teacher is not None:
        scored = tokens * M.forward_flops_per_token(teacher, seq)
        if cfg.algo.distill == "full":
            out["update"] += scored * a.ppo_epochs
        else:
            out["logprobs"] += scored
    if cfg.method == "ppo":  # values, then the critic's update
        scale = critic_flops_params(spec) / M.flops_params(spec)
        out["logprobs"] += tokens * fwd * scale
        out["update"] += tokens * train * a.ppo_epochs * scale
    return out


def step_sequences(cfg) -> int:
    """Sequences of one step: SFT's, a pair method's chosen and rejected, RL's samples."""
    per_row = {"sft": 1, "dpo": 2, "rm": 2}.get(cfg.method, cfg.rollout.n)
    return cfg.train.batch_size * per_row


def summarize(model: BenchModel, cfg, records: list[dict], peak: dict, memory: dict) -> dict:
    from rlctl.catalog import resolve_model

    steady = records[1:] if len(records) > 1 else records
    rl = cfg.method in ("grpo", "ppo")
    times = {"step": median(r["time/step"] for r in steady)}
    for key in (*SPLIT_KEYS, TEACHER_KEY):
        # RL steps always split into these phases (a skipped log-prob pass takes 0 s); the teacher's when it ran
        if (rl and key != TEACHER_KEY) or any(key in r for r in steady):
            times[key.split("/", 1)[1]] = median(r.get(key, 0.0) for r in steady)
    if len(times) > 1:
        times["other"] = times["step"] - sum(v for k, v in times.items() if k != "step")
    teacher = resolve_model(cfg.algo.teacher) if rl and cfg.algo.teacher else None
    flops = [step_flops(model.spec, cfg, r, step_sequences(cfg), teacher) for r in steady]
    step_total = median(sum(f.values()) for f in flops)
    result = {
        "tokens_per_s": median(r["tokens_per_s"] for r in steady),
        "tokens_per_step": median(r.get("tokens") for r in steady),
        "time_s": times,
        "flops_per_step": step_total,
        "mfu": M.mfu(step_total, times["step"], peak["flops"]),
        "peak_flops": peak,
    }
    if rl and times.get("update"):
        result["mfu_update"] = M.mfu(median(f["update"] for f in flops), times["update"], peak["flops"])
    result["memory"] = memory
    return result


def measured_memory(records: list[dict], sampler: ProcessSampler, baseline: int, estimate, device: str) -> dict:
    """Peak of the busiest rank beside the estimate; ``relative_error`` from these two numbers."""
    recipe_peak = [r[RECIPE_PEAK_KEY] for r in records if RECIPE_PEAK_KEY in r]
    if recipe_peak:
        base = max((r.get(RECIPE_BASE_KEY, 0) for r in records), default=0) if device == "cpu" else 0
        raw, source = max(recipe_peak), f"recipe metric {RECIPE_PEAK_KEY}"
    else:
        if not sampler.peak:
            raise UserError("no rank process was seen while the job ran; cannot measure its memory")
        raw = max(sampler.peak.values())
        base = baseline if device == "cpu" else 0
        source = (
            "nvidia-smi memory.used per GPU less its use before the job, sampled"
            if device == "cuda"
            else "psutil RSS per rank, sampled"
        )
    measured = raw - base
    estimated = estimate.peak_bytes
    return {
        **cuda_step_memory(records),
        "estimated_allocated_bytes": estimate.phases[estimate.peak_phase].allocated_bytes,
        "estimated_reserved_bytes": estimate.phases[estimate.peak_phase].reserved_bytes,
        "source": source,
        "ranks": dict(sorted(sampler.peak.items())),
        "samples": sampler.samples,
        "rank_peak_bytes": raw,
        "baseline_bytes": base,
        "baseline": "RSS of a process that only imports the recipe" if base else None,
        "measured_bytes": measured,
        "estimated_bytes": estimated,
        "estimated_phase": estimate.peak_phase,
        "relative_error": relative_error(measured, estimated) if measured > 0 else None,
        **peak_timing(records, sampler),
    }


# what the recipe logs with each step on CUDA (rlctl.runtime.cuda_memory.cuda_memory_peaks) -> the result's key
CUDA_STEP_KEYS = {
    "mem/allocated_peak_bytes": "torch_allocated_peak_bytes",
    "mem/reserved_peak_bytes": "torch_reserved_peak_bytes",
    "mem/device_used_bytes": "device_used_at_steps_bytes",  # cudaMemGetInfo at the end of each step, the largest
    "mem/outside_torch_bytes": "outside_torch_at_steps_bytes",  # of that, what torch's allocator does not hold
}


def cuda_step_memory(records: list[dict]) -> dict:
    """The largest of each CUDA memory figure the steps logged (none on CPU)."""
    return {
        name: max(r[key] for r in records if key in r)
        for key, name in CUDA_STEP_KEYS.items()
        if any(key in r for r in records)
    }


def peak_timing(records: list[dict], sampler: ProcessSampler) -> dict:
    """When the sampled peak happened, in seconds after the last step's record (negative: during training;
    after it: the final checkpoint save, the export, the shutdown), the sampled timeline beside the steps'
    times (seconds after the sampling started) and, on GPUs, the processes holding GPU memory at the peak."""
    if not sampler.peak_time or not records or "time" not in records[-1]:
        return {}
    key = max(sampler.peak, key=sampler.peak.get)
    start = sampler.started
    return {
        "peak_after_last_step_s": round(sampler.peak_time[key] - records[-1]["time"], 2),
        "step_times_s": [round(r["time"] - start, 1) for r in records if "time" in r],
        "timeline_gb": timeline_points(sampler.timeline, start),
        **({"processes_at_peak": sampler.processes_at_peak} if sampler.processes_at_peak else {}),
    }


# ---------------------------------------------------------------------------------------------
# The benchmark


def prepare_job(model: BenchModel, s: TrainSettings, work: Path, data: Path | None = None):
    """(cfg, plan) of the job, configured and planned as ``rlctl <method>`` does; writes the data unless given."""
    from rlctl.job import ready_to_launch, resolve_job

    s.check()
    data = data or write_data(model.path, s, work)
    longest = longest_prompt(model.path, data) if s.is_rl else 0
    opts = job_options(model, s, data, longest, work / "run")
    job = resolve_job(s.method, options=opts, sets=s.sets)
    return ready_to_launch(job), job.plan


def longest_prompt(model_path: Path, data: Path) -> int:
    """Tokens of the longest prompt of ``data`` as the RL recipes render it."""
    from transformers import AutoTokenizer

    from rlctl.data.rl import render_prompt

    tok = AutoTokenizer.from_pretrained(str(model_path))
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    return max(len(render_prompt(r["prompt"], tok, "prompt")) for r in rows)


def run_job(cfg, plan) -> tuple[list[dict], ProcessSampler]:
    """Launch the job (``launch_job``) while sampling its ranks' memory; its step records."""
    from rlctl.launch import launch_job
    from rlctl.runtime.layout import RunPaths

    paths = RunPaths(Path(cfg.output_dir))
    with ProcessSampler(is_rank, gpu=plan.device == "cuda") as sampler:
        rc = launch_job(cfg, plan)
    if rc != 0:
        raise UserError(f"the {cfg.method} job failed (exit status {rc}); see {paths.train_log}")
    records = step_records(paths.metrics)
    if not records:
        raise UserError(f"the job wrote no step metrics; see {paths.train_log}")
    return records, sampler


def around_final_save(run_dir: Path) -> dict:
    """On CUDA, the memory before and after the run's final checkpoint save (summary.json's ``cuda_memory``)."""
    from rlctl.runtime.layout import RunPaths

    path = RunPaths(run_dir).summary
    memory = json.loads(path.read_text()).get("cuda_memory") if path.is_file() else None
    return {"around_final_save": memory} if memory else {}


def bench_train(model: BenchModel, s: TrainSettings, *, output_dir: str | None = None, log=lambda msg: None) -> dict:
    """Run the job and measure it; returns the result row (see the module docstring)."""
    keep = output_dir is not None
    work = Path(output_dir).absolute() if keep else Path(tempfile.mkdtemp(prefix="rlctl-bench-train-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        cfg, plan = prepare_job(model, s, work)
        world = plan.nproc_per_node * plan.nodes
        log(
            f"plan: {plan.device}, {world} process(es), micro batch {plan.micro_batch_size}"
            + (f", rollout {plan.rollout}" if plan.rollout else "")
        )
        log("measuring the device peak" + (" (fp32 matmul)" if plan.device == "cpu" else ""))
        peak = device_peak(plan, world)
        baseline = import_baseline_bytes(s.method, plan.rollout) if plan.device == "cpu" else 0
        records, sampler = run_job(cfg, plan)
        memory = measured_memory(records, sampler, baseline, plan.estimate, plan.device)
        memory.update(around_final_save(Path(cfg.output_dir)))
        result = {
            "method": s.method,
            "model": model.label,
            "params": plan.params,
            "device": plan.device,
            "gpu": plan.gpu,
            "world_size": world,
            "rollout": plan.rollout,
            "micro_batch_size": plan.micro_batch_size,
            "steps": [
                {k: v for k, v in r.items() if k in ("step", "tokens", "tokens_per_s", "time/step", *SPLIT_KEYS)}
                for r in records
            ],
            **summarize(model, cfg, records, peak, memory),
        }
        if keep:
            result["run_dir"] = cfg.output_dir
        return result
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
            # the launcher named the run's checkpoint; say that it went with the temporary directory
            log(f"removed the temporary run directory {work} (its checkpoint too); --output-dir DIR keeps the run")
