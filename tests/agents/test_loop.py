"""The multi-turn loop on a real hf rollout engine and a tiny model trained to call a tool: the trained tokens
are exactly the sampled ones plus the template's tool turns (no re-tokenization), the loss mask covers exactly
the sampled tokens, and the trainer's log-probs of the sampled tokens equal the engine's."""

from __future__ import annotations

import pytest
import torch

from tests.agents.conftest import ADD_SCHEMA, trace_messages


class AddEpisode:
    """Test-only stand-in for an rlctl.agents.tools Episode: one ``add`` tool, an optional simulated user."""

    schemas = [ADD_SCHEMA]
    prompt_suffix = None

    def __init__(self, replies: list[str] | None = None):
        self.replies = list(replies or [])
        self.closed = False
        self.calls = 0

    def call(self, call):
        from rlctl.agents.tools import ToolOutcome

        self.calls += 1
        if call.name != "add":
            return ToolOutcome(f"unknown tool {call.name}", "unknown_tool")
        return ToolOutcome(str(call.arguments["a"] + call.arguments["b"]), "ok")

    def user_turn(self, messages):
        return (False, self.replies.pop(0)) if self.replies else (False, None)

    def reward(self):
        return {"env": float(self.calls)}

    def close(self):
        self.closed = True


class AddSpec:
    schemas = [ADD_SCHEMA]

    def __init__(self, replies=None):
        self.replies, self.episodes = replies, []

    def prepare(self, trajectories):
        pass

    def open(self, row):
        self.episodes.append(AddEpisode(self.replies))
        return self.episodes[-1]


def serial_calls(pending, *, timeout_s, max_chars):
    return [episode.call(call) for episode, call in pending]


