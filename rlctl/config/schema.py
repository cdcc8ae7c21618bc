"""The schema of a run: one dataclass per section of :class:`RunConfig`, with defaults and comments.

Every key a user can set (``--set section.key=value``) is a field here; `rlctl presets show METHOD`
prints them with their values. Enumerated fields are typed with the Literals of :mod:`rlctl.names` (their
values and meanings live there); ``bool | None`` and ``Literal | None`` fields are decided by the plan when
None (the word "auto" in YAML, --set or the CLI reads as None).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rlctl.names import (
    AdvName,
    Attn,
    Backend,
    CorrectionLevel,
    CorrectionMode,
    DataFormat,
    Device,
    DistillSignal,
    Dtype,
    KlKind,
    Launcher,
    LossAgg,
    LrScheduler,
    Method,
    PolicyLossName,
    Precision,
    PrefLossName,
    RolloutEngine,
    RolloutMode,
    ToolResults,
    Truncation,
    VerlToolLifecycle,
)


@dataclass
class ModelConfig:
    name: str = ""  # catalog name, HF id, local HF directory or config.json path
    dtype: Dtype | None = None  # None: the plan decides (bf16 on GPU, fp32 on CPU)
    attn: Attn | None = None  # None: flash_attention_2 where flash-attn is installed on a GPU, else sdpa (at run time)
    random_init: bool = False  # build from the config with random weights (nothing is downloaded)
    trust_remote_code: bool = False  # run the model's own Python code (config.json auto_map); never implied
    train_vision: bool = False  # vision-language models: train the vision tower too (frozen by default)


@dataclass
class DataConfig:
    path: str = ""  # JSONL, Parquet, a directory of Parquet shards, a save_to_disk directory or a hub name (cached)
    split: str = "train"  # the split of a DatasetDict directory or a hub dataset
    format: DataFormat | None = None  # None: sft chooses chat or pairs per row; grpo/ppo read rl rows
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    answer_field: str = "answer"  # RL: plain rows {"prompt", "answer"}; verl rows use reward_model.ground_truth
    val_path: str = ""  # a separate validation file (any form `path` takes); otherwise val_fraction is held out
    val_split: str = ""  # the split of val_path for a hub / DatasetDict source ("" = test, else validation)
    val_fraction: float = 0.0
    packing: bool = True
    truncation: Truncation = "skip"
    max_bad_fraction: float = 0.1  # fail when more than this share of rows is bad
    shuffle: bool = True
    system_prompt: str = ""  # a system message put before every conversation / prompt that has none
    chat_template: str = ""  # a Jinja chat template file used instead of the tokenizer's (also exported)
    max_image_pixels: int = 4096 * 4096  # VL models: a row with a larger image is a bad row (0 = no limit)


@dataclass
class HardwareConfig:
    gpus: int = 0  # GPUs in total (0 = every visible GPU, or none on CPU)
    nodes: int = 1
    gpu: str = ""  # GPU type from the catalog, e.g. H100-80GB ("" = detect locally, else H100-80GB)
    device: Device | None = None  # None: the plan decides (cuda with hardware.gpus > 0 or local GPUs, else cpu)
    nproc: int = 0  # processes per node (0 = GPUs per node, or 1 on CPU)
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 = pick a free port
    rdzv_endpoint: str = ""  # host:port for torchrun's c10d rendezvous (multi-node)
    host_memory_gib: float = 0.0  # host memory per node (0 = the GPU type's typical node); bounds offload
    # how long a collective may wait for its peers before the run fails (every process group, NCCL's watchdog
    # included): longer than the slowest step, checkpoint or rollout; NCCL's own default is 10 minutes
    collective_timeout_min: int = 30


@dataclass
class ParallelConfig:
    backend: Backend | None = None  # None: the plan decides (by the model's size and the hardware)
    tp: int = 0  # 0 = chosen by the plan
    pp: int = 0
    cp: int = 1
    ep: int = 0
    sp: int | None = None  # Ulysses sequence parallel size (FSDP); None: the plan decides (1 where nothing needs it)
    # None: the plan decides (a resolved config has True or False); "auto"/"true"/"false" are read as input
    sequence_parallel: bool | None = None
    activation_checkpointing: bool | None = None
    offload_params: bool | None = None
    offload_optimizer: bool | None = None
    selective_checkpointing: bool | None = None  # recompute the MLPs only (FSDP engine)
    offload_activations: bool | None = None  # saved activations in host memory (FSDP engine)
    shard: bool | None = None  # False: one device, a plain module without FSDP wrappers


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
    lr_scheduler: LrScheduler = "cosine"
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    batch_size: int = 32  # sft: sequences per optimizer step; RL: prompts per step
    micro_batch_size: int = 0  # sequences per device per forward (0 = from the plan)
    max_tokens_per_micro_batch: int = 0  # packing budget per device (0 = micro_batch_size x max_len)
    max_len: int = 2048
    precision: Precision = "mixed"
    seed: int = 42
    eval_every: int = 0
    eval_before: bool = False  # also evaluate at step 0, before training (a fresh run only), as a baseline
    compile: bool = False


@dataclass
class CheckpointConfig:
    save_every: int = -1  # -1 = auto (save_every_steps: ~10 checkpoints, at most every 50 steps); 0 = only at the end
    keep_last: int = 2
    resume: str = ""  # "" | auto | PATH
    export_hf: bool = True  # write the final model as HF safetensors into OUTPUT/hf


@dataclass
class RolloutConfig:
    engine: RolloutEngine | None = None  # None: the plan decides (hf on CPU; vllm or sglang on GPUs)
    tp: int = 0  # 0 = chosen by the plan
    mem_fraction: float = 0.0  # 0 = chosen by the plan
    # split runs (procs > 0): the share of a TRAINER GPU its evaluation engine takes, beside the trainer's
    # states (mem_fraction is the rollout GPUs'); 0 = chosen by the plan
    eval_mem_fraction: float = 0.0
    n: int = 8  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_prompt_len: int = 512
    max_response_len: int = 512
    val_temperature: float = 0.0  # the first eval pass: one sample per prompt (0 = greedy)
    val_n: int = 1  # > 1: a second eval pass, val_n samples at `temperature` (mean@k, pass@k)
    ignore_logprob_check: bool = False  # start even when step 0's rollout / trainer log-probs disagree
    # one-step-off-policy (rlctl.recipes.rl.offpolicy, docs/offpolicy.md): > 0 of the processes only
    # generate (the last ones), the others train; 0: every process does both, in turn
    procs: int = 0
    max_staleness: int = 1  # split runs: batch t is generated by the weights after update t - max_staleness
    # split runs: "fixed" (the schedule above, reproducible) or "stream" (docs/async.md: a pool of in-flight
    # groups, admission bounds each group's staleness by max_staleness, in-flight weight updates)
    mode: RolloutMode = "fixed"
    stream_chunk: int = 32  # stream mode: tokens each running trajectory generates between weight checks


@dataclass
class AlgoConfig:
    adv: AdvName = "grpo"
    norm_by_std: bool = True
    # None = the policy loss's own default (ppo: token-mean, 0.2, 0.2, 3.0; gspo: seq-mean-token-mean,
    # 3e-4, 4e-4, off; rlctl.algos.registry); a value set here wins. dual_clip=0 turns it off.
    loss_agg: LossAgg | None = None
    policy_loss: PolicyLossName = "ppo"
    # --policy-loss decoupled (docs/async.md): tokens whose proximal / behaviour weight exceeds it are dropped
    # (AReaL's behav_imp_weight_cap); > 1
    decoupled_cap: float = 5.0
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # prompts per optimizer step (0 = the whole batch)
    kl_coef: float = 0.0
    kl_kind: KlKind = "k3"
    kl_in_reward: bool = False
    kl_target: float = 0.0  # > 0 turns on the adaptive KL controller
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 1.0
    critic_lr: float = 1e-5
    vf_clip: float = 0.5
    critic_warmup: int = 0
    # rollout-mismatch correction (rlctl.algos.correction, docs/algos.md): None = tis when the rollout
    # engine is not the trainer's own forward (vllm, sglang), else none
    rollout_correction: CorrectionMode | None = None
    correction_level: CorrectionLevel = "token"
    correction_threshold: float = 2.0  # U (>= 1): tis truncates above it, mis zeroes outside [lower, U]
    correction_lower: float | None = None  # mis's lower bound L in (0, 1] (None: 1/U)
    overlong_buffer: int = 0  # DAPO soft overlong punishment: the last N tokens before the cap (0: off)
    overlong_factor: float = 1.0  # its size: the penalty reaches -factor at the cap
    overlong_filter: bool = False  # DAPO overlong filtering: truncated responses (no stop token) get no loss
    # DAPO dynamic sampling (verl's filter_groups): drop the groups whose scores are all equal and sample
    # further prompts until the batch has train.batch_size groups, in at most dynamic_max_rounds rounds
    dynamic_sampling: bool = False
    dynamic_max_rounds: int = 10  # rounds of rollout per step, the first included (verl's max_num_gen_batches)
    correction_reject: float | None = None  # R >= 1: drop sequences whose geometric-mean ratio is outside [1/R, R]
    # on-policy distillation (rlctl.algos.distill, docs/distill.md): a frozen teacher (HF directory, catalog name
    # or hub id, with the student's tokenizer) scores the sampled tokens; advantage = teacher_weight * (teacher -
    # student log-prob) + (1 - teacher_weight) * the task reward's advantage
    teacher: str | None = None
    teacher_weight: float = 1.0
    teacher_baseline: bool = False  # subtract the batch's mean gap from each token's (a constant baseline)
    # what the student learns from at each position it sampled: "sampled" the sampled token's log-prob gap as a
    # policy-gradient advantage; "full" the exact reverse KL over the vocabulary, sum_v p_s (log p_s - log p_t),
    # as a loss
    distill: DistillSignal = "sampled"
    # algo.distill=full's divergence, TRL GKD's beta: 1 reverse KL KL(student || teacher), 0 forward KL
    # KL(teacher || student), in between the generalized Jensen-Shannon divergence (rlctl.algos.distill)
    distill_beta: float = 1.0
    # GKD's mixture (TRL's lmbda = 1 - teacher_data_fraction): a file of the teacher's own responses (sft's layouts:
    # prompt/response or messages); teacher_data_warmup steps, then this fraction of the steps, train the
    # full-vocabulary loss on its rows instead of on the student's samples (docs/distill.md)
    teacher_data: str | None = None
    teacher_data_fraction: float = 0.5
    teacher_data_warmup: int = 0


@dataclass
class PrefConfig:
    """`rlctl dpo` and `rlctl rm`: preference pairs (rlctl.data.preference, docs/dpo.md, docs/rm.md)."""

    loss: PrefLossName = "sigmoid"  # dpo: a name registered in rlctl.algos.preference (TRL's loss_type names)
    beta: float | None = None  # None: the loss's own default (0.1; simpo 2.0)
    label_smoothing: float = 0.0  # sigmoid / robust / simpo: the share of pairs assumed mislabelled (cDPO)
    gamma: float = 0.5  # simpo: the target reward margin (TRL's simpo_gamma)
    # True: the reference's log-probs of every pair once, before training (its model then freed);
    # False: a reference forward every step. LoRA: the base with its adapters off is the reference either way
    precompute_ref: bool = True
    desirable_weight: float = 1.0  # kto: lambda_D, the weight of the good rows' loss
    undesirable_weight: float = 1.0  # kto: lambda_U
    center_rewards: float = 0.0  # rm: TRL's center_rewards_coefficient c: + c * mean((r_c + r_r)^2)
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    completion_field: str = "completion"  # kto rows: {prompt, completion, label}
    label_field: str = "label"
    margin_field: str = "margin"  # rm: a row's margin (0 where the row has none)


@dataclass
class RewardConfig:
    # None ("auto" reads as None): each row's data_source picks its built-in; a built-in (rlctl.rewards.builtin),
    # file.py:fn or module:fn
    fn: str | None = None
    format_pattern: str = ""
    fns: list[str] = field(default_factory=list)  # several weighted rewards NAME[:WEIGHT], e.g. [gsm8k, format:0.2]
    timeout: float = 30.0  # seconds per reward call (0: none); a call that runs over counts as failed
    workers: int = -1  # reward processes per rank: -1 auto, 0 serial in the trainer process
    model: str = ""  # a reward model (AutoModelForSequenceClassification dir or repo id)
    model_weight: float = 1.0
    model_dtype: str = "float32"
    model_micro_batch: int = 8


@dataclass
class AgentConfig:
    tools: str = ""  # FILE.py (every public function), FILE.py:a,b, or a verl tool config YAML
    env: str = ""  # FILE.py:Class, one instance per trajectory (TRL's environment_factory convention)
    interaction: str = ""  # a verl Interaction: a simulated user answering each assistant turn
    max_turns: int | None = None  # assistant turns per trajectory (None: 8 with tools / env / interaction)
    tool_timeout_s: float = 30.0  # seconds per tool call; a call that runs over returns an error to the model
    tool_max_chars: int = 4096  # a tool's output is cut to this many characters
    # whose text tool results and errors take: trl (str(result), {'error': ...}), verl (ToolResponse text, "Error
    # executing tool ..."), rlctl (JSON, "Error: Type: ..."); None: Python tools and environments TRL's, verl
    # tools verl's
    tool_results: ToolResults | None = None
    # a verl tool's instance: per call (verl's tool agent loop: create, execute(agent_data=...), release; no
    # calc_reward) or per trajectory (verl's older SGLang rollout: calc_reward at the end, a reward component)
    verl_tool_lifecycle: VerlToolLifecycle = "call"


@dataclass
class LogConfig:
    backends: str = "console"  # a comma list of rlctl.names.LogBackend
    project: str = "rlctl"
    run_name: str = ""
    every: int = 1
    samples_every: int = 10  # write rollout samples to samples.jsonl every N steps (and at the last); 0 = never
    samples: int = 4  # at least this many samples written each time, in whole groups of n (two shown on the console)


@dataclass
class ClusterConfig:
    launcher: Launcher = "torchrun"
    partition: str = ""  # SLURM partition ("" = the cluster's default)
    account: str = ""  # SLURM account
    time: str = ""  # SLURM time limit, e.g. 04:00:00 or 2-00:00:00 ("" = the partition's default)
    sbatch: list[str] = field(default_factory=list)  # extra sbatch options, one #SBATCH line each


@dataclass
class RunConfig:
    method: Method = "sft"
    output_dir: str = ""
    # Python files (my_loss.py) or module names imported before the config is checked, in the CLI and on
    # every rank: they register policy losses / advantage estimators (rlctl.algos.registry, docs/plugins.md)
    plugins: list[str] = field(default_factory=list)
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
    pref: PrefConfig = field(default_factory=PrefConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
