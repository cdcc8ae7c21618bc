"""Tiny models and tokenizers built offline, for tests, benchmarks, the demo and the examples; and a
vision-language model's greedy answer about a picture through plain transformers (:func:`vl_greedy_answer`).

Nothing here downloads anything: the tokenizer is trained in a second with the `tokenizers`
library and the model is a Qwen2 architecture with random weights (head_dim 64, because vLLM's
CPU attention rejects smaller heads).
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A ChatML template like Qwen's, so chat formatting in tests looks like the real thing.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A Hermes/Qwen-style template that takes tools (as Qwen2.5's does): the schemas in the system turn, calls as
# <tool_call>{json}</tool_call> re-serialized from the parsed message, consecutive tool results in one user turn.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% elif message['role'] == 'user' or (message['role'] == 'assistant' and not message.get('tool_calls')) %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n{{ message['content'] }}"
    "{% for tc in message['tool_calls'] %}{% if message['content'] or not loop.first %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ tc[\'function\'][\'name\'] }}", "arguments": '
    "{{ tc['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


TOOL_CORPUS = [  # tool schemas, calls and results, so the tiny tokenizer spends few tokens on them
    '<tools>\n{"type": "function", "function": {"name": "add", "description": "Add two integers.", '
    '"parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first integer."}, '
    '"b": {"type": "integer", "description": "The second integer."}}, "required": ["a", "b"]}, '
    '"return": {"type": "integer"}}}\n</tools>',
    '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
    '<tool_call>{"name":"add","arguments":{"a":3,"b":4}}</tool_call>',
    "<tool_response>\n7\n</tool_response>",
]


def default_corpus() -> list[str]:
    """Text that covers digits, arithmetic and chat words, so the tiny tokenizer is usable."""
    lines = []
    for a in range(0, 100, 3):
        for b in range(0, 100, 7):
            lines.append(f"What is {a} + {b}? The answer is {a + b}. #### {a + b}")
            lines.append(f"Compute {a} * {b} = {a * b}; {a} - {b} = {a - b}")
    lines += [
        "user assistant system You are a helpful assistant.",
        "Question: Answer: think step by step. The quick brown fox jumps over the lazy dog.",
    ]
    return lines


def build_tokenizer(out_dir: str | Path | None = None, *, vocab_size: int = 512, corpus=None):
    """Train a small byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or default_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


# the sizes of the tiny text model (Qwen2, and the text model of the tiny Qwen-VL)
TINY_TEXT_SIZES = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
)


def tiny_qwen2_config(vocab_size: int = 512, **overrides):
    """A Qwen2 config small enough for CPU tests: GQA (2 heads, 1 kv head), head_dim 64."""
    from transformers import Qwen2Config

    kwargs = dict(
        vocab_size=vocab_size,
        **TINY_TEXT_SIZES,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        dtype="float32",
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def build_tiny_model(
    out_dir: str | Path, *, seed: int = 0, vocab_size: int = 512, tools: bool = False, **config_overrides
):
    """Write a tiny random Qwen2 model with its tokenizer and generation config to ``out_dir``.

    Returns the directory as a Path. The tokenizer's eos is ``<|im_end|>``. ``tools``: the tokenizer also
    learns tool-call text and its chat template takes tools (:data:`TOOL_CHAT_TEMPLATE`).
    """
    out = Path(out_dir)
    if tools:
        tok = build_tokenizer(vocab_size=vocab_size, corpus=default_corpus() + TOOL_CORPUS * 50)
        tok.chat_template = TOOL_CHAT_TEMPLATE
    else:
        tok = build_tokenizer(vocab_size=vocab_size)
    save_tiny_model(out, tok, seed=seed, **config_overrides)
    return out


def save_tiny_model(out_dir: str | Path, tok, *, seed: int = 0, **config_overrides):
    """Write ``tok`` and a random Qwen2 for it (:func:`tiny_qwen2_config` with ``config_overrides``, eos and
    pad from ``tok``, weights drawn after ``torch.manual_seed(seed)``) to ``out_dir``; returns the model."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    config = tiny_qwen2_config(vocab_size=len(tok), **config_overrides)
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(str(out), safe_serialization=True)
    return model


# ---------------------------------------------------------------------------------------------
# A tiny vision-language model (Qwen2-VL architecture)

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen2-VL's ChatML template, reduced: content is a string or a list of parts ({"type": "image"} / {"type":
# "text", "text": ...}); an image part renders as <|vision_start|><|image_pad|><|vision_end|>, as in Qwen's.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

VL_CORPUS = [  # picture words, so the tiny tokenizer spends few tokens on questions and answers about colours
    "Which colour is it? It is red. It is blue. It is green.",
    "Which colour fills more of the image? Answer with one word: red, blue or green.",
]

TINY_VL_PIXELS = (28 * 28 * 4, 28 * 28 * 16)  # the image processor's min and max pixels: 4 to 16 image tokens


def tiny_qwen2_vl_config(tokenizer, arch: str = "qwen2_vl", **overrides):
    """A Qwen2-VL (or, ``arch="qwen2_5_vl"``, Qwen2.5-VL) config small enough for CPU tests: the text model of
    :func:`tiny_qwen2_config` (head_dim 64, multimodal rope sections 8+12+12 = head_dim / 2) and a 2-block
    vision tower (patch 14, merge 2; Qwen2.5-VL's: window attention in block 0, full in block 1)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(
        vocab_size=len(tokenizer),
        **TINY_TEXT_SIZES,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    text.update(overrides.pop("text", {}))
    vision = dict(depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14)
    if arch == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, out_hidden_size=128, num_heads=2)
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[1])
    vision.update(overrides.pop("vision", {}))
    return {"qwen2_vl": Qwen2VLConfig, "qwen2_5_vl": Qwen2_5_VLConfig}[arch](
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        **overrides,
    )


def build_tiny_vl_model(
    out_dir: str | Path, *, seed: int = 0, vocab_size: int = 512, arch: str = "qwen2_vl", **config_overrides
) -> Path:
    """Write a tiny random Qwen2-VL (``arch="qwen2_5_vl"``: Qwen2.5-VL) (weights, config, generation config) with
    its tokenizer (the vision tokens
    added, :data:`VL_CHAT_TEMPLATE`) and its image processor (``preprocessor_config.json``, as Qwen's hub
    repos have it) to ``out_dir``; :func:`rlctl.data.vision.load_processor` loads it back."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size=vocab_size, corpus=default_corpus() + VL_CORPUS * 20)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = VL_CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    # the PIL backend needs no torchvision; it saves as "Qwen2VLImageProcessor" (either backend loads it)
    size = {"shortest_edge": TINY_VL_PIXELS[0], "longest_edge": TINY_VL_PIXELS[1]}
    Qwen2VLImageProcessorPil(size=size).save_pretrained(str(out))
    config = tiny_qwen2_vl_config(tok, arch, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def vl_greedy_answer(model, tok, processor, png: bytes, question: str, *, max_new_tokens: int):
    """A Hugging Face Qwen-VL model's greedy answer to ``question`` about one picture (PNG bytes), through plain
    transformers: the chat template, the image processor, one ``<|image_pad|>`` per merged patch, ``generate``.
    Returns (answer, prompt ids ``[1, L]``, the processor's output)."""
    import io

    import torch
    from PIL import Image

    pixels = processor(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")
    n = int(pixels["image_grid_thw"].prod()) // processor.merge_size**2
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * n), add_special_tokens=False, return_tensors="pt")
    ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True), ids, pixels
