"""The multi-turn loop: sample, run the tool calls, append their results as tokens, sample again.

Token-in/token-out over any :class:`rlctl.rollout.RolloutEngine`: the first turn is the engine's ``generate``
(the ``n`` samples of a prompt share its prefill), each later turn :meth:`~rlctl.rollout.RolloutEngine.
continue_generation` on the trajectory's token ids so far. The tokens trained on are exactly those the engine
sampled plus the chat template's rendering of the appended tool / user messages (:func:`~rlctl.agents.
trajectory.render_delta`); the conversation text is never re-tokenized. A trajectory ends when the model
answers without a tool call (and no simulated user replies), after ``max_turns`` assistant turns, on a
malformed tool call, or when its response would exceed ``max_response_len`` tokens (then the tool results that
do not fit are not appended and it counts as truncated).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from rlctl.agents.parse import content_before_calls, parse_tool_calls
from rlctl.agents.runner import run_calls as run_batch_calls
from rlctl.agents.trajectory import ToolTurn, Trajectory, UserTurn, assistant_message, render_delta

SEED_STRIDE = 7_919  # each later turn samples with seed + turn * SEED_STRIDE


@dataclass(frozen=True)
class LoopSettings:
    max_turns: int
    max_response_len: int
    tool_timeout_s: float
    tool_max_chars: int
    style: str  # rlctl.agents.parse.ToolCallStyle


@dataclass
class AgentPrompt:
    """A prompt of an agent run: its ids (rendered with the tool schemas), messages and dataset row."""

    token_ids: list[int]
    messages: list[dict]
    row: dict


def render_ids(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The ids of ``messages`` and the generation prompt, with the tool schemas in the template."""
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _with_suffix(messages: list[dict], suffix: str) -> list[dict]:
    """The messages with ``suffix`` appended to the last user message (TRL's reset() convention)."""
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m.get("role") == "user":
            m["content"] = f"{m.get('content') or ''}{suffix}"
            return out
    return out + [{"role": "user", "content": suffix}]


