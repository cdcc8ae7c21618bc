"""Vision-language RL batches for the tests: prompts with images (as rlctl.data.rl builds them), rollout
batches of their samples, and the plain transformers reference of a sample's log-probs."""

from __future__ import annotations

import io
import random

import torch

from tests.support.rl import sampled_batch
from tests.support.vision import png_bytes


def vl_prompt(vp, colour: str, size: tuple[int, int], question: str):
    """(token ids, (pixel_values, image_grid_thw)) of a one-image user turn, as rlctl.data.rl builds them."""
    from PIL import Image

    image = Image.open(io.BytesIO(png_bytes(colour, size, second="blue"))).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = vp.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pixels = vp.process([image])
    ids = vp.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, _ = vp.expand(ids, pixels[1])
    return ids, pixels


def reference_logprobs(model, ids: list[int], response: list[int], pixels, temperature: float = 1.0):
    """log_softmax(logits / temperature) at each response token of one unpadded forward over prompt + response
    (with its image, if any), positioned by the model's own get_rope_index over the whole sequence."""
    full = torch.tensor([ids + response])
    kwargs = {}
    if pixels is not None:
        grid = torch.as_tensor(pixels[1])
        types = (full == model.config.image_token_id).int()
        rope, _ = model.model.get_rope_index(full, mm_token_type_ids=types, image_grid_thw=grid)
        kwargs = {"pixel_values": torch.as_tensor(pixels[0]), "image_grid_thw": grid, "position_ids": rope}
    logits = model(input_ids=full, **kwargs).logits[0, len(ids) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def vl_group_batch(vp, n_prompts: int, n: int, *, width: int, seed: int):
    """A RolloutBatch of ``n_prompts`` prompts with images (two of them with the same tokens, different
    pictures), ``n`` random responses of different lengths each; ``meta`` carries each prompt's images."""
    from rlctl.data.rl import Prompt

    colours, sizes = ["red", "green", "blue"], [(56, 56), (56, 56), (112, 56)]
    prompts = []
    for i in range(n_prompts):
        ids, (pv, grid) = vl_prompt(vp, colours[i % 3], sizes[i % 3], "Which colour?")
        prompts.append(Prompt(ids, "t", "red", None, pixel_values=pv, image_grid_thw=grid))
    vocab = len(vp.tokenizer) - 8  # below the vision tokens
    token_ids = [p.token_ids for p in prompts]
    return sampled_batch(token_ids, n, width=width, vocab=vocab, rng=random.Random(seed), seed=seed, meta=prompts)
