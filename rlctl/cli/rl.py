"""`rlctl grpo` and `rlctl ppo`: the RL loop (rollout, rewards, advantages, PPO updates, weight sync).

Both commands take the same options; they differ in their presets (grpo: group advantages, no critic;
ppo: a critic and GAE).
"""

from __future__ import annotations

from typing import Annotated

import typer

from rlctl import names
from rlctl.algos.registry import adv_names
from rlctl.cli import options as o
from rlctl.names import describe

RL = "RL"

GRPO_EXAMPLES = """
Examples:

  rlctl grpo --model Qwen2.5-7B --data gsm8k.parquet --gpus 8 --dry-run

  rlctl grpo --model Qwen2.5-7B --data gsm8k.parquet --gpus 8 --reward gsm8k --n 8

  rlctl grpo --model Qwen2.5-3B --data train.parquet --gpus 1 --lora-rank 32 --rollout vllm

  rlctl grpo --model ./tiny --data arith.jsonl --device cpu --nproc 2 --reward my_reward.py:score
"""

PPO_EXAMPLES = """
Examples:

  rlctl ppo --model Qwen2.5-7B --data gsm8k.parquet --gpus 8 --dry-run

  rlctl ppo --model Qwen2.5-1.5B --data train.parquet --gpus 4 --kl-coef 0.001 --adv gae
"""


ADV_OPTION = {  # the registered estimators each method can run (rlctl.algos.registry; a plugin may add more)
    method: Annotated[
        str | None, typer.Option("--adv", help=f"{' | '.join(adv_names(needs_critic=critic))}.", rich_help_panel=RL)
    ]
    for method, critic in (("grpo", False), ("ppo", True))
}


Plugin = Annotated[
    list[str] | None,
    typer.Option(
        "--plugin",
        help="A Python file (or module) that registers a policy loss or advantage estimator, imported before "
        "the config is checked and on every rank; repeatable (docs/plugins.md).",
        rich_help_panel="Configuration",
    ),
]

KEYS = {
    **o.COMMON_KEYS,
    "n": "rollout.n",
    "max_prompt_len": "rollout.max_prompt_len",
    "max_response_len": "rollout.max_response_len",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "eval_n": "rollout.val_n",
    "mini_batch_size": "algo.mini_batch_size",
    "ppo_epochs": "algo.ppo_epochs",
    "kl_coef": "algo.kl_coef",
    "kl_kind": "algo.kl_kind",
    "entropy_coef": "algo.entropy_coef",
    "critic_lr": "algo.critic_lr",
    "adv": "algo.adv",
    "loss_agg": "algo.loss_agg",
    "clip_low": "algo.clip_low",
    "clip_high": "algo.clip_high",
    "rollout": "rollout.engine",
    "reward_model": "reward.model",
    "samples_every": "log.samples_every",
    "plugin": "plugins",
    "tools": "agent.tools",
    "env": "agent.env",
    "interaction": "agent.interaction",
    "max_turns": "agent.max_turns",
}

AGENT = "Agent (multi-turn, tools)"


