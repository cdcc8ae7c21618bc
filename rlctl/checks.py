"""Every check that can be made before torchrun starts, in well under a second (:func:`check_job`; a
dry run's share: :func:`check_dry_run`): the settings (what runs with what is :mod:`rlctl.support`'s), the
machine's GPUs and cores, the plan's memory verdict, the run directory and a checkpoint it resumes, settings
that run but learn nothing; the model's files are :mod:`rlctl.modelfiles`', the data, reward and agent
files :mod:`rlctl.datacheck`'s. Each problem is one :class:`~rlctl.errors.UserError` naming the fix; nothing
is written here (the writability probe is a temporary directory beside the run directory, removed at once).

Called by :func:`rlctl.job.ready_to_launch` (and ``rlctl sft|grpo|ppo --dry-run``). No torch import here.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rlctl.config import RunConfig
from rlctl.config.algorithm import check_algorithm
from rlctl.datacheck import (
    check_agent_files,
    check_agent_template,
    check_data_given,
    check_data_rows,
    check_reward_spec,
)
from rlctl.errors import UserError
from rlctl.modelfiles import (
    ModelFiles,
    check_context,
    check_image_processor,
    check_model_available,
    check_remote_code,
    check_reward_model,
    check_teacher,
    check_tokenizer,
    model_files,
)
from rlctl.support import SPLIT_RULES, JobFacts, refuse

if TYPE_CHECKING:
    from rlctl.plan import Plan

IGNORE_MEMORY_FLAG = "--ignore-memory-check"


def check_job(cfg: RunConfig, plan, *, ignore_memory_check: bool = False, on_this_machine: bool = True) -> None:
    """Every check before launch, cheapest first; the first problem is a one-line UserError.
    ``on_this_machine=False`` (a job submitted to other machines, e.g. by SLURM): no local device check."""
    check_data_given(cfg)
    model = model_files(cfg.model.name)
    warnings = check_settings(cfg, plan, model)
    check_memory(plan, ignore=ignore_memory_check)
    if on_this_machine:
        check_device(plan)
    if cfg.output_dir:
        check_run_dir(cfg, Path(cfg.output_dir), backend=plan.backend)
    if model is None and on_this_machine:
        check_model_available(cfg.model.name, random_init=cfg.model.random_init)
    if on_this_machine:
        check_teacher(cfg, model, on_this_machine=True)  # a teacher named but not here or in the hub cache
    check_data_rows(cfg, model)
    for line in warnings:
        print(line, file=sys.stderr, flush=True)


def check_dry_run(cfg: RunConfig, plan) -> None:
    """What ``--dry-run`` checks: every refusal of :func:`check_settings`, as the launch would; it plans
    without the data's rows or a downloaded model, but the data files it names must exist and read."""
    check_settings(cfg, plan, model_files(cfg.model.name))
    if cfg.data.path:  # the files exist and read (their columns are checked by the real run)
        from rlctl.data.io import first_rows

        check_data_given(cfg)
        for path in (cfg.data.path, cfg.data.val_path):
            if path:
                first_rows(path)


def check_settings(cfg: RunConfig, plan, model: ModelFiles | None) -> list[str]:
    """What a dry run and the launch both refuse (the settings, the files they name, a local model's own
    files); the console warnings of the launch come back."""
    from rlctl.metrics import check_backends_installed

    nproc = int(plan.nproc_per_node or 1)
    check_algorithm(cfg)
    check_split(cfg, nproc=nproc, nodes=int(plan.nodes or 1))
    check_reward_spec(cfg)
    check_agent_files(cfg)
    if cfg.algo.teacher_data:  # --teacher-data exists and reads (its rows are tokenized on the ranks)
        from rlctl.data.io import first_rows

        try:
            first_rows(cfg.algo.teacher_data)
        except UserError as e:
            raise UserError(f"--teacher-data: {e}") from None
    check_backends_installed(cfg.log.backends)
    check_profile_env()
    warnings = check_footguns(cfg, nproc=nproc, device=plan.device)
    if model is not None:
        check_tokenizer(model.root)
        check_image_processor(model.root)
        check_remote_code(cfg, model)
        check_context(cfg, model)
        if cfg.method == "rm":
            from rlctl.rewards.model import classifier_architecture

            classifier_architecture(model.config.get("architectures"), cfg.model.name)
    check_agent_template(cfg, model)
    check_teacher(cfg, model, on_this_machine=False)  # a local teacher's vocabulary; a hub one is not fetched
    return warnings