class Recording:
    """The engine, recording what it was given and what it sampled."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, n, sampling):
        out = self.engine.generate(prompts, n, sampling)
        self.calls.append(("generate", [p for p in prompts for _ in range(n)], out))
        return out

    def start_session(self):
        self.engine.start_session()

    def end_session(self):
        self.engine.end_session()

    def continue_generation(self, histories, sampling, max_tokens):
        out = self.engine.continue_generation(histories, sampling, max_tokens)
        self.calls.append(("continue", histories, out))
        return out


def test_the_tools_file_gives_the_schema_the_model_was_trained_with(tmp_path):
    from rlctl.agents.tools import load_agent_spec
    from tests.agents.conftest import TOOLS_FILE

    (tmp_path / "tools.py").write_text(TOOLS_FILE)
    assert load_agent_spec(tools=str(tmp_path / "tools.py")).schemas == [ADD_SCHEMA]


@pytest.fixture(scope="module")
def engine(agent_model_dir):
    from rlctl.rollout import RolloutSpec, make_rollout_engine

    spec = RolloutSpec(engine="hf", model_path=str(agent_model_dir), device="cpu", dtype="fp32", max_model_len=256)
    with make_rollout_engine(spec) as e:
        yield e


@pytest.fixture(scope="module")
def tokenizer(agent_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(agent_model_dir))


def _loop(tokenizer, spec, *, max_turns=4, max_response_len=120):
    from rlctl.agents.loop import AgentLoop, LoopSettings

    settings = LoopSettings(max_turns, max_response_len, tool_timeout_s=5.0, tool_max_chars=100, style="hermes")
    return AgentLoop(spec, tokenizer, settings, {tokenizer.eos_token_id}, run_calls=serial_calls)


def _prompt(tokenizer):
    from rlctl.agents.loop import AgentPrompt, render_ids

    messages = trace_messages()[:1]
    return AgentPrompt(render_ids(tokenizer, messages, [ADD_SCHEMA]), messages, {"prompt": messages})


def _text_delta(tokenizer, assistant: dict, appended: list[dict]) -> list[int]:
    """Independently of render_delta: the template's text after the assistant's <|im_end|>, tokenized."""
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, assistant, *appended],
        tools=[ADD_SCHEMA],
        tokenize=False,
        add_generation_prompt=True,
    )
    call_end = full.index("<|im_end|>", full.index("<|im_start|>assistant")) + len("<|im_end|>")
    return tokenizer(full[call_end:], add_special_tokens=False)["input_ids"]


def test_trajectory_tokens_are_the_sampled_tokens_and_the_template_tool_turns(engine, tokenizer):
    from rlctl.rollout import SamplingParams

    spec, rec = AddSpec(), Recording(engine)
    trajs = _loop(tokenizer, spec).run(rec, [_prompt(tokenizer)], 6, SamplingParams(max_tokens=120, seed=3))
    assert all(ep.closed for ep in spec.episodes)
    # the engine's samples, per trajectory, in order: what each was given (token ids in) and what it returned
    given = {i: [] for i in range(6)}
    turn_of: list[list] = [[] for _ in range(6)]
    going = list(range(6))
    for _kind, inputs, out in rec.calls:
        for i, history, s in zip(going, inputs, out, strict=True):
            given[i].append(history)
            turn_of[i].append(s.token_ids)
        going = [i for i in going if trajs[i].turns > len(turn_of[i])]
    used_tool = 0
    for i, t in enumerate(trajs):
        # every continuation was given exactly the trajectory so far: prompt + response tokens
        expected, segments = [], []
        for k, sampled in enumerate(turn_of[i]):
            assert given[i][k] == t.prompt_ids + expected
            expected += sampled
            segments.append((1, len(sampled)))
            if k + 1 < len(turn_of[i]):  # a tool turn followed
                assistant = t.messages[1 + 2 * k]
                tool = t.messages[2 + 2 * k]
                delta = _text_delta(tokenizer, assistant, [tool])
                expected += delta
                segments.append((0, len(delta)))
        assert t.token_ids == expected
        assert t.mask == [m for m, n in segments for _ in range(n)]
        assert len(t.logprobs) == len(t.token_ids) and all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask) if not m)
        used_tool += t.tool_calls > 0
        if t.tool_calls:
            assert t.messages[2] == {"role": "tool", "name": "add", "tool_call_id": "call_0", "content": "7"}
            assert t.tool_call_list()[0] == {"name": "add", "arguments": {"a": 3, "b": 4}}
            # re-rendering the conversation would give other tokens (the template re-serializes the call)
            rerendered = tokenizer(
                tokenizer.apply_chat_template(t.messages, tools=[ADD_SCHEMA], tokenize=False),
                add_special_tokens=False,
            )["input_ids"]
            assert rerendered[: len(t.prompt_ids) + len(t.token_ids)] != t.prompt_ids + t.token_ids
        assert t.rewards == {"env": float(t.tool_calls)}
    assert used_tool >= 3  # the trained model calls its tool (the test exercises the tool path)


def test_hand_built_three_turn_trajectory_masks_exactly_the_sampled_tokens():
    """Turns: 4 sampled, 3 tool, 2 sampled, 2 user, 3 sampled: the batch's loss mask, the reward's token, GRPO's
    and GAE's advantages (against a plain loop over the sampled tokens alone) and the policy loss's gradient."""
    from rlctl.agents.trajectory import Trajectory
    from rlctl.algos import masked_whiten
    from rlctl.config import build_config
    from rlctl.recipes.rl.advantages import compute_advantages, token_rewards
    from rlctl.recipes.rl.batch import RolloutBatch
    from rlctl.recipes.rl.spec import AlgoSpec

    def traj(seed):
        g = torch.Generator().manual_seed(seed)
        t = Trajectory(prompt_ids=[5, 6, 7])
        for kind, n in ((1, 4), (0, 3), (1, 2), (0, 2), (1, 3)):
            ids = torch.randint(10, 100, (n,), generator=g).tolist()
            t.add_sampled(ids, [-0.5] * n) if kind else t.add_context(ids)
        return t

    trajs = [traj(0), traj(1)]
    width = 16
    batch = RolloutBatch.build(
        [t.prompt_ids for t in trajs],
        [t.token_ids for t in trajs],
        [t.logprobs for t in trajs],
        [0, 1],
        n=2,
        batch_size=1,
        mini_batch_size=0,
        width=width,
        loss_masks=[t.mask for t in trajs],
        trajectories=trajs,
    )
    sampled_cols = [0, 1, 2, 3, 7, 8, 11, 12, 13]  # by hand: 4 sampled, 3 tool, 2 sampled, 2 user, 3 sampled
    want = torch.zeros(2, width)
    want[:, sampled_cols] = 1
    assert torch.equal(batch.mask, want)
    assert batch.rollout_logp[0, 4].item() == 0.0 and batch.rollout_logp[0, 13].item() == -0.5
    batch.scores = torch.tensor([1.0, 0.0])
    rewards = token_rewards(batch)
    assert rewards[:, 13].tolist() == [1.0, 0.0] and rewards.sum().item() == 1.0  # on the last sampled token

    grpo = build_config("grpo", [{"algo": {"adv": "grpo"}}])
    adv, _ = compute_advantages(batch, AlgoSpec.from_config(grpo), rewards)
    assert torch.equal(adv != 0, batch.mask.bool())

    gae_cfg = build_config("ppo", [{"algo": {"adv": "gae", "gamma": 0.9, "lam": 0.8}}])
    batch.values = torch.randn(2, width, generator=torch.Generator().manual_seed(7))
    adv, returns = compute_advantages(batch, AlgoSpec.from_config(gae_cfg), rewards)
    raw = torch.zeros(2, width)
    for b in range(2):  # plain GAE over the sampled tokens only, in order
        nxt_v = nxt_a = 0.0
        for c in reversed(sampled_cols):
            delta = rewards[b, c].item() + 0.9 * nxt_v - batch.values[b, c].item()
            nxt_a = delta + 0.9 * 0.8 * nxt_a
            raw[b, c], nxt_v = nxt_a, batch.values[b, c].item()
        assert torch.allclose(returns[b, sampled_cols], raw[b, sampled_cols] + batch.values[b, sampled_cols])
    assert torch.allclose(adv, masked_whiten(raw, batch.mask.bool()) * batch.mask, atol=1e-6)
    assert returns[:, [4, 5, 6, 9, 10, 14, 15]].abs().sum() == 0


def test_trainer_log_probs_equal_the_rollout_engines_on_multi_turn_trajectories(
    engine, tokenizer, agent_model_dir, process_group
):
    """fp32 on CPU: the FSDP engine's log-probs of the sampled tokens (shared-prefix packing of the group, and
    one sequence at a time) equal the hf rollout engine's within 1e-5; the context tokens are masked out."""
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.recipes.rl.batch import RolloutBatch
    from rlctl.recipes.rl.passes import compute_logprobs
    from rlctl.rollout import SamplingParams
    from tests.support.sft import cpu_spec

    trajs = _loop(tokenizer, AddSpec()).run(
        engine, [_prompt(tokenizer)], 4, SamplingParams(temperature=0.8, max_tokens=120, seed=5)
    )
    assert any(t.turns > 1 for t in trajs)
    batch = RolloutBatch.build(
        [t.prompt_ids for t in trajs],
        [t.token_ids for t in trajs],
        [t.logprobs for t in trajs],
        list(range(4)),
        n=4,
        batch_size=1,
        mini_batch_size=0,
        width=120,
        loss_masks=[t.mask for t in trajs],
    )
    cfg = build_config(
        "grpo", [dotted_to_nested({"model.name": str(agent_model_dir), "model.attn": "sdpa", "model.dtype": "fp32"})]
    )
    ref = FSDPEngine(cpu_spec(cfg), role="ref", trainable=False)
    for share in (True, False):
        logp, _ = compute_logprobs(ref, batch, temperature=0.8, budget=1024, pad_id=0, share_prefix=share)
        diff = ((logp - batch.rollout_logp).abs() * batch.mask).max().item()
        assert diff < 1e-5, (share, diff)
        assert batch.mask.sum() < sum(len(t.token_ids) for t in trajs)  # the tool tokens were there, masked


