"""A model's files, read before launch without loading it: config.json, tokenizer_config.json, the tokenizer's
vocabulary, the image processor, its own code (auto_map), its context length; a hub model in the local cache;
a distillation teacher's vocabulary; a local reward model's head. Each problem is one
:class:`~rlctl.errors.UserError` naming the fix (called by :mod:`rlctl.checks`). No torch import here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
from functools import cache
from pathlib import Path

from rlctl.config import RunConfig
from rlctl.errors import UserError, os_error_text
from rlctl.names import RL_METHODS


@dataclasses.dataclass
class ModelFiles:
    """What a local model directory says about itself, from its JSON files only."""

    root: Path
    config: dict
    tokenizer_config: dict

    @property
    def has_chat_template(self) -> bool:
        tc = self.tokenizer_config.get("chat_template")
        return bool(tc) or (self.root / "chat_template.jinja").is_file() or (self.root / "chat_template.json").is_file()


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {str(e).splitlines()[0]}; pass a valid HF model directory") from None
    return data if isinstance(data, dict) else {}


def model_files(name: str) -> ModelFiles | None:
    """The config of a local model (a directory with config.json, or the config.json itself); None otherwise
    (a catalog name or a hub id: the planner already knows its shape)."""
    p = Path(name).expanduser()
    if p.name == "config.json" and p.is_file():
        p = p.parent
    if not (p / "config.json").is_file():
        return None
    tok = p / "tokenizer_config.json"
    return ModelFiles(p, _read_json(p / "config.json"), _read_json(tok) if tok.is_file() else {})


@cache
def known_model_types() -> frozenset[str]:
    """The model types this transformers builds natively, read from its source (importing it takes seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    found: set[str] = set()
    for name in ("auto_mappings.py", "configuration_auto.py"):  # where the mapping lives moves between versions
        try:
            text = (models / "auto" / name).read_text()
        except OSError:
            continue
        found.update(re.findall(r'"([\w-]+)"\s*[:,]\s*"\w+Config"', text))
    return frozenset(found)


def check_remote_code(cfg: RunConfig, model: ModelFiles) -> None:
    """A model whose config names its own code (auto_map) for a type transformers does not know."""
    if cfg.model.trust_remote_code or "auto_map" not in model.config:
        return
    model_type = str(model.config.get("model_type", ""))
    known = known_model_types()
    if (known and model_type in known) or (not known and model_type):
        return  # transformers builds it natively (or its mapping could not be read: let it decide)
    raise UserError(
        f"{model.root} needs its own Python code (config.json auto_map, model_type {model_type or '?'!r} unknown to "
        f"transformers); pass --trust-remote-code if you trust it (or --set model.trust_remote_code=true)"
    )


def context_length(model: ModelFiles) -> int:
    cfg = model.config.get("text_config") if isinstance(model.config.get("text_config"), dict) else model.config
    value = cfg.get("max_position_embeddings") or cfg.get("n_positions") or 0
    return int(value) if isinstance(value, int | float) else 0


def check_context(cfg: RunConfig, model: ModelFiles) -> None:
    """RL: prompt + response within the model's positions (max_position_embeddings): the rollout engine
    refuses a longer context (vLLM's max_model_len), minutes into the job."""
    ctx = context_length(model)
    if not ctx:
        return
    if cfg.method not in RL_METHODS:  # rows longer than max_len are skipped or cut; the positions stretch (RoPE)
        return
    r = cfg.rollout
    if r.max_prompt_len + r.max_response_len > ctx:
        raise UserError(
            f"rollout.max_prompt_len + rollout.max_response_len = {r.max_prompt_len} + {r.max_response_len} is "
            f"longer than the model's context of {ctx} tokens (max_position_embeddings in "
            f"{model.root / 'config.json'}); lower --max-prompt-len / --max-response-len to sum to {ctx} or less"
        )


def check_teacher(cfg: RunConfig, model: ModelFiles | None, *, on_this_machine: bool) -> None:
    """On-policy distillation: the teacher exists and has the student's vocabulary (compared from the local
    tokenizer files of both; a model only on the hub is compared on the ranks)."""
    name = cfg.algo.teacher
    if not name or cfg.method not in RL_METHODS:
        return
    teacher = model_files(name)
    if teacher is None:
        if on_this_machine:
            check_model_available(name, random_init=False)
        return
    from rlctl.config.algorithm import teacher_vocab_problem

    student_vocab = tokenizer_vocab(model.root) if model is not None else None
    teacher_vocab = tokenizer_vocab(teacher.root)
    if student_vocab is None or teacher_vocab is None:
        return
    problem = teacher_vocab_problem(student_vocab, teacher_vocab, cfg.model.name, name)
    if problem:
        raise UserError(problem)


def tokenizer_vocab(root: Path) -> dict[str, int] | None:
    """token -> id of a local tokenizer (tokenizer.json's model vocab and added tokens, else vocab.json);
    None when neither is there or readable."""
    if (root / "tokenizer.json").is_file():
        tok = _read_json(root / "tokenizer.json")
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, list):  # Unigram: [[piece, score], ...] in id order
            vocab = {piece[0]: i for i, piece in enumerate(vocab)}
        if not isinstance(vocab, dict):
            return None
        added = {t["content"]: t["id"] for t in tok.get("added_tokens") or [] if isinstance(t, dict) and "id" in t}
        return {**vocab, **added}
    if (root / "vocab.json").is_file():
        return _read_json(root / "vocab.json")
    return None


# Files of which one must be beside a model for AutoTokenizer to load it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


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
