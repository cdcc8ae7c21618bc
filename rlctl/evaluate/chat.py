"""`rlctl chat`: a conversation with a model, its history rendered by the model's own chat template.

Each turn renders the whole history (the system prompt first, when given) with the generation prompt,
exactly as training renders a prompt (:func:`rlctl.data.rl.render_prompt`), samples one reply on a
rollout engine and keeps it in the history; :meth:`ChatSession.reset` forgets the history.

With ``tools`` (what ``--tools`` takes in training) a turn is one trajectory of training's agent loop
(:mod:`rlctl.recipes.rl.turns`): the model may call tools, their results are appended, and it goes on
until it answers without a call (or ``max_turns``); every message of the turn joins the history.
"""

from __future__ import annotations

from pathlib import Path

from rlctl.errors import UserError


class ChatSession:
    """A chat with the HF model in ``model_dir`` on ``engine`` ("hf" or "vllm")."""

    def __init__(self, model_dir: Path, *, engine: str = "hf", device: str = "cpu", dtype: str = "float32",
                 temperature: float = 0.0, top_p: float = 1.0, max_new_tokens: int = 512, max_model_len: int = 4096,
                 system: str = "", seed: int = 0, tools=None):  # fmt: skip
        from transformers import AutoTokenizer

        from rlctl.rollout import RolloutSpec, SamplingParams

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if not self.tokenizer.chat_template:
            raise UserError(f"{model_dir}: the tokenizer has no chat template; chat needs a model with one")
        self.system = system
        self.sampling = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed)
        self.max_model_len = max_model_len
        spec = RolloutSpec(engine=engine, model_path=str(model_dir), device=device, dtype=dtype,
                           max_model_len=max_model_len, seed=seed)  # fmt: skip
        from rlctl.evaluate.run import make_engine

        self.engine = make_engine(spec)
        self.history: list[dict] = []
        self.last_turn: list[dict] = []  # the messages of the last reply (with tools: calls and results too)
        self.agent, self.loop = None, None
        if tools is not None:  # (cfg, spec) of rlctl.evaluate.settings.chat_tools
            from rlctl.recipes.rl.turns import make_agent_loop

            cfg, self.agent = tools
            self.loop = make_agent_loop(cfg, self.agent, self.tokenizer, self.engine, 1)

    def reply(self, text: str) -> str:
        """The model's answer to ``text`` after the history so far; both join the history."""
        from rlctl.data.rl import render_prompt
        from rlctl.data.sft import BadRow

        messages = [*self.history, {"role": "user", "content": text}]
        if self.loop is not None:
            return self._agent_reply(messages)
        try:
            ids = render_prompt(messages, self.tokenizer, "chat", self.system)
        except BadRow as e:
            raise UserError(f"cannot render the conversation: {e}") from None
        if len(ids) >= self.max_model_len:
            raise UserError(
                f"the conversation is {len(ids)} tokens, over --max-model-len {self.max_model_len}; /reset it"
            )
        (sample,) = self.engine.generate([ids], 1, self.sampling)
        answer = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        self.last_turn = [{"role": "assistant", "content": answer}]
        self.history = [*messages, *self.last_turn]
        return answer

    def _agent_reply(self, messages: list[dict]) -> str:
        """One agent-loop trajectory after ``messages``: its messages join the history; the reply is its last
        assistant message (the tool calls and results before it are in :attr:`last_turn`)."""
        from rlctl.agents.loop import AgentPrompt, render_ids
        from rlctl.data.rl import prompt_messages

        full = prompt_messages(messages, "chat", self.system)
        ids = render_ids(self.tokenizer, full, self.agent.schemas)
        if len(ids) >= self.max_model_len:
            raise UserError(f"the conversation is {len(ids)} tokens, over --max-model-len {self.max_model_len}; /reset")
        (traj,) = self.loop.run(self.engine, [AgentPrompt(ids, full, {})], 1, self.sampling)
        self.last_turn = traj.messages[len(full) :]
        self.history = [*messages, *self.last_turn]
        replies = [m for m in self.last_turn if m.get("role") == "assistant"]
        return str(replies[-1].get("content") or "") if replies else ""

    def reset(self) -> None:
        self.history = []

    def close(self) -> None:
        self.engine.close()
