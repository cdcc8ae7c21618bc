"""The ONE table of options of `rlctl sft | grpo | ppo` and `rlctl estimate memory`.

Each row is a flag: its names, the config key it sets, its --help panel, the commands that take it
and its help. Its type is its config key's (an on/off switch ``--x/--no-x`` is a ``bool | None``).
:mod:`rlctl.cli.options` turns the rows into typer commands, and a command's values into the options
layer of the config (preset < --config < options < --set); a flag left out (None) overrides nothing.
Pure data, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlctl import names
from rlctl.algos.preference import pref_loss_names
from rlctl.algos.registry import adv_names, policy_loss_names
from rlctl.names import describe

SFT, GRPO, PPO, DPO, RM, ESTIMATE = "sft", "grpo", "ppo", "dpo", "rm", "estimate"
RL = frozenset({GRPO, PPO})
PAIRS = frozenset({DPO, RM})  # preference pairs (rlctl.data.preference)
TRAIN = frozenset({SFT, GRPO, PPO}) | PAIRS
ALL = TRAIN | {ESTIMATE}
ONLY_SFT, ONLY_ESTIMATE, RL_EST, SFT_EST = frozenset({SFT}), frozenset({ESTIMATE}), RL | {ESTIMATE}, {SFT, ESTIMATE}
JOB, EVAL, HW, CLUSTER, CONF = "Job", "Evaluation", "Hardware", "Cluster", "Configuration"
TRAINING, CKPT, LORA, RL_PANEL, PAR = "Training", "Checkpoints", "LoRA", "RL", "Parallelism"
PREF = "Preference (dpo, rm)"
AGENT = "Agent (multi-turn, tools)"


def _rewards(specs: list[str]) -> dict[str, object]:
    """--reward: one component is reward.fn, several are reward.fns."""
    return {"reward.fn": specs[0]} if len(specs) == 1 else {"reward.fns": specs}


def _system_prompt(text: str) -> dict[str, object]:
    """--system-prompt: the text, or @FILE for a file's text."""
    if text.startswith("@"):
        from pathlib import Path

        from rlctl.errors import UserError

        path = Path(text[1:]).expanduser()
        if not path.is_file():
            raise UserError(f"--system-prompt {text}: no such file (give the text, or @FILE of an existing file)")
        text = path.read_text().strip()
    return {"data.system_prompt": text}


# What `--help` of sft / grpo / ppo / estimate memory shows: the options a first run needs (by flag name);
# `--help-all` shows every option.
FIRST_RUN = frozenset(
    {
        *("model", "data", "gpus", "gpu", "nodes", "device", "nproc", "preset", "config_file", "sets", "output_dir"),
        *("dry_run", "max_steps", "epochs", "lr", "batch_size", "max_len", "lora_rank", "resume", "method"),
        *("n", "max_prompt_len", "max_response_len", "reward", "rollout", "tools", "what_to_rent", "as_json"),
        *("loss", "beta"),  # dpo
    }
)


@dataclass(frozen=True)
class Flag:
    name: str  # the command's parameter
    decls: str | tuple[str, ...]  # the flag's names ("--x/--no-x": an on/off switch)
    key: str  # the config key it sets ("" = the command reads the value itself)
    panel: str | dict[str, str]  # its --help panel (or one per command)
    on: frozenset[str]  # the commands that take it
    help: str | dict[str, str]  # one text, or one per command
    type: object = None  # without a config key: its type
    default: object = None
    convert: Callable | None = None  # value -> {config key: value}, where it is not one key's value
    alias_of: str = ""  # an old, hidden name of another flag: given both, they must agree
    shown: bool = True  # the --help of a training command shows the method's default

    def names(self) -> tuple[str, ...]:
        return (self.decls,) if isinstance(self.decls, str) else self.decls

    @property
    def long(self) -> str:
        return self.names()[0].split("/")[0]

    @property
    def switch(self) -> bool:
        return "/" in self.names()[0]

    def help_for(self, command: str) -> str:
        return self.help if isinstance(self.help, str) else self.help[command]

    def panel_for(self, command: str) -> str:
        return self.panel if isinstance(self.panel, str) else self.panel[command]


def _per(train: str, estimate: str) -> dict[str, str]:
    """One help text for every training command, another for `rlctl estimate memory`."""
    return {**dict.fromkeys(TRAIN, train), ESTIMATE: estimate}