class AgentLoop:
    """Runs the trajectories of one batch of prompts on a rollout engine."""

    def __init__(self, spec: Any, tokenizer: Any, settings: LoopSettings, stop_ids: set[int], run_calls=None):
        self.spec, self.tokenizer, self.settings = spec, tokenizer, settings
        self.stop_ids, self.run_calls = set(stop_ids), run_calls or run_batch_calls
        self.tool_wait_s = 0.0  # the last run's seconds waiting for the batch's tools (lockstep)

    def run(self, engine, prompts: list[AgentPrompt], n: int, sampling) -> list[Trajectory]:
        """``n`` trajectories per prompt, prompt-major (as ``engine.generate`` orders samples)."""
        self.spec.prepare(len(prompts) * n)
        self.tool_wait_s = 0.0
        episodes = [self.spec.open(p.row) for p in prompts for _ in range(n)]
        engine.start_session()  # the hf engine keeps each sample's keys and values for its next turn
        try:
            trajs = [self._start(prompts[i // n], ep, i // n) for i, ep in enumerate(episodes)]
            self._first_turn(engine, trajs, n, sampling)
            active = [i for i in range(len(trajs)) if self._read_turn(trajs[i], episodes[i])]
            turn = 1
            while active:
                if turn == self.settings.max_turns:  # it would go on: ends on its last sampled turn
                    for i in active:
                        trajs[i].finish_reason = "max_turns"
                    break
                active = self._append_results(trajs, episodes, active)
                if not active:
                    break
                self._next_turn(engine, [trajs[i] for i in active], sampling, turn)
                turn += 1
                active = [i for i in active if self._read_turn(trajs[i], episodes[i])]
            for t, ep in zip(trajs, episodes):
                t.rewards.update(_episode_reward(ep))
            return trajs
        finally:
            engine.end_session()
            for ep in episodes:
                ep.close()

    # ------------------------------------------------------------------ turns

    def _start(self, prompt: AgentPrompt, episode, index: int) -> Trajectory:
        messages, ids = prompt.messages, prompt.token_ids
        if episode.prompt_suffix:
            messages = _with_suffix(messages, episode.prompt_suffix)
            ids = render_ids(self.tokenizer, messages, self.spec.schemas)
        traj = Trajectory(prompt_ids=list(ids), prompt_index=index, messages=[dict(m) for m in messages])
        episode.messages = traj.messages  # the same list: a verl tool's agent_data.messages sees each turn
        return traj

    def _first_turn(self, engine, trajs: list[Trajectory], n: int, sampling) -> None:
        budget = self.settings.max_response_len
        shared = all(trajs[i].prompt_ids == trajs[i - i % n].prompt_ids for i in range(len(trajs)))
        if shared:  # the n samples of a prompt share its prefill
            samples = engine.generate([t.prompt_ids for t in trajs[::n]], n, replace(sampling, max_tokens=budget))
        else:
            samples = engine.continue_generation([t.prompt_ids for t in trajs], sampling, [budget] * len(trajs))
        for t, s in zip(trajs, samples, strict=True):
            t.add_sampled(s.token_ids, s.logprobs)
            t.finish_reason = s.finish_reason

    def _next_turn(self, engine, trajs: list[Trajectory], sampling, turn: int) -> None:
        seed = None if sampling.seed is None else sampling.seed + turn * SEED_STRIDE
        budgets = [self.settings.max_response_len - len(t.token_ids) for t in trajs]
        samples = engine.continue_generation([t.history for t in trajs], replace(sampling, seed=seed), budgets)
        for t, s in zip(trajs, samples, strict=True):
            t.add_sampled(s.token_ids, s.logprobs)
            t.finish_reason = s.finish_reason

    def _read_turn(self, t: Trajectory, episode) -> bool:
        """Read the turn just sampled into the conversation; whether the trajectory goes on (``t.pending``:
        its tool calls, or the simulated user's reply)."""
        turn_ids = t.token_ids[len(t.token_ids) - self._last_turn_len(t) :]
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        calls, malformed = parse_tool_calls(text, self.settings.style, self.tokenizer)
        t.messages.append(assistant_message(content_before_calls(text, self.settings.style), calls))
        t.pending = None
        if t.finish_reason == "length":
            return False
        if malformed:
            t.malformed += malformed
            t.finish_reason = "malformed"
            return False
        if calls:
            t.pending = ToolTurn(tuple(calls))
            return True
        done, reply = episode.user_turn(t.messages)
        if done or reply is None:
            return False
        t.pending = UserTurn(reply)
        return True

    @staticmethod
    def _last_turn_len(t: Trajectory) -> int:
        end = len(t.mask)
        start = end
        while start > 0 and t.mask[start - 1] == 1:
            start -= 1
        return end - start

    def _append_results(self, trajs: list[Trajectory], episodes: list, active: list[int]) -> list[int]:
        """Run every pending tool call of the batch (in parallel), append the tool or user messages as
        tokens; the trajectories that go on."""
        pending = [(episodes[i], c) for i in active if isinstance(p := trajs[i].pending, ToolTurn) for c in p.calls]
        began = time.perf_counter()
        outcomes = iter(
            self.run_calls(pending, timeout_s=self.settings.tool_timeout_s, max_chars=self.settings.tool_max_chars)
            if pending
            else []
        )
        self.tool_wait_s += time.perf_counter() - began
        return [i for i in active if self._append(trajs[i], outcomes)]

    def _append(self, t: Trajectory, outcomes) -> bool:
        """Append ``t``'s pending tool results (the next of ``outcomes``, in call order) or user reply as
        tokens; whether it goes on (False: no room left under max_response_len, then nothing is appended)."""
        if isinstance(t.pending, ToolTurn):
            appended = []
            for call in t.pending.calls:
                o = next(outcomes)
                t.tool_calls += 1
                t.tool_errors += o.status in ("error", "unknown_tool")
                t.tool_timeouts += o.status == "timeout"
                if o.reward:
                    t.rewards["tool"] = t.rewards.get("tool", 0.0) + float(o.reward)
                appended.append({"role": "tool", "name": call.name, "tool_call_id": call.id, "content": o.content})
        else:
            assert isinstance(t.pending, UserTurn)
            appended = [{"role": "user", "content": t.pending.reply}]
        delta = render_delta(self.tokenizer, t.messages[-1], appended, tools=self.spec.schemas, stop_ids=self.stop_ids)
        t.pending = None
        if len(t.token_ids) + len(delta) >= self.settings.max_response_len:  # no room left to answer
            t.finish_reason, t.dropped = "length", appended  # never read by the policy: not in messages
            return False
        t.messages += appended
        t.add_context(delta)
        return True


class TurnByTurn:
    """One trajectory of ``loop`` driven turn by turn from outside: the streaming pool's episode
    (:class:`rlctl.rollout.streaming.Episode`), which samples each turn itself, in chunks, beside the other
    trajectories, and calls :meth:`after_turn` in a worker thread when a turn ends (its tool calls then run
    while the others generate). The turns are read, the calls run and the results rendered exactly as
    :meth:`AgentLoop.run` does; :meth:`finish` gives the :class:`Trajectory` the trainer scores."""

    def __init__(self, loop: AgentLoop, prompt: AgentPrompt, episode, index: int):
        self.loop, self.episode = loop, episode
        self.traj = loop._start(prompt, episode, index)
        self.prompt_ids = self.traj.prompt_ids  # an environment's reset may have appended to the prompt

    def after_turn(self, turn_ids: list[int]) -> list[int] | None:
        """The tokens to append after the turn just sampled (tool results or the user's reply, and the next
        generation prompt), or None when the trajectory ends."""
        t, s = self.traj, self.loop.settings
        t.add_sampled(turn_ids, [0.0] * len(turn_ids))  # the pool keeps the log-probs (finish)
        t.finish_reason = "stop"
        if not self.loop._read_turn(t, self.episode):
            return None
        if t.turns >= s.max_turns:  # it would go on: ends on its last sampled turn
            t.finish_reason = "max_turns"
            return None
        outcomes = []
        if isinstance(t.pending, ToolTurn):
            calls = [(self.episode, c) for c in t.pending.calls]
            outcomes = self.loop.run_calls(calls, timeout_s=s.tool_timeout_s, max_chars=s.tool_max_chars)
        before = len(t.token_ids)
        if not self.loop._append(t, iter(outcomes)):
            return None
        return t.token_ids[before:]

    def reward(self) -> float:
        return 0.0  # the trainers score the trajectory (finish: the environment's components)

    def finish(self, token_ids: list[int], mask: list[int], logprobs: list[float], truncated: bool) -> Trajectory:
        """The trajectory as the pool sampled it (``truncated``: it ran out of tokens inside a turn), with
        the environment's reward components; the episode is closed."""
        t = self.traj
        if truncated and len(token_ids) > len(t.token_ids):  # the last turn, cut by max_response_len
            t.add_sampled(token_ids[len(t.token_ids) :], [0.0] * (len(token_ids) - len(t.token_ids)))
            t.finish_reason = "length"
            self.loop._read_turn(t, self.episode)
        if t.token_ids != token_ids or t.mask != mask:
            raise RuntimeError("streaming agent: the pool's tokens differ from the trajectory's")
        t.logprobs = [float(x) for x in logprobs]
        try:
            t.rewards.update(_episode_reward(self.episode))
        finally:
            self.episode.close()
        return t


def _episode_reward(episode) -> dict[str, float]:
    """The environment's named reward components; a raising get_reward scores nan (counted as non-finite)."""
    try:
        return {str(k): float(v) for k, v in (episode.reward() or {}).items()}
    except Exception:  # noqa: BLE001 (a user's environment)
        return {"env": float("nan")}
