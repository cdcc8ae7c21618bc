"""The allowed values of every enumerated setting, in one place, without torch.

Each setting with a fixed set of values is a ``Literal`` here. The config schema types its fields with
them (:mod:`rlctl.config.schema`); ``rlctl.config.CHOICES``, the CLI's help strings and the shell
completions are derived from them, so a value is added in exactly one line. :data:`MEANINGS` says what
a value means where a word helps (shown in ``--help``).

Advantage estimators and policy losses are open sets: their names are the ones registered in
:mod:`rlctl.algos.registry` (the built-ins, and any a plugin module registers: docs/plugins.md).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

Method = Literal["sft", "grpo", "ppo", "dpo", "rm"]
RL_METHODS = ("grpo", "ppo")  # the methods that generate (a rollout engine, rewards); the rest train on fixed data
PAIR_METHODS = ("dpo", "rm")  # the methods that train on preference pairs (rlctl.data.preference)
Dtype = Literal["bf16", "fp16", "fp32"]  # model.dtype None: the plan decides (bf16 on GPU, fp32 on CPU)
Attn = Literal["sdpa", "eager", "flash_attention_2"]  # model.attn None: the engine picks at run time
DataFormat = Literal["chat", "pairs", "rl"]  # data.format None: chosen per row (sft), rl (grpo/ppo)
Truncation = Literal["skip", "right", "left"]
LrScheduler = Literal["cosine", "constant"]
Precision = Literal["mixed", "bf16"]
Device = Literal["cuda", "cpu"]  # hardware.device None: the plan decides (cuda when there are GPUs)
Launcher = Literal["torchrun", "slurm"]
Backend = Literal["fsdp", "megatron"]  # parallel.backend None: the plan decides (by the model's size)
RolloutEngine = Literal["hf", "vllm", "sglang"]  # rollout.engine None: the plan decides
RolloutMode = Literal["fixed", "stream"]  # rollout.mode of a split run (docs/async.md)
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LogBackend = Literal["console", "tensorboard", "wandb"]  # log.backends is a comma list of these
KlKind = Literal["k1", "abs", "k2", "k3", "kl", "mse", "low_var_kl"]
CorrectionMode = Literal["none", "tis", "mis"]  # algo.rollout_correction (docs/algos.md)
CorrectionLevel = Literal["token", "sequence"]
VerlToolLifecycle = Literal["call", "trajectory"]  # agent.verl_tool_lifecycle (rlctl.agents.sources.VerlTools)
DistillSignal = Literal["sampled", "full"]  # algo.distill: the sampled token's gap, or the vocabulary's reverse KL
ToolResults = Literal["trl", "verl", "rlctl"]  # agent.tool_results None: each tool source its peer's (docs/agents.md)
# Open sets, not Literals: the names registered in rlctl.algos.registry (the built-ins and any plugin's)
AdvName = str
PolicyLossName = str
PrefLossName = str  # rlctl.algos.preference: sigmoid, ipo, hinge, robust, simpo, orpo, kto and plugins'

# value -> what it means, per Literal (only where a word helps)
MEANINGS: dict[Any, dict[str, str]] = {
    Truncation: {"skip": "drop rows longer than max_len, counted as bad"},
    LrScheduler: {
        "cosine": "warmup, then down to train.min_lr_ratio of the peak",
        "constant": "after the warmup; min_lr_ratio = 1",
    },
    Precision: {
        "mixed": "fp32 master weights, grads, AdamW: 16 bytes/param",
        "bf16": "pure bf16: 8 bytes/param",
    },
    Launcher: {"torchrun": "this node", "slurm": "write an sbatch script and submit it"},
    KlKind: {"kl": "= k1", "mse": "= k2", "low_var_kl": "= k3"},
    RolloutMode: {
        "fixed": "batch t from the weights after update t - S: reproducible",
        "stream": "groups stream to the trainer as they finish, weights enter running trajectories",
    },
    CorrectionMode: {
        "tis": "truncated importance weights min(w, U)",
        "mis": "masked importance weights: 0 outside [L, U] (IcePop)",
    },
}


def choices(tp: Any, *, without: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The values of the Literal ``tp`` (e.g. ``choices(LogBackend, without=("console",))``)."""
    return tuple(v for v in get_args(tp) if v not in without)


def describe(tp: Any, *, without: tuple[str, ...] = ()) -> str:
    """``'mixed (fp32 master weights, grads, AdamW: 16 bytes/param) | bf16 (...)'``: the values and their meanings."""
    meaning = MEANINGS.get(tp, {})
    return " | ".join(f"{v} ({meaning[v]})" if v in meaning else v for v in choices(tp, without=without))


ROLLOUT_ENGINES = choices(RolloutEngine)
BACKENDS = choices(Backend)