F = Flag
# fmt: off
FLAGS: tuple[Flag, ...] = (
    # --- the job
    F("model", ("--model", "-m"), "model.name", JOB, ALL,
      "Catalog name (Qwen2.5-7B), HF id, local HF directory or config.json."),
    F("method", "--method", "", JOB, ONLY_ESTIMATE,
      f"{describe(names.Method)}.", type=str, default="grpo"),
    F("data", ("--data", "-d"), "data.path", JOB, TRAIN,
      "JSONL, Parquet, a directory of Parquet shards, a `datasets` save_to_disk directory, or a hub dataset"
      " name already in the local cache (e.g. openai/gsm8k)."),
    F("val_data", "--val-data", "data.val_path", EVAL, TRAIN,
      "Validation data (any form --data takes), evaluated every --eval-every steps."),
    F("val_fraction", "--val-fraction", "data.val_fraction", EVAL, TRAIN,
      "Share of --data held out for evaluation (without --val-data)."),
    F("eval_every", "--eval-every", "train.eval_every", EVAL, TRAIN,
      "Evaluate the validation data every N steps (0 = only at the end)."),
    F("eval_before", "--eval-before/--no-eval-before", "train.eval_before", EVAL, TRAIN,
      "Also evaluate before the first step (step 0): a baseline for the curves (needs validation data)."),
    F("eval_n", "--eval-n", "rollout.val_n", EVAL, RL,
      "Samples per validation prompt besides the greedy one: mean@k and pass@k (k = this)."),
    F("system_prompt", "--system-prompt", "data.system_prompt", JOB, TRAIN,
      "A system message put before every conversation / prompt that has none (text, or @FILE).",
      convert=_system_prompt),
    F("chat_template", "--chat-template", "data.chat_template", JOB, TRAIN,
      "A Jinja chat template file used instead of the tokenizer's (also saved with the model)."),
    # --- hardware and cluster
    F("gpus", "--gpus", "hardware.gpus", HW, ALL,
      _per("GPUs in total across nodes (plan for them even when this machine has none).",
           "GPUs in total (default: the local ones, else one full node).")),
    F("nodes", "--nodes", "hardware.nodes", HW, ALL,
      "Number of nodes."),
    F("gpu", "--gpu", "hardware.gpu", HW, ALL,
      "GPU type, e.g. H100-80GB, A100-40GB (default: detected, else H100-80GB)."),
    F("device", "--device", "hardware.device", HW, ALL,
      _per(f"{describe(names.Device)} (default: cuda when there are GPUs, else cpu).",
           f"{describe(names.Device)} (default cuda: estimates are for GPUs).")),
    F("host_memory", "--host-memory", "hardware.host_memory_gib", HW, ALL,
      "Host (CPU) memory of one node in GiB, which bounds offload (default: the GPU type's typical node, "
      "shared by the GPUs used on it)."),
    F("nproc", "--nproc", "hardware.nproc", HW, TRAIN,
      "Processes per node (default: GPUs per node, or 1 on CPU)."),
    F("node_rank", "--node-rank", "hardware.node_rank", HW, TRAIN,
      "This node's rank (multi-node)."),
    F("master_addr", "--master-addr", "hardware.master_addr", HW, TRAIN,
      "Address of node 0 (multi-node)."),
    F("master_port", "--master-port", "hardware.master_port", HW, TRAIN,
      "Port on node 0 (default: a free one)."),
    F("rdzv_endpoint", "--rdzv-endpoint", "hardware.rdzv_endpoint", HW, TRAIN,
      "host:port of a c10d rendezvous (torchrun's elastic launch)."),
    F("launcher", "--launcher", "cluster.launcher", CLUSTER, TRAIN,
      f"{describe(names.Launcher)}."),
    F("partition", "--partition", "cluster.partition", CLUSTER, TRAIN,
      "SLURM partition (--launcher slurm)."),
    F("account", "--account", "cluster.account", CLUSTER, TRAIN,
      "SLURM account (--launcher slurm)."),
    F("time_limit", "--time", "cluster.time", CLUSTER, TRAIN,
      "SLURM time limit, e.g. 04:00:00 (--launcher slurm)."),
    F("sbatch", "--sbatch", "cluster.sbatch", CLUSTER, TRAIN,
      "An extra sbatch option, one #SBATCH line, repeatable (e.g. --sbatch=--qos=high)."),
    # --- the configuration's layers, and what the command does
    F("preset", "--preset", "", CONF, ALL,
      "A named preset applied over the method's defaults (`rlctl presets list`).", type=str | None),
    F("config_file", ("--config", "-c"), "", CONF, ALL,
      "YAML file of config sections (overrides the preset).", type=str | None),
    F("sets", ("--set", "-s"), "", CONF, ALL,
      "key=value with a dotted key, repeatable; wins over everything (e.g. --set train.lr=2e-5).",
      type=list[str] | None),
    F("plugin", "--plugin", "plugins", CONF, RL_EST | {DPO},
      "A Python file (or module) that registers a policy loss, advantage estimator or preference loss, imported "
      "before the config is checked and on every rank; repeatable (docs/plugins.md)."),
    F("output_dir", ("--output-dir", "-o"), "output_dir", CONF, TRAIN,
      "Run directory (default: runs/<method>-<model>-<time>)."),
    F("dry_run", "--dry-run", "", CONF, TRAIN,
      "Print the plan, the resolved config, the memory estimate and the launch command; write nothing.",
      type=bool, default=False),
    F("as_json", "--json", "", CONF, ALL,
      _per("With --dry-run: print one JSON object.", "Print one JSON object."), type=bool, default=False),
    # --- training
    F("max_steps", "--max-steps", "train.max_steps", TRAINING, TRAIN,
      "Stop after this many optimizer steps (0 = run the epochs)."),
    F("epochs", "--epochs", "train.epochs", TRAINING, TRAIN,
      "Passes over the data."),
    F("lr", "--lr", "train.lr", TRAINING, TRAIN,
      "Peak learning rate."),
    F("lr_scheduler", "--lr-scheduler", "train.lr_scheduler", TRAINING, TRAIN,
      f"{describe(names.LrScheduler)}."),
    F("warmup_ratio", "--warmup-ratio", "train.warmup_ratio", TRAINING, TRAIN,
      "Share of the steps with a linear lr warmup."),
    F("weight_decay", "--weight-decay", "train.weight_decay", TRAINING, TRAIN,
      "AdamW weight decay."),
    F("batch_size", "--batch-size", "train.batch_size",
      {SFT: TRAINING, GRPO: RL_PANEL, PPO: RL_PANEL, DPO: TRAINING, RM: TRAINING, ESTIMATE: JOB}, ALL,
      {SFT: "Sequences per optimizer step (global).", GRPO: "Prompts per step (global).",
       PPO: "Prompts per step (global).", DPO: "Pairs (kto: rows) per optimizer step (global).",
       RM: "Pairs per optimizer step (global).",
       ESTIMATE: "Sequences (SFT), prompts (RL) or pairs (dpo, rm) per step."}),
    F("n", "--n", "rollout.n", RL_PANEL, RL_EST,
      "Samples per prompt."),
    F("max_prompt_len", "--max-prompt-len", "rollout.max_prompt_len", RL_PANEL, RL_EST,
      "Longest prompt in tokens (longer ones are skipped)."),
    F("prompt_len", "--prompt-len", "", RL_PANEL, ONLY_ESTIMATE,
      "", type=int | None, alias_of="max_prompt_len"),
    F("max_response_len", "--max-response-len", "rollout.max_response_len", RL_PANEL, RL_EST,
      "Most tokens generated per sample."),
    F("response_len", "--response-len", "", RL_PANEL, ONLY_ESTIMATE,
      "", type=int | None, alias_of="max_response_len"),
    F("temperature", "--temperature", "rollout.temperature", RL_PANEL, RL,
      "Sampling temperature."),
    F("top_p", "--top-p", "rollout.top_p", RL_PANEL, RL,
      "Nucleus sampling (1 = off)."),
    F("top_k", "--top-k", "rollout.top_k", RL_PANEL, RL,
      "Sample from the k likeliest tokens (-1 = off)."),
    F("mini_batch_size", "--mini-batch-size", "algo.mini_batch_size", RL_PANEL, RL,
      "Prompts per optimizer step (0 = the whole batch)."),
    F("micro_batch_size", "--micro-batch-size", "train.micro_batch_size", TRAINING, ALL,
      "Sequences per device per forward."),
    F("micro_batch", "--micro-batch", "", TRAINING, ONLY_ESTIMATE,
      "", type=int | None, alias_of="micro_batch_size"),
    F("max_len", "--max-len", "train.max_len", TRAINING, SFT_EST | PAIRS,
      "Longest sequence in tokens (also the packing budget per sequence slot; dpo/rm: per response, prompt"
      " included)."),
    F("packing", "--packing/--no-packing", "data.packing", TRAINING, ONLY_SFT | PAIRS,
      "Pack several documents per row."),
    F("max_tokens_per_micro_batch", "--max-tokens-per-micro-batch", "train.max_tokens_per_micro_batch", TRAINING, ALL,
      "Packed micro batches by token budget per GPU (verl's dynamic batch size)."),
    F("gradient_checkpointing", "--gradient-checkpointing/--no-gradient-checkpointing",
      "parallel.activation_checkpointing", TRAINING, ALL,
      "Recompute activations in the backward pass (default: the plan decides).", shown=False),
    F("activation_checkpointing", "--activation-checkpointing/--no-activation-checkpointing", "", TRAINING,
      ONLY_ESTIMATE,
      "", alias_of="gradient_checkpointing"),
    # --- RL
    F("ppo_epochs", "--ppo-epochs", "algo.ppo_epochs", RL_PANEL, RL,
      "Passes over each rollout batch."),
    F("kl_coef", "--kl-coef", "algo.kl_coef", RL_PANEL, RL_EST,
      "KL coefficient against the reference model (0 = no reference)."),
    F("kl_kind", "--kl-kind", "algo.kl_kind", RL_PANEL, RL,
      f"{describe(names.KlKind)}."),
    F("entropy_coef", "--entropy-coef", "algo.entropy_coef", RL_PANEL, RL,
      "Entropy bonus in the policy loss (0 = off)."),
    F("critic_lr", "--critic-lr", "algo.critic_lr", RL_PANEL, RL,
      "Learning rate of the critic (ppo)."),
    F("adv", "--adv", "algo.adv", RL_PANEL, RL,
      {GRPO: f"{' | '.join(adv_names(needs_critic=False))}.", PPO: f"{' | '.join(adv_names())}."}),
    F("policy_loss", "--policy-loss", "algo.policy_loss", RL_PANEL, RL,
      f"{' | '.join(policy_loss_names())} (decoupled: AReaL's, for --rollout-mode stream; docs/async.md)."),
    F("loss_agg", "--loss-agg", "algo.loss_agg", RL_PANEL, RL,
      f"{describe(names.LossAgg)}."),
    F("clip_low", "--clip-low", "algo.clip_low", RL_PANEL, RL,
      "PPO clip below 1."),
    F("clip_high", "--clip-high", "algo.clip_high", RL_PANEL, RL,
      "PPO clip above 1 (0.28 = DAPO's clip-higher)."),
    F("dynamic_sampling", "--dynamic-sampling/--no-dynamic-sampling", "algo.dynamic_sampling", RL_PANEL, RL,
      "DAPO: drop the prompts whose samples all score the same and sample further prompts until they fill "
      "the batch (at most algo.dynamic_max_rounds rounds a step; needs --n >= 2)."),
    F("overlong_filter", "--overlong-filter/--no-overlong-filter", "algo.overlong_filter", RL_PANEL, RL,
      "DAPO: truncated responses (no stop token within --max-response-len) get no loss."),
    F("overlong_buffer", "--overlong-buffer", "algo.overlong_buffer", RL_PANEL, RL,
      "DAPO's soft overlong punishment: the reward falls by up to algo.overlong_factor over the last N tokens "
      "before --max-response-len (0 = off)."),
    F("rollout", "--rollout", "rollout.engine", RL_PANEL, RL_EST,
      f"{describe(names.RolloutEngine)} (default: the plan's: hf on CPU, vllm or sglang on GPUs)."),
    F("rollout_tp", "--rollout-tp", "rollout.tp", RL_PANEL, RL_EST,
      "Tensor parallelism of the rollout engine (default: the plan's).", shown=False),
    F("rollout_procs", ("--rollout-procs", "--rollout-gpus"), "rollout.procs", RL_PANEL, RL_EST,
      "One-step-off-policy: this many of the processes (GPUs) only generate while the others train, one "
      "batch behind (docs/offpolicy.md); 0: every process does both in turn."),
    F("max_staleness", "--max-staleness", "rollout.max_staleness", RL_PANEL, RL,
      "With --rollout-procs: the updates a batch's weights may lag (0: synchronous)."),
    F("rollout_mode", "--rollout-mode", "rollout.mode", RL_PANEL, RL,
      f"With --rollout-procs: {describe(names.RolloutMode)} (docs/async.md)."),
    F("mem_fraction", "--mem-fraction", "rollout.mem_fraction", RL_PANEL, RL_EST,
      "vLLM gpu_memory_utilization / SGLang mem_fraction_static (default: the plan's).", shown=False),
    F("reward", "--reward", "reward.fns", RL_PANEL, RL,
      "NAME[:WEIGHT], repeatable (weighted sum): a built-in reward (docs/rewards.md; the shell completion "
      "lists them), file.py:fn, file.py:Class or module:fn. E.g. --reward gsm8k --reward format:0.2.",
      convert=_rewards),
    F("teacher", "--teacher", "algo.teacher", RL_PANEL, frozenset({GRPO, ESTIMATE}),
      "On-policy distillation (docs/distill.md): a frozen teacher with the student's tokenizer scores every "
      "sampled token; the advantage is the teacher-minus-student log-prob gap (reverse KL)."),
    F("teacher_weight", "--teacher-weight", "algo.teacher_weight", RL_PANEL, frozenset({GRPO}),
      "With --teacher: advantage = w * (teacher - student log-prob) + (1 - w) * the task reward's (1 = distill only)."),
    F("teacher_data", "--teacher-data", "algo.teacher_data", RL_PANEL, frozenset({GRPO}),
      "With --teacher and algo.distill=full: the teacher's own responses (sft's layouts); GKD's mixture trains "
      "algo.teacher_data_fraction of the steps (0.5) on them instead of the student's samples."),
    F("reward_model", "--reward-model", "reward.model", RL_PANEL, RL_EST,
      "A sequence-classification reward model (HF directory), added as a reward component."),
    F("samples_every", "--samples-every", "log.samples_every", TRAINING, RL,
      "Write a few (prompt, response, reward, advantage) samples to samples.jsonl every N steps and show "
      "two (0 = never)."),
    F("tools", "--tools", "agent.tools", AGENT, RL,
      "Tools the model may call: FILE.py (every public function), FILE.py:a,b, or a verl tool config YAML."),
    F("env", "--env", "agent.env", AGENT, RL,
      "An environment FILE.py:Class, one per trajectory: reset(**row), its public methods are tools, get_reward() "
      "a reward component."),
    F("interaction", "--interaction", "agent.interaction", AGENT, RL,
      "A verl Interaction (a simulated user) config YAML."),
    F("max_turns", "--max-turns", "agent.max_turns", AGENT, RL,
      "Assistant turns per trajectory (default 8 with tools).", shown=False),
    # --- parallelism and memory: what is left out, the plan decides
    F("backend", "--backend", "parallel.backend", PAR, ALL,
      f"{describe(names.Backend)} (default: the plan's).", shown=False),
    F("tp", "--tp", "parallel.tp", PAR, ALL,
      "Megatron tensor-parallel size (default: the plan's).", shown=False),
    F("pp", "--pp", "parallel.pp", PAR, ALL,
      "Megatron pipeline stages (default: the plan's).", shown=False),
    F("ep", "--ep", "parallel.ep", PAR, ALL,
      "Megatron expert parallelism (MoE) (default: the plan's).", shown=False),
    F("cp", "--cp", "parallel.cp", PAR, ALL,
      "Context parallelism (Megatron; the FSDP engine has --sp).", shown=False),
    F("sp", "--sp", "parallel.sp", PAR, ALL,
      "FSDP: Ulysses sequence parallelism, each sequence split over N ranks (default: the plan's).", shown=False),
    F("precision", "--precision", "train.precision", PAR, ALL,
      f"{describe(names.Precision)}."),
    F("dtype", "--dtype", "model.dtype", PAR, ALL,
      f"{describe(names.Dtype)} (default: the plan's: bf16 on GPU, fp32 on CPU).", shown=False),
    F("offload_params", "--offload-params/--no-offload-params", "parallel.offload_params", PAR, ALL,
      "Move the trainer's weights to CPU between phases (default: the plan's).", shown=False),
    F("offload_optimizer", "--offload-optimizer/--no-offload-optimizer", "parallel.offload_optimizer", PAR, ALL,
      "Move the optimizer states to CPU between phases (default: the plan's).", shown=False),
    F("selective_checkpointing", "--selective-checkpointing/--no-selective-checkpointing",
      "parallel.selective_checkpointing", PAR, ALL,
      "FSDP: recompute the MLPs only (default: the plan's).", shown=False),
    F("offload_activations", "--offload-activations/--no-offload-activations", "parallel.offload_activations", PAR, ALL,
      "FSDP: keep saved activations in pinned host memory (default: the plan's).", shown=False),
    F("shard", "--shard/--no-shard", "parallel.shard", PAR, ALL,
      "FSDP wrappers; --no-shard on one GPU: the plain module, no gather buffers (default: the plan's).", shown=False),
    F("loss_chunk", "--loss-chunk", "", PAR, ONLY_ESTIMATE,
      "Tokens per chunk of the loss (chunked log-softmax; RL: logits at response positions only).", type=int | None),
    # --- preference pairs
    F("loss", "--loss", "pref.loss", PREF, {DPO},
      f"{' | '.join(pref_loss_names())} (TRL's loss_type names; kto reads unpaired rows; docs/dpo.md)."),
    F("beta", "--beta", "pref.beta", PREF, {DPO},
      "The loss's beta (default: the loss's own: 0.1; simpo 2.0)."),
    F("label_smoothing", "--label-smoothing", "pref.label_smoothing", PREF, {DPO},
      "sigmoid / robust / simpo: the share of pairs assumed mislabelled (0 = off)."),
    F("precompute_ref", "--precompute-ref/--no-precompute-ref", "pref.precompute_ref", PREF, {DPO, ESTIMATE},
      "The reference's log-probs once before training (its model then freed), or a reference forward per step."),
    F("center_rewards", "--center-rewards", "pref.center_rewards", PREF, {RM},
      "TRL's center_rewards_coefficient: adds c * mean((r_chosen + r_rejected)^2) (0 = off; TRL suggests 0.01)."),
    # --- checkpoints, LoRA, logging
    F("save_every", "--save-every", "checkpoint.save_every", CKPT, TRAIN,
      "Checkpoint every N steps and at the end; -1 = auto: every max(50, steps / 10); 0 = only at the end."),
    F("keep_last", "--keep-last", "checkpoint.keep_last", CKPT, TRAIN,
      "Keep the last K checkpoints."),
    F("resume", "--resume", "checkpoint.resume", CKPT, TRAIN,
      "auto: the newest intact checkpoint of the run dir (a damaged newer one is passed over and named); or"
      " a checkpoint path (step_N, or a run dir: its latest), which must be intact (else one line names the"
      " damaged file). Every file is checked before launch."),
    F("seed", "--seed", "train.seed", TRAINING, TRAIN,
      "Random seed."),
    F("lora_rank", "--lora-rank", "lora.rank", LORA, ALL,
      "LoRA rank (0 = full fine-tuning)."),
    F("lora_alpha", "--lora-alpha", "lora.alpha", LORA, TRAIN,
      "LoRA alpha."),
    F("lora_targets", "--lora-targets", "lora.targets", LORA, ALL,
      "all-linear or a comma list of module names such as q_proj,v_proj."),
    F("lora_dropout", "--lora-dropout", "lora.dropout", LORA, TRAIN,
      "LoRA dropout."),
    F("train_vision", "--train-vision/--no-train-vision", "model.train_vision", TRAINING, ALL,
      "Vision-language models: train the vision tower too (frozen by default); with LoRA, adapters on its"
      " linear layers as well."),
    F("log", "--log", "log.backends", TRAINING, TRAIN,
      f"Comma list of metric sinks: {describe(names.LogBackend)}."),
    F("run_name", "--run-name", "log.run_name", TRAINING, TRAIN,
      "Name of the run in W&B / TensorBoard (default: the run directory's)."),
    F("trust_remote_code", "--trust-remote-code", "model.trust_remote_code", JOB, ALL,
      "Run the model's own Python code (config.json auto_map); never implied.", shown=False),
    F("ignore_memory_check", "--ignore-memory-check", "", CONF, TRAIN,
      "Launch even when the planner says the job does not fit in GPU memory.", type=bool, default=False),
    F("ignore_logprob_check", "--ignore-logprob-check", "rollout.ignore_logprob_check", CONF, RL,
      "Train even when, before the first update, the rollout engine's log-probs differ from the trainer's far "
      "beyond what the dtype explains (a weight-sync or chat-template bug)."),
    F("what_to_rent", "--what-to-rent", "", CONF, ONLY_ESTIMATE,
      "Also list, for every catalog GPU type, the fewest GPUs that fit without and with offload, and their "
      "plans.", type=bool, default=False),
)
# fmt: on