def _rl_command(method: str):
    def command(
        model: o.Model = None,
        data: o.Data = None,
        val_data: o.ValData = None,
        val_fraction: o.ValFraction = None,
        eval_every: o.EvalEvery = None,
        eval_before: o.EvalBefore = None,
        eval_n: Annotated[
            int | None,
            typer.Option(
                "--eval-n",
                help="Samples per validation prompt besides the greedy one: mean@k and pass@k (k = this).",
                rich_help_panel="Evaluation",
            ),
        ] = None,
        system_prompt: o.SystemPrompt = None,
        chat_template: o.ChatTemplate = None,
        gpus: o.Gpus = None,
        nodes: o.Nodes = None,
        gpu: o.Gpu = None,
        device: o.Device = None,
        nproc: o.Nproc = None,
        node_rank: o.NodeRank = None,
        master_addr: o.MasterAddr = None,
        master_port: o.MasterPort = None,
        rdzv_endpoint: o.Rdzv = None,
        launcher: o.Launcher = None,
        partition: o.Partition = None,
        account: o.Account = None,
        time_limit: o.TimeLimit = None,
        sbatch: o.Sbatch = None,
        preset: o.Preset = None,
        config: o.ConfigFile = None,
        set_: o.Set = None,
        output_dir: o.OutputDir = None,
        dry_run: o.DryRun = False,
        json_: o.Json = False,
        max_steps: o.MaxSteps = None,
        epochs: o.Epochs = None,
        lr: o.Lr = None,
        lr_scheduler: o.LrScheduler = None,
        warmup_ratio: o.Warmup = None,
        weight_decay: o.WeightDecay = None,
        batch_size: Annotated[
            int | None, typer.Option("--batch-size", help="Prompts per step (global).", rich_help_panel=RL)
        ] = None,
        n: Annotated[int | None, typer.Option("--n", help="Samples per prompt.", rich_help_panel=RL)] = None,
        max_prompt_len: Annotated[
            int | None,
            typer.Option(
                "--max-prompt-len", help="Longest prompt in tokens (longer ones are skipped).", rich_help_panel=RL
            ),
        ] = None,
        max_response_len: Annotated[
            int | None,
            typer.Option("--max-response-len", help="Most tokens generated per sample.", rich_help_panel=RL),
        ] = None,
        temperature: Annotated[
            float | None, typer.Option("--temperature", help="Sampling temperature.", rich_help_panel=RL)
        ] = None,
        top_p: Annotated[
            float | None, typer.Option("--top-p", help="Nucleus sampling (1 = off).", rich_help_panel=RL)
        ] = None,
        top_k: Annotated[
            int | None,
            typer.Option("--top-k", help="Sample from the k likeliest tokens (-1 = off).", rich_help_panel=RL),
        ] = None,
        mini_batch_size: Annotated[
            int | None,
            typer.Option(
                "--mini-batch-size", help="Prompts per optimizer step (0 = the whole batch).", rich_help_panel=RL
            ),
        ] = None,
        micro_batch_size: o.MicroBatch = None,
        gradient_checkpointing: o.GradCkpt = None,
        ppo_epochs: Annotated[
            int | None, typer.Option("--ppo-epochs", help="Passes over each rollout batch.", rich_help_panel=RL)
        ] = None,
        kl_coef: Annotated[
            float | None,
            typer.Option(
                "--kl-coef", help="KL coefficient against the reference model (0 = no reference).", rich_help_panel=RL
            ),
        ] = None,
        kl_kind: Annotated[
            str | None, typer.Option("--kl-kind", help=f"{describe(names.KlKind)}.", rich_help_panel=RL)
        ] = None,
        entropy_coef: Annotated[
            float | None,
            typer.Option("--entropy-coef", help="Entropy bonus in the policy loss (0 = off).", rich_help_panel=RL),
        ] = None,
        critic_lr: Annotated[
            float | None,
            typer.Option("--critic-lr", help="Learning rate of the critic (ppo).", rich_help_panel=RL),
        ] = None,
        adv: str | None = None,  # its option (help per method) is set below: ADV_OPTION
        loss_agg: Annotated[
            str | None,
            typer.Option(
                "--loss-agg",
                help=f"{describe(names.LossAgg)}.",
                rich_help_panel=RL,
            ),
        ] = None,
        clip_low: Annotated[
            float | None, typer.Option("--clip-low", help="PPO clip below 1.", rich_help_panel=RL)
        ] = None,
        clip_high: Annotated[
            float | None,
            typer.Option("--clip-high", help="PPO clip above 1 (0.28 = DAPO's clip-higher).", rich_help_panel=RL),
        ] = None,
        rollout: Annotated[
            str | None, typer.Option("--rollout", help=f"{describe(names.RolloutEngine)}.", rich_help_panel=RL)
        ] = None,
        reward: Annotated[
            list[str] | None,
            typer.Option(
                "--reward",
                help="NAME[:WEIGHT], repeatable (weighted sum): a built-in reward (docs/rewards.md; the shell "
                "completion lists them), file.py:fn, file.py:Class or module:fn. "
                "E.g. --reward gsm8k --reward format:0.2.",
                rich_help_panel=RL,
            ),
        ] = None,
        reward_model: Annotated[
            str | None,
            typer.Option(
                "--reward-model",
                help="A sequence-classification reward model (HF directory), added as a reward component.",
                rich_help_panel=RL,
            ),
        ] = None,
        samples_every: Annotated[
            int | None,
            typer.Option(
                "--samples-every",
                help="Write a few (prompt, response, reward, advantage) samples to samples.jsonl every N steps "
                "and show two (0 = never).",
                rich_help_panel="Training",
            ),
        ] = None,
        tools: Annotated[
            str | None,
            typer.Option(
                "--tools",
                help="Tools the model may call: FILE.py (every public function), FILE.py:a,b, or a verl tool "
                "config YAML.",
                rich_help_panel=AGENT,
            ),
        ] = None,
        env: Annotated[
            str | None,
            typer.Option(
                "--env",
                help="An environment FILE.py:Class, one per trajectory: reset(**row), its public methods are "
                "tools, get_reward() a reward component.",
                rich_help_panel=AGENT,
            ),
        ] = None,
        interaction: Annotated[
            str | None,
            typer.Option(
                "--interaction", help="A verl Interaction (a simulated user) config YAML.", rich_help_panel=AGENT
            ),
        ] = None,
        max_turns: Annotated[
            int | None,
            typer.Option(
                "--max-turns", help="Assistant turns per trajectory (default 8 with tools).", rich_help_panel=AGENT
            ),
        ] = None,
        save_every: o.SaveEvery = None,
        keep_last: o.KeepLast = None,
        resume: o.Resume = None,
        seed: o.Seed = None,
        lora_rank: o.LoraRank = None,
        lora_alpha: o.LoraAlpha = None,
        lora_targets: o.LoraTargets = None,
        lora_dropout: o.LoraDropout = None,
        log: o.Log = None,
        run_name: o.RunName = None,
        trust_remote_code: o.TrustRemoteCode = None,
        ignore_memory_check: o.IgnoreMemoryCheck = False,
        plugin: Plugin = None,
    ) -> None:
        mapping = o.to_mapping(locals(), KEYS)
        mapping["reward.fn"] = reward[0] if reward and len(reward) == 1 else None
        mapping["reward.fns"] = reward if reward and len(reward) > 1 else None
        o.run_training(
            method,
            preset=preset,
            config_file=config,
            options=mapping,
            sets=set_,
            dry_run=dry_run,
            as_json=json_,
            ignore_memory_check=ignore_memory_check,
        )

    command.__annotations__["adv"] = ADV_OPTION[method]
    return o.show_defaults(command, method, KEYS)


grpo = _rl_command("grpo")
grpo.__doc__ = "GRPO: n samples per prompt, group-normalised advantages, PPO-clip updates, no critic."
ppo = _rl_command("ppo")
ppo.__doc__ = "PPO with a critic: GAE advantages, clipped value loss, KL penalty in the reward."