def check_placement(plan: Plan) -> None:
    """Where the ranks go (checked for a dry run too): a vLLM/SGLang engine's tensor parallel stays inside one node."""
    if plan.nodes > 1 and plan.rollout in ("vllm", "sglang"):
        facts = JobFacts(rollout_tp=plan.rollout_tp, world=plan.nproc_per_node * plan.nodes, nodes=plan.nodes)
        refuse(facts, "rollout_tp_node")


# ---------------------------------------------------------------------------------------------
# Inputs


def check_profile_env() -> None:
    """``RLCTL_PROFILE`` (rlctl.runtime.profile) is START:END or N; a typo fails here, not after the run."""
    from rlctl.runtime.profile import PROFILE_ENV, parse_steps

    value = os.environ.get(PROFILE_ENV, "")
    if value.strip() and parse_steps(value) is None:
        raise UserError(
            f"{PROFILE_ENV}={value!r} is not a step range: use START:END (1-based, e.g. 3:6) or one step N, or unset it"
        )


def check_split(cfg: RunConfig, *, nproc: int, nodes: int) -> None:
    """One-step-off-policy (``rollout.procs``, docs/offpolicy.md): what the split supports (rlctl.support)."""
    refuse(JobFacts.of(cfg, world=nproc * nodes, nodes=nodes), *SPLIT_RULES)


def check_run_dir(cfg: RunConfig, run_dir: Path, *, backend: str = "") -> None:
    """An output that cannot be written or is someone else's directory; a bad or damaged --resume
    checkpoint, or one this job cannot continue (another method, engine, LoRA rank or model); a run
    directory that already holds checkpoints without --resume. Nothing in ``run_dir`` changes."""
    from rlctl.runtime.layout import choose_resume, latest_checkpoint

    resume = cfg.checkpoint.resume
    check_output_dir(run_dir, resume=bool(resume))
    if resume:  # checks every file of the checkpoint it picks (imports torch's DCP classes to read .metadata)
        choice = choose_resume(resume, run_dir)
        if choice.path is not None:
            check_resume_compatible(cfg, choice.path, backend)
        if choice.note():
            print(choice.note(), flush=True)  # --resume auto passed over a damaged checkpoint: say which and why
    if not resume and latest_checkpoint(run_dir / "checkpoints") is not None:
        raise UserError(
            f"{run_dir} already holds checkpoints; pass --resume auto to continue that run "
            f"or choose another --output-dir"
        )


# ---------------------------------------------------------------------------------------------
# Machine and plan


