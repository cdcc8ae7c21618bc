"""What every process of an RL run builds from its config before it trains or generates: the model's
source, tokenizer, tools and image processor, the prompts and their stream, and the rollout spec with
the path each rollout engine loads first. :func:`build_inputs` builds them once per process; the trainer
(:class:`~rlctl.recipes.rl.trainer.RLTrainer`) and a split run's rollout process
(:class:`~rlctl.recipes.rl.offpolicy.RolloutWorker`) are given them, neither derives them again."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from rlctl.data.rl import RLData, build_rl_data
from rlctl.data.sft import use_chat_template
from rlctl.engines.base import ModelSource, load_tokenizer, load_vision_processor, model_source
from rlctl.recipes.rl.stream import PromptStream
from rlctl.recipes.rl.turns import load_agent
from rlctl.rewards import needs_answer
from rlctl.rollout import RolloutSpec
from rlctl.runtime.entry import RunContext
from rlctl.support import JobFacts, refuse


@dataclass
class RLInputs:
    source: ModelSource
    tokenizer: object
    agent_spec: object | None  # tools / environment / interaction (None: single-turn)
    vision: object | None  # a VL model's image processor
    data: RLData
    stream: PromptStream  # the step sampler and the data position
    # rollout.*, with model_path: what every rollout engine loads first (a random init: RUN/rollout_init)
    rollout: RolloutSpec


def build_inputs(ctx: RunContext, log: Callable[[str], None]) -> RLInputs:
    cfg = ctx.cfg
    source = model_source(cfg.model.name, random_init=cfg.model.random_init)
    tokenizer = use_chat_template(load_tokenizer(source), cfg)
    agent_spec = load_agent(cfg)
    vision = load_vision_processor(source, tokenizer)
    facts = JobFacts(model=cfg.model.name, vision=vision is not None, agent=agent_spec is not None)
    refuse(replace(facts, rollout_procs=cfg.rollout.procs), "agent_vision", "split_vision")
    data = build_rl_data(
        cfg,
        tokenizer,
        cache_dir=ctx.paths.data_cache,
        log=log,
        tools=agent_spec.schemas if agent_spec is not None else None,
        vision=vision,
        answer_required=needs_answer(cfg),
    )
    # the trainers export a random init's first weights there before any rollout engine starts
    path = str(ctx.paths.rollout_init) if source.random_init else source.path
    rollout = RolloutSpec.from_config(cfg).replace(model_path=path)  # each process sets its device, dtype, seed
    return RLInputs(source, tokenizer, agent_spec, vision, data, PromptStream(cfg, len(data.train)), rollout)
