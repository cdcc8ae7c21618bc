"""Turns: single-turn and multi-turn runs as two objects chosen once (:func:`make_turns`), so batching and
scoring have one path: every sample is an :class:`rlctl.agents.trajectory.Trajectory`, a
single-turn sample one of one turn (:func:`one_turn`: its prompt, the sampled tokens, all trained on).
What differs is here: how a rollout group generates (the engine's samples, or the agent loop's
trajectories), what the reward manager is told of the turns, a step's turn metrics, and what
samples.jsonl keeps of each. Agent runs (``--tools`` / ``--env`` / ``--interaction``): the run's tools
(:func:`load_agent`), its multi-turn loop over the rollout engine (:func:`make_agent_loop`, ``agent.max_turns``
as the resolved config has it) and this rank's prompts turned into trajectories (:func:`run_agent`,
:mod:`rlctl.agents`); ``rlctl eval`` and ``rlctl chat`` use the same three."""

from __future__ import annotations

import torch

from rlctl.agents.trajectory import Trajectory
from rlctl.config import RunConfig, agent_enabled
from rlctl.data.rl import Prompt, prompt_messages
from rlctl.errors import UserError
from rlctl.recipes.rl.scoring import agent_metrics


def load_agent(cfg: RunConfig):
    """The run's :class:`rlctl.agents.tools.AgentSpec`, or None for a single-turn run."""
    if not agent_enabled(cfg):
        return None
    from rlctl.agents.spec import load_agent_spec

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
        max_turns=a.max_turns,  # resolved by the plan (rlctl.plan.planner.write_derived)
        max_response_len=cfg.rollout.max_response_len,
        tool_timeout_s=a.tool_timeout_s,
        tool_max_chars=a.tool_max_chars,
        style=style or "hermes",  # an interaction alone: no calls expected
    )
    stop_ids = set(getattr(rollout, "stop_token_ids", ()) or ())
    if tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    return AgentLoop(spec, tokenizer, settings, stop_ids)


def agent_prompt(cfg: RunConfig, prompt: Prompt):
    """``prompt`` as the agent loop takes it (:class:`rlctl.agents.loop.AgentPrompt`): ids, messages, row."""
    from rlctl.agents.loop import AgentPrompt

    d = cfg.data
    messages = prompt_messages(prompt.row[d.prompt_field], d.prompt_field, d.system_prompt)
    return AgentPrompt(prompt.token_ids, messages, prompt.row)


def run_agent(loop, cfg: RunConfig, engine, prompts: list[Prompt], n: int, sampling) -> list:
    """The ``n`` trajectories of each of ``prompts`` (prompt-major; ``prompt_index`` into ``prompts``)."""
    agent_prompts = [agent_prompt(cfg, p) for p in prompts]
    return loop.run(engine, agent_prompts, n, sampling) if agent_prompts else []


def one_turn(sample, prompt: Prompt) -> Trajectory:
    """A rollout engine's sample of ``prompt`` as a trajectory of one sampled turn."""
    return Trajectory(
        prompt_ids=prompt.token_ids,
        prompt_index=sample.prompt_index,
        token_ids=sample.token_ids,
        mask=[1] * len(sample.token_ids),
        logprobs=sample.logprobs,
        turns=1,
        finish_reason=sample.finish_reason,
    )


class SingleTurn:
    """One response per prompt sample: the rollout engine's."""

    def generate(self, rollout, shares: list[list[Prompt]], n: int, sampling) -> list:
        return rollout.group_generate(shares, n, sampling)

    def trajectories(self, samples: list, prompts: list[Prompt]) -> list[Trajectory]:
        """``samples`` (``prompt_index`` into ``prompts``) as trajectories."""
        return [one_turn(s, prompts[s.prompt_index]) for s in samples]

    def for_reward(self, trajectories: list[Trajectory]) -> list | None:
        return None  # the reward sees a prompt and a response

    def metrics(self, trajectories: list[Trajectory], device: torch.device) -> dict[str, float]:
        return {}

    def logged(self, t: Trajectory) -> dict:
        """What samples.jsonl adds to a sample's record (a key already there stays)."""
        return {}


class MultiTurn:
    """Trajectories of the agent ``loop`` (tools, an environment or an interaction)."""

    def __init__(self, loop, cfg: RunConfig):
        self.loop, self.cfg = loop, cfg
        self.tool_wait_s: float | None = None  # this process's lockstep tool waits since the last metrics

    def generate(self, rollout, shares: list[list[Prompt]], n: int, sampling) -> list:
        out = run_agent(self.loop, self.cfg, rollout.engine, shares[0], n, sampling)
        self.tool_wait_s = (self.tool_wait_s or 0.0) + self.loop.tool_wait_s
        return out

    def trajectories(self, samples: list, prompts: list[Prompt]) -> list[Trajectory]:
        return samples  # the loop's already

    def for_reward(self, trajectories: list[Trajectory]) -> list | None:
        return trajectories  # turns, tool calls and the environment's rewards

    def metrics(self, trajectories: list[Trajectory], device: torch.device) -> dict[str, float]:
        """agent_metrics, and ``time/tools`` (the rollout's seconds waiting for tools, lockstep: part of
        ``time/rollout``) where this process ran the loop (a split run's trainers did not)."""
        out = agent_metrics(trajectories, device)
        if self.tool_wait_s is not None:
            out["time/tools"], self.tool_wait_s = self.tool_wait_s, None
        return out

    def logged(self, t: Trajectory) -> dict:
        """The whole conversation, with roles and tool calls; the environment's rewards where the reward
        components are not logged already."""
        return {
            "messages": t.logged_messages(),
            "turns": t.turns,
            "finish_reason": t.finish_reason,
            "rewards": t.rewards,
        }


def make_turns(cfg: RunConfig, agent_spec, tokenizer, engine, rollout_tp: int) -> SingleTurn | MultiTurn:
    """The run's mode: multi-turn over the agent loop when tools, an environment or an interaction are
    given (``agent_spec``), else single-turn."""
    loop = make_agent_loop(cfg, agent_spec, tokenizer, engine, rollout_tp)
    return SingleTurn() if loop is None else MultiTurn(loop, cfg)
