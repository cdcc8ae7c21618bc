"""The typed run configuration, and how it is assembled.

One :class:`RunConfig` describes a whole job (sft, grpo or ppo). It is built from four layers,
each overriding the one before::

    preset (presets/<method>.yaml or --preset NAME)  <  --config FILE.yaml  <  CLI options  <  --set key=value

Every layer is a nested dict with dotted paths such as ``train.lr`` or ``rollout.n``. An unknown key
anywhere fails with a did-you-mean suggestion; a value of the wrong type fails naming the key and
the expected type. Fields left at ``"auto"`` (or 0 for sizes) are filled in by the plan.

This module imports no torch, so the CLI can use it while staying fast.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlctl.errors import UserError, did_you_mean

METHODS = ("sft", "grpo", "ppo")


@dataclass
class ModelConfig:
    name: str = ""  # catalog name, HF id, local HF directory or config.json path
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32
    attn: str = "auto"  # auto (flash_attention_2 when installed on GPU, else sdpa) | sdpa | eager | flash_attention_2
    random_init: bool = False  # build from the config with random weights (nothing is downloaded)
    trust_remote_code: bool = False  # run the model's own Python code (config.json auto_map); never implied


@dataclass
class DataConfig:
    path: str = ""  # JSONL, Parquet, a directory of Parquet shards, a save_to_disk directory or a hub name (cached)
    split: str = "train"  # the split of a DatasetDict directory or a hub dataset
    format: str = "auto"  # auto | chat | pairs | rl
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    answer_field: str = "answer"  # RL: plain rows {"prompt", "answer"}; verl rows use reward_model.ground_truth
    val_path: str = ""  # a separate validation file (any form `path` takes); otherwise val_fraction is held out
    val_split: str = ""  # the split of val_path for a hub / DatasetDict source ("" = test, else validation)
    val_fraction: float = 0.0
    packing: bool = True
    truncation: str = "skip"  # skip (drop rows longer than max_len, counted as bad) | right | left
    max_bad_fraction: float = 0.1  # fail when more than this share of rows is bad
    shuffle: bool = True
    system_prompt: str = ""  # a system message put before every conversation / prompt that has none
    chat_template: str = ""  # a Jinja chat template file used instead of the tokenizer's (also exported)


@dataclass
class HardwareConfig:
    gpus: int = 0  # GPUs in total (0 = every visible GPU, or none on CPU)
    nodes: int = 1
    gpu: str = ""  # GPU type from the catalog, e.g. H100-80GB ("" = detect locally, else H100-80GB)
    device: str = "auto"  # auto | cuda | cpu
    nproc: int = 0  # processes per node (0 = GPUs per node, or 1 on CPU)
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 = pick a free port
    rdzv_endpoint: str = ""  # host:port for torchrun's c10d rendezvous (multi-node)
    host_memory_gib: float = 0.0  # host memory per node (0 = the GPU type's typical node); bounds offload


@dataclass
class ParallelConfig:
    backend: str = "auto"  # auto | fsdp | megatron
    tp: int = 0  # 0 = chosen by the plan
    pp: int = 0
    cp: int = 1
    ep: int = 0
    sequence_parallel: str = "auto"  # auto | true | false
    activation_checkpointing: str = "auto"  # auto | true | false
    offload_params: str = "auto"  # auto | true | false
    offload_optimizer: str = "auto"
    selective_checkpointing: str = "auto"  # auto | true | false: recompute the MLPs only (FSDP engine)
    offload_activations: str = "auto"  # auto | true | false: saved activations in host memory (FSDP engine)
    shard: str = "auto"  # auto | true | false: false = one device, a plain module without FSDP wrappers


@dataclass
class LoraConfig:
    rank: int = 0  # 0 = full fine-tuning
    alpha: float = 0.0  # 0 = 2 x rank
    dropout: float = 0.0
    targets: str = "all-linear"  # all-linear or a comma list such as q_proj,v_proj


@dataclass
class TrainConfig:
    max_steps: int = 0  # 0 = run `epochs` passes over the data
    epochs: int = 1
    lr: float = 1e-5
    lr_scheduler: str = "cosine"  # cosine (warmup, then down to min_lr_ratio) | constant (min_lr_ratio = 1)
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    batch_size: int = 32  # sft: sequences per optimizer step; RL: prompts per step
    micro_batch_size: int = 0  # sequences per device per forward (0 = from the plan)
    max_tokens_per_micro_batch: int = 0  # packing budget per device (0 = micro_batch_size x max_len)
    max_len: int = 2048
    precision: str = "mixed"  # mixed (fp32 master weights, grads, AdamW) | bf16 (pure bf16: half the state bytes)
    seed: int = 42
    eval_every: int = 0
    compile: bool = False


@dataclass
class CheckpointConfig:
    save_every: int = -1  # -1 = auto (save_every_steps: ~10 checkpoints, at most every 50 steps); 0 = only at the end
    keep_last: int = 2
    resume: str = ""  # "" | auto | PATH
    export_hf: bool = True  # write the final model as HF safetensors into OUTPUT/hf


@dataclass
class RolloutConfig:
    engine: str = "auto"  # auto | hf | vllm | sglang
    tp: int = 0  # 0 = chosen by the plan
    mem_fraction: float = 0.0  # 0 = chosen by the plan
    n: int = 8  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_prompt_len: int = 512
    max_response_len: int = 512
    val_temperature: float = 0.0  # the first eval pass: one sample per prompt (0 = greedy)
    val_n: int = 1  # > 1: a second eval pass, val_n samples at `temperature` (mean@k, pass@k)


@dataclass
class AlgoConfig:
    adv: str = "grpo"  # grpo | rloo | reinforce_pp | gae
    norm_by_std: bool = True
    # None = the policy loss's own default (ppo: token-mean, 0.2, 0.2, 3.0; gspo: seq-mean-token-mean,
    # 3e-4, 4e-4, off; rlctl.algos.registry); a value set here wins. dual_clip=0 turns it off.
    loss_agg: str | None = None
    policy_loss: str = "ppo"  # ppo | gspo
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # prompts per optimizer step (0 = the whole batch)
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    kl_in_reward: bool = False
    kl_target: float = 0.0  # > 0 turns on the adaptive KL controller
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 1.0
    critic_lr: float = 1e-5
    vf_clip: float = 0.5
    critic_warmup: int = 0


@dataclass
class RewardConfig:
    fn: str = "auto"  # auto (from data_source) | gsm8k | math | exact | format | length | file.py:fn | module:fn
    format_pattern: str = ""
    fns: list[str] = field(default_factory=list)  # several weighted rewards NAME[:WEIGHT], e.g. [gsm8k, format:0.2]
    timeout: float = 30.0  # seconds per reward call (0: none); a call that runs over counts as failed
    workers: int = -1  # reward processes per rank: -1 auto, 0 serial in the trainer process
    model: str = ""  # a reward model (AutoModelForSequenceClassification dir or repo id)
    model_weight: float = 1.0
    model_dtype: str = "float32"
    model_micro_batch: int = 8


@dataclass
class LogConfig:
    backends: str = "console"  # comma list: console, tensorboard, wandb
    project: str = "rlctl"
    run_name: str = ""
    every: int = 1
    samples_every: int = 10  # write rollout samples to samples.jsonl every N steps (and at the last); 0 = never
    samples: int = 4  # samples written each time (two are shown on the console)


@dataclass
class ClusterConfig:
    launcher: str = "torchrun"  # torchrun (this node) | slurm (write an sbatch script and submit it)
    partition: str = ""  # SLURM partition ("" = the cluster's default)
    account: str = ""  # SLURM account
    time: str = ""  # SLURM time limit, e.g. 04:00:00 or 2-00:00:00 ("" = the partition's default)
    sbatch: list[str] = field(default_factory=list)  # extra sbatch options, one #SBATCH line each


@dataclass
class RunConfig:
    method: str = "sft"
    output_dir: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Building a typed config from layered dicts


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently convert) one value against a dataclass field type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, arg, key)
            except UserError as e:
                errors.append(str(e))
        raise UserError(errors[0] if errors else f"{key}: cannot be {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key} must be a list, got {value!r}")
        return [_coerce(v, item_tp, key) for v in value]
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise UserError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise UserError(f"{key} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise UserError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise UserError(f"{key} must be a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise UserError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, bool):  # YAML reads `true` for a tri-state "auto|true|false" field
            return "true" if value else "false"
        raise UserError(f"{key} must be a string, got {value!r}")
    raise UserError(f"{key}: unsupported type {_type_name(tp)}")


def _apply(obj: Any, updates: dict, prefix: str = "", *, method: str = "sft") -> None:
    """Apply a nested dict of updates onto a dataclass instance, validating every key."""
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in updates.items():
        path = f"{prefix}{key}"
        if key not in names:
            all_keys = [f"{prefix}{n}" for n in names]
            raise UserError(
                f"unknown config key '{path}'{did_you_mean(path, all_keys + all_config_keys())}; "
                f"`rlctl presets show {method}` lists the keys"
            )
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UserError(
                    f"'{path}' is a section; set one of its keys, e.g. {path}.{dataclasses.fields(current)[0].name}=..."
                )
            _apply(current, value, prefix=f"{path}.", method=method)
        else:
            setattr(obj, key, _coerce(value, hints[key], path))


def all_config_keys() -> list[str]:
    """Every dotted key of the configuration, e.g. ``train.lr``."""
    keys = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            else:
                keys.append(f"{prefix}{f.name}")

    walk(RunConfig, "")
    return keys


def dotted_to_nested(items: dict[str, Any]) -> dict:
    """{"train.lr": 1e-5} -> {"train": {"lr": 1e-5}}."""
    nested: dict = {}
    for key, value in items.items():
        parts = key.split(".")
        node = nested
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise UserError(f"'{key}' conflicts with another setting of '{p}'")
        node[parts[-1]] = value
    return nested


def parse_set_options(items: list[str]) -> dict:
    """Parse repeated ``--set key=value`` options; values are read as YAML scalars."""
    import yaml

    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise UserError(f"--set expects key=value, got '{item}' (e.g. --set train.lr=2e-5)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise UserError(f"--set expects key=value, got '{item}'")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        out[key] = value
    return dotted_to_nested(out)


def load_yaml_file(path: str | Path) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {p} (pass an existing YAML file to --config)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0]
        raise UserError(f"{p} is not valid YAML: {first}") from None
    if not isinstance(data, dict):
        raise UserError(f"{p} must hold a mapping of config sections (e.g. train: {{lr: 1e-5}})")
    if "${" in p.read_text():  # omegaconf interpolation: ${train.lr}, ${oc.env:VAR,default}
        from omegaconf import OmegaConf

        try:
            data = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
        except Exception as e:  # noqa: BLE001 (omegaconf raises several types)
            raise UserError(f"{p}: cannot resolve an interpolation: {str(e).splitlines()[0]}") from None
    return data


def build_config(method: str, layers: list[dict]) -> RunConfig:
    """Apply layers (lowest precedence first) onto the defaults for ``method``."""
    if method not in METHODS:
        raise UserError(f"unknown method '{method}'{did_you_mean(method, METHODS)}; use one of {', '.join(METHODS)}")
    cfg = RunConfig(method=method)
    for layer in layers:
        if layer:
            layer = dict(layer)
            layer.pop("method", None)
            _apply(cfg, layer, method=method)
    validate(cfg)
    if cfg.train.lr_scheduler == "constant":
        cfg.train.min_lr_ratio = 1.0
    return cfg


def val_split(cfg: RunConfig) -> str:
    """The split read from ``data.val_path`` when it is a hub dataset or a DatasetDict directory."""
    return cfg.data.val_split or "test"


SAVE_EVERY_MIN = 50  # auto: never a checkpoint more often than this many steps
SAVE_EVERY_COUNT = 10  # auto: about this many checkpoints over a run


def save_every_steps(save_every: int, total_steps: int) -> int:
    """The checkpoint interval in steps (0 = only the final checkpoint). ``checkpoint.save_every = -1``
    (auto, the default) checkpoints about 10 times over a long run and never more often than every 50
    steps: every ``max(50, ceil(total_steps / 10))`` steps (a 20-step run: only at the end; 1,000
    steps: every 100)."""
    if save_every >= 0:
        return save_every
    return max(SAVE_EVERY_MIN, -(-total_steps // SAVE_EVERY_COUNT))


CHOICES = {
    "model.dtype": ("auto", "bf16", "fp16", "fp32"),
    "model.attn": ("auto", "sdpa", "eager", "flash_attention_2"),
    "data.format": ("auto", "chat", "pairs", "rl"),
    "data.truncation": ("skip", "right", "left"),
    "train.lr_scheduler": ("cosine", "constant"),
    "hardware.device": ("auto", "cuda", "cpu"),
    "cluster.launcher": ("torchrun", "slurm"),
    "parallel.backend": ("auto", "fsdp", "megatron"),
    "parallel.sequence_parallel": ("auto", "true", "false"),
    "parallel.activation_checkpointing": ("auto", "true", "false"),
    "parallel.offload_params": ("auto", "true", "false"),
    "parallel.offload_optimizer": ("auto", "true", "false"),
    "parallel.selective_checkpointing": ("auto", "true", "false"),
    "parallel.offload_activations": ("auto", "true", "false"),
    "parallel.shard": ("auto", "true", "false"),
    "train.precision": ("mixed", "bf16"),
    "rollout.engine": ("auto", "hf", "vllm", "sglang"),
    "algo.adv": ("grpo", "rloo", "reinforce_pp", "gae"),
    "algo.loss_agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "algo.policy_loss": ("ppo", "gspo"),
    "algo.kl_kind": ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"),
}


def get_key(cfg: RunConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: RunConfig) -> None:
    """Checks that do not need the catalog: choices and value ranges."""
    for key, choices in CHOICES.items():
        value = get_key(cfg, key)
        if value is not None and value not in choices:
            raise UserError(
                f"{key}={value!r} is not valid{did_you_mean(str(value), choices)}; choose one of {', '.join(choices)}"
            )
    positive = "train.batch_size train.max_len train.epochs rollout.n hardware.nodes rollout.max_prompt_len"
    positive += " rollout.max_response_len algo.ppo_epochs rollout.val_n checkpoint.keep_last"
    for key in positive.split():
        if get_key(cfg, key) < 1:
            raise UserError(f"{key} must be at least 1, got {get_key(cfg, key)}")
    non_negative = "train.max_steps train.micro_batch_size hardware.gpus hardware.nproc parallel.tp parallel.pp"
    non_negative += " rollout.tp lora.rank train.eval_every log.samples_every log.samples lora.dropout algo.kl_coef"
    non_negative += " train.weight_decay algo.entropy_coef algo.critic_lr train.lr algo.mini_batch_size"
    for key in non_negative.split():
        if get_key(cfg, key) < 0:
            raise UserError(f"{key} must not be negative, got {get_key(cfg, key)}")
    ranges = {"rollout.mem_fraction": "[0, 1)", "data.val_fraction": "[0, 1)", "train.warmup_ratio": "[0, 1)"}
    ranges["rollout.top_p"] = "(0, 1]"
    for key, text in ranges.items():
        v = get_key(cfg, key)
        if not ((0.0 <= v < 1.0) if text == "[0, 1)" else (0.0 < v <= 1.0)):
            raise UserError(f"{key} must be in {text}, got {v}")
    if cfg.algo.dual_clip and cfg.algo.dual_clip <= 1.0:
        raise UserError(f"algo.dual_clip must be > 1 (or 0 to turn it off), got {cfg.algo.dual_clip}")
    if cfg.checkpoint.save_every < -1:
        raise UserError(
            f"checkpoint.save_every must be -1 (auto), 0 (at the end only) or N, got {cfg.checkpoint.save_every}"
        )
    if cfg.rollout.top_k == 0 or cfg.rollout.top_k < -1:
        raise UserError(f"rollout.top_k must be -1 (off) or at least 1, got {cfg.rollout.top_k}")


def tri_state(value: str) -> bool | None:
    """'auto' -> None, 'true' -> True, 'false' -> False."""
    return None if value == "auto" else value == "true"


def save_config(cfg: RunConfig, path: str | Path) -> None:
    import yaml

    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def load_config(path: str | Path) -> RunConfig:
    """Read a resolved config.yaml that rlctl wrote (e.g. into a run directory)."""
    data = load_yaml_file(path)
    return build_config(data.get("method", "sft"), [data])
