"""Single-turn and multi-turn runs as two objects chosen once (:func:`make_turns`),
so batching and scoring have one path: every sample is an :class:`rlctl.agents.trajectory.Trajectory`, a
single-turn sample one of one turn (:func:`one_turn`: its prompt, the sampled tokens, all trained on).
What differs is here: how a rollout group generates (the engine's samples, or the agent loop's
trajectories), what the reward manager is told of the turns, a step's turn metrics, and what
samples.jsonl keeps of each."""

from __future__ import annotations

import torch

from rlctl.agents.trajectory import Trajectory
from rlctl.config import RunConfig
from rlctl.data.rl import Prompt
from rlctl.recipes.rl.agent import make_agent_loop, run_agent
from rlctl.recipes.rl.scoring import agent_metrics


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

    def generate(self, rollout, shares: list[list[Prompt]], n: int, sampling) -> list:
        return run_agent(self.loop, self.cfg, rollout.engine, shares[0], n, sampling)

    def trajectories(self, samples: list, prompts: list[Prompt]) -> list[Trajectory]:
        return samples  # the loop's already

    def for_reward(self, trajectories: list[Trajectory]) -> list | None:
        return trajectories  # turns, tool calls and the environment's rewards

    def metrics(self, trajectories: list[Trajectory], device: torch.device) -> dict[str, float]:
        return agent_metrics(trajectories, device)

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