def test_budget_interaction_and_max_turns(engine, tokenizer):
    from rlctl.rollout import SamplingParams

    prompt = _prompt(tokenizer)
    sampling = SamplingParams(max_tokens=120, seed=3)
    # a budget that the tool turn does not fit in: the trajectory ends on its sampled call, truncated
    short = _loop(tokenizer, AddSpec(), max_response_len=30).run(engine, [prompt], 4, sampling)
    called = [t for t in short if t.tool_calls]
    assert called and all(t.truncated and t.turns == 1 and all(t.mask) for t in called)
    # one turn at most: a call ends it with finish_reason max_turns, nothing appended, no tool run
    spec = AddSpec()
    one = _loop(tokenizer, spec, max_turns=1).run(engine, [prompt], 4, sampling)
    assert {t.finish_reason for t in one} <= {"max_turns", "malformed", "stop", "length"}
    assert all(all(t.mask) and t.tool_calls == 0 for t in one) and not any(ep.calls for ep in spec.episodes)
    assert any(t.finish_reason == "max_turns" for t in one)
    # a simulated user answers the final answer once: its turn is context, the model answers again
    talk = _loop(tokenizer, AddSpec(replies=["Are you sure?"])).run(engine, [prompt], 4, sampling)
    assert any(m["role"] == "user" for t in talk for m in t.messages[1:])
    for t in talk:
        users = [m for m in t.messages[1:] if m["role"] == "user"]
        if users:
            assert users == [{"role": "user", "content": "Are you sure?"}]
            assert t.turns >= 2 and 0 in t.mask


