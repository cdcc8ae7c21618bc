"""Agent runs (``--tools`` / ``--env`` / ``--interaction``): the run's tools, its multi-turn loop over the
rollout engine, and this rank's prompts turned into trajectories (:mod:`rlctl.agents`)."""

from __future__ import annotations

from rlctl.config import RunConfig, agent_enabled, max_turns
from rlctl.data.rl import Prompt, prompt_messages
from rlctl.errors import UserError


def load_agent(cfg: RunConfig):
    """The run's :class:`rlctl.agents.tools.AgentSpec`, or None for a single-turn run."""
    if not agent_enabled(cfg):
        return None
    from rlctl.agents.tools import load_agent_spec

    a = cfg.agent
    return load_agent_spec(
        tools=a.tools,
        env=a.env,
        interaction=a.interaction,
        timeout_s=a.tool_timeout_s,
        results=a.tool_results,
        verl_lifecycle=a.verl_tool_lifecycle,
    )


def make_agent_loop(cfg: RunConfig, spec, tokenizer, rollout, rollout_tp: int):
    """The multi-turn loop of an agent run (None for a single-turn run)."""
    if spec is None:
        return None
    from rlctl.agents.loop import AgentLoop, LoopSettings
    from rlctl.agents.parse import detect_style

    if rollout_tp != 1:
        raise UserError(
            f"multi-turn rollouts (--tools / --env) run on rollout.tp=1 engines; got rollout.tp={rollout_tp}"
        )
    a = cfg.agent
    style = detect_style(tokenizer)
    if style is None and (a.tools or a.env):
        raise UserError(
            "the chat template has no tool-call format (no <tool_call> nor Llama 3 JSON calls): use a model "
            "whose template takes tools, or pass --chat-template FILE.jinja"
        )
    settings = LoopSettings(
        max_turns=max_turns(cfg),
        max_response_len=cfg.rollout.max_response_len,
        tool_timeout_s=a.tool_timeout_s,
        tool_max_chars=a.tool_max_chars,
        style=style or "hermes",  # an interaction alone: no calls expected
    )
    stop_ids = set(getattr(rollout, "stop_token_ids", ()) or ())
    if tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    return AgentLoop(spec, tokenizer, settings, stop_ids)


def run_agent(loop, cfg: RunConfig, engine, prompts: list[Prompt], n: int, sampling) -> list:
    """The ``n`` trajectories of each of ``prompts`` (prompt-major; ``prompt_index`` into ``prompts``)."""
    from rlctl.agents.loop import AgentPrompt

    d = cfg.data
    agent_prompts = [
        AgentPrompt(p.token_ids, prompt_messages(p.row[d.prompt_field], d.prompt_field, d.system_prompt), p.row)
        for p in prompts
    ]
    return loop.run(engine, agent_prompts, n, sampling) if agent_prompts else []
