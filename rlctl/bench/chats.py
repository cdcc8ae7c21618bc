"""SFT chats whose lengths spread like real data, shared by benchmarks/sft_vs_trl.py and `rlctl bench
compare --work sft --lengths spread`, so that both measure on the same distribution."""

from __future__ import annotations

import math
import random

WORDS = tuple(
    "the model learns to answer questions about numbers words and tokens with short and "
    "long replies while the trainer packs sequences into batches on a small processor".split()
)


def make_chats(n: int, max_len: int, tokenizer, seed: int = 0) -> list[dict]:
    """``n`` chats whose rendered length (chat template included) is log-uniform between 32 and
    ``max_len`` tokens, like real SFT data: many short replies, a few long ones."""
    rng = random.Random(seed)
    chats = []
    while len(chats) < n:
        user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16)))
        target = int(2 ** rng.uniform(5, math.log2(max_len)))
        words = tokenizer(" ".join(rng.choice(WORDS) for _ in range(max_len)), add_special_tokens=False)["input_ids"]
        prompt_len = len(render_ids(tokenizer, [{"role": "user", "content": user}], add_generation_prompt=True))
        reply = tokenizer.decode(words[: max(2, target - prompt_len - 2)]).strip()
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        if len(render_ids(tokenizer, messages)) <= max_len:
            chats.append({"messages": messages})
    return chats


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template (as rlctl.data.sft tokenizes them)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
