"""`rlctl sft|grpo|ppo|dpo|rm`: one code path from the flags to a launched (or printed) job.

Each command's options come from the table of flags (:mod:`rlctl.cli.flags`); the job is resolved by
:mod:`rlctl.job` and checked by :mod:`rlctl.checks` (every pre-launch check lives there), then printed
(--dry-run), submitted (--launcher slurm) or launched. grpo and ppo take the same options; they differ in their presets
(grpo: group advantages, no critic; ppo: a critic and GAE). No torch import here.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import typer

from rlctl.cli.options import command, to_options

SFT_EXAMPLES = """
Examples:

  rlctl sft --model Qwen2.5-7B --data chats.jsonl --gpus 8 --dry-run

  rlctl sft --model Qwen2.5-1.5B --data chats.jsonl --gpus 2 --lora-rank 16 --max-steps 500

  rlctl sft --model ./my-model --data data.parquet --device cpu --nproc 2 --max-len 512

  rlctl sft --config run.yaml --set train.lr=2e-5 --resume auto -o runs/my-sft
"""

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

DPO_EXAMPLES = """
Examples:

  rlctl dpo --model Qwen2.5-7B --data prefs.jsonl --gpus 8 --dry-run

  rlctl dpo --model ./sft-model --data prefs.jsonl --loss sigmoid --beta 0.1 --lora-rank 16

  rlctl dpo --model ./tiny --data prefs.jsonl --device cpu --nproc 2 --loss simpo --val-fraction 0.1

  rlctl dpo --model ./tiny --data kto.jsonl --device cpu --loss kto
"""

RM_EXAMPLES = """
Examples:

  rlctl rm --model Qwen2.5-1.5B --data prefs.jsonl --gpus 8 --dry-run

  rlctl rm --model ./tiny --data prefs.jsonl --device cpu --nproc 2 --val-fraction 0.1 -o runs/rm

  rlctl ppo --model ./tiny --data prompts.jsonl --reward-model runs/rm/hf --device cpu
"""

DOCS = {
    "sft": "Supervised fine-tuning: packed sequences, loss on assistant tokens, LoRA or full, exact resume.",
    "grpo": "GRPO: n samples per prompt, group-normalised advantages, PPO-clip updates, no critic.",
    "ppo": "PPO with a critic: GAE advantages, clipped value loss, KL penalty in the reward.",
    "dpo": "Preference optimization on chosen/rejected pairs: DPO, IPO, hinge, robust, SimPO, ORPO, KTO.",
    "rm": "A Bradley-Terry reward model on chosen/rejected pairs, exported for --reward-model.",
}
EXAMPLES = {"sft": SFT_EXAMPLES, "grpo": GRPO_EXAMPLES, "ppo": PPO_EXAMPLES, "dpo": DPO_EXAMPLES, "rm": RM_EXAMPLES}
JSON_NEEDS_DRY_RUN = "--json goes with --dry-run (a real run writes metrics.jsonl in its run directory)"


def run_training(method: str, values: dict[str, Any]) -> None:
    """The body of `rlctl sft|grpo|ppo|dpo|rm`: resolve the job, then print it (--dry-run), submit it to SLURM
    or launch it here, once every check of :mod:`rlctl.checks` has passed."""
    from rlctl.checks import check_dry_run, check_placement
    from rlctl.errors import UserError
    from rlctl.job import ready_to_launch, resolve_job

    job = resolve_job(
        method,
        preset=values["preset"],
        config_file=values["config_file"],
        options=to_options(values, method),
        sets=values["sets"],
        environ=os.environ,  # inside a SLURM allocation: this node's place
    )
    check_placement(job.plan)
    dry_run, as_json = values["dry_run"], values["as_json"]
    if dry_run:
        check_dry_run(job.cfg, job.plan)  # what the launch refuses, a dry run refuses
    if job.cfg.cluster.launcher == "slurm":
        return submit_slurm(job, dry_run=dry_run, as_json=as_json, ignore_memory_check=values["ignore_memory_check"])
    if dry_run:
        return print_dry_run(job, as_json=as_json)
    if as_json:
        raise UserError(JSON_NEEDS_DRY_RUN)
    cfg = ready_to_launch(job, ignore_memory_check=values["ignore_memory_check"])
    from rlctl.launch import launch_job

    raise typer.Exit(launch_job(cfg, job.plan))


def submit_slurm(job, *, dry_run: bool, as_json: bool, ignore_memory_check: bool) -> None:
    """--launcher slurm: print the sbatch script (--dry-run), or write it with the job and submit it."""
    from pathlib import Path

    from rlctl.errors import UserError
    from rlctl.job import ready_to_launch
    from rlctl.launch import default_run_dir
    from rlctl.slurm import sbatch_script, submit, write_job

    cfg, plan = job.cfg, job.plan
    if dry_run:
        script = sbatch_script(cfg, plan, Path(cfg.output_dir or default_run_dir(cfg)).absolute())
        if as_json:
            sys.stdout.write(json.dumps({"plan": plan.to_dict(), "config": cfg.to_dict(), "sbatch": script}) + "\n")
        else:
            sys.stdout.write(script)
        return
    if as_json:
        raise UserError(JSON_NEEDS_DRY_RUN)
    cfg = ready_to_launch(job, ignore_memory_check=ignore_memory_check)
    run_dir = Path(cfg.output_dir)
    from rlctl.runtime.run_lock import held

    script = write_job(cfg, plan, run_dir)
    held(run_dir).release()  # the job's nodes take the lock when it starts
    job_id = submit(script)
    per_node = f"{plan.nproc_per_node} GPUs" if plan.device == "cuda" else f"{plan.nproc_per_node} processes"
    print(f"submitted batch job {job_id}: {plan.nodes} nodes x {per_node}; script: {script}")
    print(f"logs: {run_dir / f'slurm-{job_id}.out'} (SLURM), {run_dir / 'train.log'} (the ranks)")
    print(f"follow it: squeue -j {job_id}; tail -f {run_dir / 'train.log'}")


def print_dry_run(job, *, as_json: bool) -> None:
    """The plan, the resolved config, the memory estimate and the launch command; nothing is written."""
    import shlex

    from rlctl.launch import build_command, default_run_dir

    cfg, plan = job.cfg, job.plan
    argv = build_command(cfg, plan, cfg.output_dir or str(default_run_dir(cfg)))
    if as_json:
        doc = {"plan": plan.to_dict(), "config": cfg.to_dict(), "launch": argv, "estimate": plan.estimate.to_dict()}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    import yaml
    from rich.console import Console
    from rich.panel import Panel
    from rich.syntax import Syntax

    from rlctl.estimate.render import render_estimate
    from rlctl.plan.render import render_plan

    console = Console()
    render_plan(console, plan)
    config = Syntax(yaml.safe_dump(cfg.to_dict(), sort_keys=False), "yaml")
    console.print(Panel(config, title="resolved configuration", expand=False))
    render_estimate(console, plan.estimate)
    launch = " ".join(shlex.quote(a) for a in argv)
    console.print(Panel(launch, title="launch command (dry run: nothing was written)", expand=False))


def _command(method: str):
    return command(method, lambda values: run_training(method, values), doc=DOCS[method], defaults_of=method)


sft, grpo, ppo = _command("sft"), _command("grpo"), _command("ppo")
dpo, rm = _command("dpo"), _command("rm")