def test_hf_continuation_starts_from_the_kept_keys_and_values(engine, tokenizer):
    """In a session the hf engine's next turn computes only the appended tokens (and the last sampled one),
    not the whole trajectory, and samples what a full prefill of the same token ids samples."""
    from dataclasses import replace

    from rlctl.rollout import SamplingParams

    prompt = _prompt(tokenizer).token_ids
    sampling = SamplingParams(max_tokens=40, seed=11)
    delta = _text_delta(
        tokenizer,
        {"role": "assistant", "content": "", "tool_calls": []},
        [{"role": "tool", "name": "add", "content": "7"}],
    )
    engine.start_session()
    try:
        first = engine.generate([prompt], 4, sampling)
        histories = [prompt + s.token_ids + delta for s in first]
        before = engine.prefilled_tokens
        kept = engine.continue_generation(histories, replace(sampling, seed=12), [30] * 4)
        computed = engine.prefilled_tokens - before
    finally:
        engine.end_session()
    full = engine.continue_generation(histories, replace(sampling, seed=12), [30] * 4)
    assert computed == 4 * (len(delta) + 1)  # per row: the last sampled token and the tool turn
    assert engine.prefilled_tokens - before - computed == 4 * max(len(h) for h in histories)
    for a, b in zip(kept, full, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_environment_prompt_suffix_goes_into_each_trajectorys_prompt(engine, tokenizer):
    """reset() text (TRL's convention) is appended to the last user message, per trajectory; prompts that
    differ within a group are generated one request each."""
    from rlctl.rollout import SamplingParams

    class SuffixSpec(AddSpec):
        def open(self, row):
            episode = super().open(row)
            episode.prompt_suffix = f" (try {len(self.episodes)})"
            return episode

    rec = Recording(engine)
    trajs = _loop(tokenizer, SuffixSpec(), max_turns=1).run(
        rec, [_prompt(tokenizer)], 2, SamplingParams(max_tokens=40, seed=1)
    )
    for i, t in enumerate(trajs):
        user = {"role": "user", "content": f"What is 3 + 4? (try {i + 1})"}
        text = tokenizer.apply_chat_template([user], tools=[ADD_SCHEMA], tokenize=False, add_generation_prompt=True)
        assert t.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert t.messages[0] == user
    assert rec.calls[0][0] == "continue" and rec.calls[0][1] == [t.prompt_ids for t in trajs]


def test_the_streaming_pool_runs_the_loop_turn_by_turn_as_the_loop_does(engine, tokenizer):
    """rlctl.agents.loop.TurnByTurn in the streaming pool (chunks of 5 tokens, tool calls in the pool's
    threads, several groups in flight): greedy, every trajectory is the one AgentLoop.run samples in
    lockstep: the same tokens, loss mask (0 on the tool turns), conversation, tool counts and environment
    rewards; the behaviour log-probs are the pool's, 0 on the tool tokens."""
    from rlctl.agents.loop import TurnByTurn
    from rlctl.algos.admission import Admission
    from rlctl.rollout import SamplingParams
    from rlctl.rollout.streaming import PoolSettings, StreamingPool

    greedy = SamplingParams(max_tokens=120, temperature=0.0, seed=3)
    want = _loop(tokenizer, AddSpec()).run(engine, [_prompt(tokenizer)], 2, greedy)
    spec, loop = AddSpec(), _loop(tokenizer, AddSpec())
    loop.spec = spec

    def prompts(k):
        return None if k >= 3 else (k, _prompt(tokenizer).token_ids, [
            TurnByTurn(loop, _prompt(tokenizer), spec.open({}), 0) for _ in range(2)])  # fmt: skip

    adm = Admission(batch=1, max_staleness=2)
    pool = StreamingPool(engine, adm, PoolSettings(2, 5, 120, 4, slots=8), greedy, prompts)
    done = []
    while len(done) < 3:
        if (batch := adm.next_batch()) is not None:
            adm.train(batch)
        done += pool.step()
    pool.close()
    got = [
        t.episode.finish(t.token_ids, t.mask, t.logprobs, t.finish_reason == "length")
        for g in done
        for t in g.trajectories
    ]
    assert all(ep.closed for ep in spec.episodes) and want[0].tool_calls == 1
    for t in got:
        w = want[0]
        assert (t.token_ids, t.mask, t.messages) == (w.token_ids, w.mask, w.messages)
        assert (t.turns, t.tool_calls, t.finish_reason) == (w.turns, w.tool_calls, w.finish_reason)
        assert t.rewards == w.rewards
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask) if not m)
        assert t.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_tool_wait_is_the_batchs_seconds_in_its_tool_calls(engine, tokenizer):
    """``tool_wait_s`` (logged as ``time/tools``, the cost model's tool share of a lockstep rollout): the
    seconds the batch spent in its tool calls, here each batch of calls sleeping 0.05 s, timed outside."""
    import time

    from rlctl.rollout import SamplingParams

    spent: list[float] = []

    def slow_calls(pending, **kw):
        began = time.perf_counter()
        time.sleep(0.05)
        out = serial_calls(pending, **kw)
        spent.append(time.perf_counter() - began)
        return out

    loop = _loop(tokenizer, AddSpec())
    loop.run_calls = slow_calls
    loop.run(Recording(engine), [_prompt(tokenizer)], 6, SamplingParams(max_tokens=120, seed=3))
    assert spent, "no tool was called: the test's model should call add"
    assert sum(spent) <= loop.tool_wait_s < sum(spent) + 0.01 * len(spent)