def gpu_visible() -> bool:
    """Whether this machine shows a CUDA GPU, without importing torch (device nodes and CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or bool(glob.glob("/dev/dxg"))


def check_device(plan) -> None:
    if plan.device == "cuda" and not gpu_visible():
        raise UserError("the plan asks for CUDA but no GPU is visible; pass --device cpu (or run on a GPU machine)")


def check_memory(plan, *, ignore: bool) -> None:
    """The planner's "does not fit" verdict stops a real launch (as it is printed by --dry-run), with what
    would fit (the plan's advice)."""
    if plan.fits or ignore:
        return
    from rlctl.plan.types import advice_line

    parts = [f"the plan does not fit in memory: {plan.verdict.why}"]
    if plan.advice:
        parts.append(advice_line(plan.advice).rstrip("."))
    parts.append(f"pass {IGNORE_MEMORY_FLAG} to launch anyway")
    raise UserError(" ".join("; ".join(parts).split()))


# What marks a directory as an rlctl run directory (rlctl.runtime.layout.RunPaths).
RUN_MARKERS = (
    *("config.yaml", "plan.json", "checkpoints", "train.log", "metrics.jsonl", "job.yaml", "summary.json"),
    ".lock",  # rlctl.runtime.run_lock.LOCK_NAME: a run that has just started
)
# What a checkpoint's model must share with the model a run resumes it with (ModelSpec fields).
ARCH_FIELDS = ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size")
FAR_ABOVE_CORES = 2  # --nproc more than this many times the CPU cores: a console warning


# ---------------------------------------------------------------------------------------------
# The run directory


def check_output_dir(run_dir: Path, *, resume: bool) -> None:
    """``run_dir`` can be created and written, and is new, empty or an rlctl run directory."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--output-dir {run_dir} is a file, not a directory; choose another --output-dir")
    if run_dir.is_dir():
        entries = sorted(p.name for p in run_dir.iterdir())
        if entries and not any(name in RUN_MARKERS for name in entries):
            shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
            raise UserError(
                f"--output-dir {run_dir} is not empty and is not an rlctl run directory (it holds {shown}); "
                f"choose a new or empty --output-dir"
            )
    check_writable(run_dir, "--output-dir")


def check_writable(path: Path, what: str) -> None:
    """``path`` (a directory, existing or to be created) can be written: probed with a temporary
    directory in it or in its nearest existing parent, removed at once."""
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{what} {path}: {parent} is a file, not a directory; choose another {what}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rlctl-probe-", dir=parent))
    except OSError as e:
        raise UserError(f"{what} {path} cannot be written ({e.strerror or e}); choose another {what}") from None


# ---------------------------------------------------------------------------------------------
# Resuming: the checkpoint against the job


def check_resume_compatible(cfg: RunConfig, checkpoint: Path, backend: str) -> None:
    """What the checkpoint records (trainer_state.json, huggingface/config.json) against this job:
    the method, the engine, LoRA or not (and its rank), and the model's architecture."""
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return  # layout.checkpoint_problem has named it already
    where = f"--resume: {checkpoint}"
    saved_method = state.get("method")
    if saved_method and saved_method != cfg.method:
        raise UserError(
            f"{where} was saved by `rlctl {saved_method}`, this is `rlctl {cfg.method}`; resume it with "
            f"`rlctl {saved_method}`, or start the {cfg.method} run in another --output-dir"
        )
    saved_backend = state.get("backend")
    if saved_backend and backend in ("fsdp", "megatron") and saved_backend != backend:
        raise UserError(
            f"{where} was saved by the {saved_backend} engine, this job plans {backend}; resume it with "
            f"--set parallel.backend={saved_backend} (or convert it: rlctl convert)"
        )
    saved_rank = int((state.get("lora") or {}).get("r") or 0)
    if saved_rank != int(cfg.lora.rank or 0):
        said = lambda r: f"LoRA rank {r}" if r else "full fine-tuning"  # noqa: E731
        raise UserError(
            f"{where} was saved with {said(saved_rank)}, this job asks for {said(int(cfg.lora.rank or 0))}; "
            f"pass --lora-rank {saved_rank} to resume it, or start over in another --output-dir"
        )
    _check_same_model(cfg.model.name, checkpoint, state.get("model"))


def _arch(name: str) -> dict | None:
    from rlctl.catalog import resolve_model

    try:
        spec = resolve_model(name)
    except (UserError, OSError, ValueError, KeyError):
        return None
    return {f: getattr(spec, f, None) for f in ARCH_FIELDS}


def _check_same_model(model: str, checkpoint: Path, saved_model: str | None) -> None:
    meta = checkpoint / "huggingface"
    saved, now = (_arch(str(meta)) if (meta / "config.json").is_file() else None), _arch(model)
    if saved is None or now is None:
        return
    diff = [f"{f} {saved[f]} vs {now[f]}" for f in ARCH_FIELDS if saved[f] != now[f]]
    if diff:
        was = f" ({saved_model})" if saved_model else ""
        raise UserError(
            f"--resume: {checkpoint} holds another model{was} than --model {model}: {', '.join(diff[:3])} "
            f"(checkpoint vs --model); pass the model it was trained from, or start over in another --output-dir"
        )


# ---------------------------------------------------------------------------------------------
# Settings that run but learn nothing


def check_footguns(cfg: RunConfig, *, nproc: int, device: str) -> list[str]:
    """Refuse what cannot learn; return the console warnings of what probably is a mistake."""
    refuse(JobFacts.of(cfg), "greedy_groups")
    if cfg.method in ("grpo", "ppo") and cfg.reward.model:
        check_reward_model(Path(str(cfg.reward.model)).expanduser())
    warnings = []
    cores = os.cpu_count() or 1
    if device == "cpu" and nproc > FAR_ABOVE_CORES * cores:
        warnings.append(
            f"warning: --nproc {nproc} on {cores} CPU cores: the processes share the cores and every step is "
            f"slower than with --nproc {cores} or fewer"
        )
    return warnings
