"""Pre-launch checks of what a job will touch: the run directory, a checkpoint it resumes, the model's
files, and settings that run but silently learn nothing (docs/reliability.md).

Called by :func:`rlctl.checks.check_job` (and, for what a dry run can see, :func:`rlctl.checks.check_dry_run`).
Each refusal is one :class:`~rlctl.errors.UserError`; each warning one line returned to the caller, which
prints it. Nothing here writes to a run directory (the writability probe is a temporary directory
beside it, removed at once). No torch import.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

from rlctl.config import RunConfig
from rlctl.errors import UserError, os_error_text

# What marks a directory as an rlctl run directory (rlctl.runtime.layout.RunPaths).
RUN_MARKERS = (
    *("config.yaml", "plan.json", "checkpoints", "train.log", "metrics.jsonl", "job.yaml", "summary.json"),
    ".lock",  # rlctl.runtime.run_lock.LOCK_NAME: a run that has just started
)
# Files of which one must be beside a model for AutoTokenizer to load it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
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
# The model's files


def check_tokenizer(root: Path, what: str = "--model") -> None:
    """A local model directory has tokenizer files beside its config.json."""
    if any((root / name).is_file() for name in TOKENIZER_FILES):
        return
    raise UserError(
        f"{what} {root} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}); copy the tokenizer files "
        f"of the model it came from into it (tokenizer.save_pretrained)"
    )


def check_image_processor(root: Path, what: str = "--model") -> None:
    """A local vision-language model directory (config.json has a vision_config) has its image processor."""
    import json

    from rlctl.data.vision import is_vision_config

    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return  # the model's own checks name an unreadable config
    if is_vision_config(config) and not (root / "preprocessor_config.json").is_file():
        raise UserError(
            f"{what} {root} is a vision-language model without preprocessor_config.json (its image processor); "
            f"copy it from the model it came from (image_processor.save_pretrained)"
        )


def check_model_available(name: str, *, random_init: bool) -> None:
    """A catalog name or hub id (not a local directory) is in the local Hugging Face cache, or the hub
    can be reached to download it (else the ranks fail after their start-up, a minute later)."""
    if random_init or Path(name).expanduser().exists():
        return
    repo = name if "/" in name else _catalog_id(name)
    if repo is None or _cached(repo):
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if offline:
        raise UserError(
            f"--model {name} ({repo}) is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
            f"download it first (huggingface-cli download {repo}) or pass a local model directory"
        )
    host = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host.split(":")[0], 443), timeout=3).close()
    except OSError as e:
        raise UserError(
            f"--model {name} ({repo}) is not in the local Hugging Face cache and {host} cannot be reached "
            f"({os_error_text(e)}); download it where there is a connection, or pass a local model directory"
        ) from None


def _catalog_id(name: str) -> str | None:
    from rlctl.catalog import resolve_model

    try:
        return resolve_model(name).hf_id
    except UserError:
        return None


def _cached(repo: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return True  # let transformers decide
    try:
        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except Exception:  # noqa: BLE001 (an id the hub library refuses: the ranks say why)
        return True


# ---------------------------------------------------------------------------------------------
# Settings that run but learn nothing


def check_footguns(cfg: RunConfig, *, nproc: int, device: str) -> list[str]:
    """Refuse what cannot learn; return the console warnings of what probably is a mistake."""
    if cfg.method == "grpo" and float(cfg.rollout.temperature) == 0.0 and int(cfg.rollout.n) > 1:
        raise UserError(
            "--temperature 0 with grpo: the n responses to a prompt are all the same greedy one, so every "
            "advantage is 0 and nothing is learned; sample with --temperature 1.0 (0.6 or more)"
        )
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


def check_reward_model(root: Path) -> None:
    """A local reward model is a sequence classifier (a causal LM would get a random score head)."""
    config = root / "config.json"
    if not config.is_file():
        return
    try:
        archs = [str(a) for a in json.loads(config.read_text()).get("architectures") or []]
    except (OSError, ValueError, AttributeError):
        return
    if archs and all(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise UserError(
            f"--reward-model {root} is a causal LM ({archs[0]}), not a reward model: its score head would be "
            f"random; pass a sequence classifier (…ForSequenceClassification), or score with --reward FILE.py:fn"
        )
    check_tokenizer(root, "--reward-model")
