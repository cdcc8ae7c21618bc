"""`rlctl grpo` and `rlctl ppo`: the RL loop (rollout, rewards, advantages, PPO updates, weight sync).

Both commands take the same options; they differ in their presets (grpo: group advantages, no critic;
ppo: a critic and GAE).
"""

from __future__ import annotations

from typing import Annotated

import typer

from rlctl.cli import options as o

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


ADV_OPTION = {
    method: Annotated[str | None, typer.Option("--adv", help=text, rich_help_panel=RL)]
    for method, text in (
        ("grpo", "grpo | rloo | reinforce_pp."),
        ("ppo", "gae | grpo | rloo | reinforce_pp."),
    )
}


def _rl_command(method: str):
    def command(
        model: o.Model = None,
        data: o.Data = None,
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
        mini_batch_size: Annotated[
            int | None,
            typer.Option(
                "--mini-batch-size", help="Prompts per optimizer step (default: the whole batch).", rich_help_panel=RL
            ),
        ] = None,
        micro_batch_size: o.MicroBatch = None,
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
            str | None, typer.Option("--kl-kind", help="k1 | abs | k2 | k3.", rich_help_panel=RL)
        ] = None,
        adv: str | None = None,  # its option (help per method) is set below: ADV_OPTION
        loss_agg: Annotated[
            str | None,
            typer.Option(
                "--loss-agg",
                help="token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm.",
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
            str | None, typer.Option("--rollout", help="auto | hf | vllm | sglang.", rich_help_panel=RL)
        ] = None,
        reward: Annotated[
            list[str] | None,
            typer.Option(
                "--reward",
                help="NAME[:WEIGHT], repeatable (weighted sum): gsm8k | math | exact | format | length | "
                "file.py:fn | file.py:Class | module:fn. E.g. --reward gsm8k --reward format:0.2.",
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
        save_every: o.SaveEvery = None,
        keep_last: o.KeepLast = None,
        resume: o.Resume = None,
        seed: o.Seed = None,
        lora_rank: o.LoraRank = None,
        lora_alpha: o.LoraAlpha = None,
        log: o.Log = None,
        trust_remote_code: o.TrustRemoteCode = None,
        ignore_memory_check: o.IgnoreMemoryCheck = False,
    ) -> None:
        mapping = o.common_mapping(
            model=model,
            data=data,
            gpus=gpus,
            nodes=nodes,
            gpu=gpu,
            device=device,
            nproc=nproc,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            rdzv_endpoint=rdzv_endpoint,
            launcher=launcher,
            partition=partition,
            account=account,
            time=time_limit,
            sbatch=sbatch,
            output_dir=output_dir,
            trust_remote_code=trust_remote_code,
        )
        mapping.update(
            {
                "train.max_steps": max_steps,
                "train.epochs": epochs,
                "train.lr": lr,
                "train.batch_size": batch_size,
                "rollout.n": n,
                "rollout.max_prompt_len": max_prompt_len,
                "rollout.max_response_len": max_response_len,
                "rollout.temperature": temperature,
                "algo.mini_batch_size": mini_batch_size,
                "train.micro_batch_size": micro_batch_size,
                "algo.ppo_epochs": ppo_epochs,
                "algo.kl_coef": kl_coef,
                "algo.kl_kind": kl_kind,
                "algo.adv": adv,
                "algo.loss_agg": loss_agg,
                "algo.clip_low": clip_low,
                "algo.clip_high": clip_high,
                "rollout.engine": rollout,
                "reward.fn": reward[0] if reward and len(reward) == 1 else None,
                "reward.fns": reward if reward and len(reward) > 1 else None,
                "reward.model": reward_model,
                "checkpoint.save_every": save_every,
                "checkpoint.keep_last": keep_last,
                "checkpoint.resume": resume,
                "train.seed": seed,
                "lora.rank": lora_rank,
                "lora.alpha": lora_alpha,
                "log.backends": log,
            }
        )
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
    return command


grpo = _rl_command("grpo")
grpo.__doc__ = "GRPO: n samples per prompt, group-normalised advantages, PPO-clip updates, no critic."
ppo = _rl_command("ppo")
ppo.__doc__ = "PPO with a critic: GAE advantages, clipped value loss, KL penalty in the reward."
