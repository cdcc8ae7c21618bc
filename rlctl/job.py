"""A job, resolved once, before anything is launched.

:func:`resolve_job` assembles the configuration (preset < --config < options < --set) and its plan;
:func:`ready_to_launch` fixes its run directory and runs every check before launch
(:func:`rlctl.checks.check_job`); nothing is written until every check has passed (the launcher creates
the run directory after).

Used by ``rlctl sft|grpo|ppo``, ``rlctl estimate memory``, ``rlctl bench`` and the demo. No torch import here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rlctl.checks import check_job
from rlctl.config import RunConfig
from rlctl.config.algorithm import check_algorithm
from rlctl.errors import UserError
from rlctl.modelfiles import check_remote_code, model_files

if TYPE_CHECKING:
    from rlctl.plan import Plan


@dataclasses.dataclass(frozen=True)
class Job:
    """A job resolved once: what the user asked for, and the same with the plan's choices filled in."""

    requested: RunConfig  # preset < --config < options < --set; None settings still open (what-to-rent reads it)
    cfg: RunConfig  # with the plan applied: what the launcher writes and the ranks read
    plan: Plan

    def __iter__(self):  # ``cfg, plan = resolve_job(...)``
        return iter((self.cfg, self.plan))


def resolve_job(
    method: str,
    *,
    preset: str | None = None,
    config_file: str | None = None,
    options: dict,
    sets: list[str] | None = None,
    defaults: dict | None = None,
    environ: Mapping[str, str] | None = None,
    measure_data: bool = False,
) -> Job:
    """The configuration (preset < ``defaults`` < config file < options < --set) and its plan.

    ``defaults``: a command's own defaults over the preset's (``rlctl estimate memory``: CUDA);
    ``measure_data``: sft / dpo, the estimate's labelled share measured on the data (:func:`data_labelled_fraction`;
    it loads the tokenizer, seconds a training command's dry run and launch do not spend: they keep the default);
    ``environ``: inside a SLURM allocation, this node's place in it fills the options left out."""
    from rlctl.config import build_config, check_no_effect, dotted_to_nested, flat_keys, parse_set_options
    from rlctl.plan import apply_plan, resolve_plan
    from rlctl.presets import method_layers

    if environ is not None:
        from rlctl.slurm import allocation_options

        options = allocation_options(options, environ)
    layers = method_layers(method, preset) + [dotted_to_nested(defaults or {})]
    file_layer = _config_file_layer(config_file, method) if config_file else {}
    named = {k: v for k, v in options.items() if v is not None}
    set_layer = parse_set_options(sets or [])
    layers += [file_layer, dotted_to_nested(named), set_layer]
    cfg = build_config(method, layers)
    check_no_effect(cfg, named={**named, **flat_keys(set_layer)}, config_file=flat_keys(file_layer))
    if not cfg.model.name:
        raise UserError(
            f"no model given: pass --model (e.g. `rlctl {method} --model Qwen2.5-7B ...`) or set model.name in --config"
        )
    check_algorithm(cfg)
    model = model_files(cfg.model.name)
    if model is not None:
        check_remote_code(cfg, model)  # before the planner, which would only say the model type is unknown
    measured = data_labelled_fraction(cfg) if measure_data and model is not None else None
    plan = resolve_plan(cfg, labelled_fraction=measured)
    return Job(requested=cfg, cfg=apply_plan(cfg, plan), plan=plan)


def data_labelled_fraction(cfg) -> float | None:
    """sft / dpo with a local model and data: the labelled share of the data's first rows' positions, which the
    memory estimate counts logits at (:mod:`rlctl.data.labelled`); None where it cannot be measured here."""
    if cfg.method not in ("sft", "dpo") or not cfg.data.path:
        return None
    from rlctl.data.labelled import labelled_fraction
    from rlctl.data.sft import use_chat_template
    from rlctl.engines.base import load_tokenizer, model_source

    try:
        tokenizer = use_chat_template(load_tokenizer(model_source(cfg.model.name)), cfg)
        return labelled_fraction(cfg, tokenizer)
    except UserError:  # no tokenizer, unreadable data: the checks before launch say so
        return None


def _config_file_layer(path: str, method: str) -> dict:
    from rlctl.config import load_yaml_file

    layer = load_yaml_file(path)
    if layer.get("method") not in (None, method):
        raise UserError(f"{path} is a `{layer['method']}` config; run `rlctl {layer['method']}` with it")
    return layer


def ready_to_launch(job: Job, *, ignore_memory_check: bool = False, environ: Mapping[str, str] = os.environ):
    """The config to launch: its run directory fixed and owned by this process (its lock, held until the
    launcher ends or the process exits), and every check before launch passed (:func:`check_job`); a job
    submitted to SLURM skips the checks of this machine's devices."""
    cfg, plan = job.cfg, job.plan
    slurm = cfg.cluster.launcher == "slurm"
    if plan.nodes > 1 and not cfg.output_dir and not slurm and not environ.get("SLURM_JOB_ID"):
        raise UserError(
            f"a run on {plan.nodes} nodes needs --output-dir: the same run directory on every node, "
            f"on a filesystem all nodes share"
        )
    cfg = with_run_dir(cfg)
    lock = lock_run_dir(cfg, plan, environ)
    try:
        check_job(cfg, plan, ignore_memory_check=ignore_memory_check, on_this_machine=not slurm)
    except BaseException:
        lock.release()  # a refused job leaves the directory as it was (a new one is removed)
        raise
    return cfg


def lock_run_dir(cfg: RunConfig, plan: Plan, environ: Mapping[str, str]):
    """Own the run directory (:mod:`rlctl.runtime.run_lock`) before anything is written or read there
    (``--resume``): a file or someone else's directory is refused first, then another live run's."""
    import sys

    from rlctl.checks import check_output_dir
    from rlctl.runtime.run_lock import job_key, take_run_dir

    run_dir = Path(cfg.output_dir)
    check_output_dir(run_dir, resume=bool(cfg.checkpoint.resume))
    notes: list[str] = []
    lock = take_run_dir(run_dir, job_key(plan.nodes, cfg.hardware, environ), notes=notes)
    for line in notes:
        print(line, file=sys.stderr, flush=True)
    return lock


def with_run_dir(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``output_dir`` fixed (the default names a time, so it is chosen once, here)."""
    from rlctl.launch import default_run_dir

    run_dir = Path(cfg.output_dir) if cfg.output_dir else default_run_dir(cfg)
    return dataclasses.replace(cfg, output_dir=str(run_dir.absolute()))
