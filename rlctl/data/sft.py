"""SFT examples: rows -> token ids with labels only on the assistant's tokens.

Two row formats (field names from ``cfg.data``):

* chat: ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}``;
  the loss covers every assistant turn. Tool traces in the OpenAI/HF format train the same way: assistant
  turns with ``tool_calls`` (``{"function": {"name", "arguments"}}``, arguments a JSON string or an object)
  are trained on, ``tool`` messages (the results) are context; a ``tools`` column (a list of function
  schemas, or its JSON text) goes to the chat template, which renders it into the prompt.
* pairs: ``{"prompt": ..., "response": ...}``; the prompt is a string (or a list of messages), the
  loss covers the response only.

The tokenizer's chat template renders the text. The assistant spans are found by rendering the
conversation prefix by prefix: the characters between ``render(messages[:i], add_generation_prompt)``
and ``render(messages[:i+1])`` are turn ``i``'s answer (the template's end-of-turn marker included,
so the model learns to stop). Tokens whose first character lies in such a span are trained on.

A row that cannot be used (missing fields, no assistant turn, too long for ``truncation=skip``...)
is a *bad row*: skipped and counted; the run fails only when more than ``data.max_bad_fraction``
of the rows are bad.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from rlctl.config import RunConfig, val_split
from rlctl.data.io import read_rows
from rlctl.data.vision import (
    IMAGE_MARK,
    BadImage,
    data_dir,
    has_images,
    is_image_part,
    replace_marks,
    row_image_values,
    row_pixels,
)
from rlctl.errors import UserError

IGNORE = -100  # label of a position without loss


class BadRow(Exception):
    """A row that is skipped; the message is the reason, counted in the data report."""


@dataclass
class Example:
    """One tokenized sequence. ``labels[j]`` is the target for position j (already shifted), or -100.

    A vision-language row also carries its processed images (:mod:`rlctl.data.vision`): ``pixel_values``
    ``[patches, D]`` and ``image_grid_thw`` ``[images, 3]``, in the order of its image tokens."""

    input_ids: np.ndarray  # int32 [L]
    labels: np.ndarray  # int32 [L]
    pixel_values: np.ndarray | None = None  # float32 [P, D]
    image_grid_thw: np.ndarray | None = None  # int64 [I, 3]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())


@dataclass
class DataReport:
    """How many rows were read and why some were skipped."""

    total: int = 0
    bad: Counter = field(default_factory=Counter)

    @property
    def num_bad(self) -> int:
        return sum(self.bad.values())

    @property
    def bad_fraction(self) -> float:
        return self.num_bad / self.total if self.total else 0.0

    def summary(self) -> str:
        if not self.num_bad:
            return f"{self.total} rows, none skipped"
        reasons = "; ".join(f"{n} {reason}" for reason, n in self.bad.most_common(4))
        return f"skipped {self.num_bad} of {self.total} rows ({100 * self.bad_fraction:.1f}%): {reasons}"

    def to_dict(self) -> dict:
        return {"total": self.total, "bad": self.num_bad, "reasons": dict(self.bad)}


@dataclass
class SFTData:
    train: list[Example]
    val: list[Example]
    report: DataReport
    val_report: DataReport | None = None


# ---------------------------------------------------------------------------------------------
# One row


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # noqa: BLE001 (jinja raises many types, e.g. "Conversation roles must alternate")
        raise BadRow(f"chat template failed ({str(e).splitlines()[0][:80]})") from None


def assistant_spans(
    tokenizer, messages: list[dict], *, last_only: bool = False, tools: list | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` (with ``tools``' schemas); return the text and the character spans of the
    assistant turns (tool calls included; tool results are other roles, never trained on)."""
    text = _render(tokenizer, messages, tools=tools)
    spans: list[tuple[int, int]] = []
    search_from = 0
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if last_only:
        turns = turns[-1:]
    for i in turns:
        end_text = _render(tokenizer, messages[: i + 1], tools=tools)
        start_text = _render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools) if i else ""
        if i and end_text.startswith(start_text) and text.startswith(end_text):
            span = (len(start_text), len(end_text))
        else:
            # The template rewrites earlier turns or cannot render a prefix: find this turn's text.
            piece = end_text[len(start_text) :] if i and end_text.startswith(start_text) else messages[i]["content"]
            at = text.find(piece, search_from)
            if at < 0 or not piece:
                continue
            span = (at, at + len(piece))
        spans.append(span)
        search_from = span[1]
    return text, spans


def _tokenize_with_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` and a 0/1 mask of the tokens that start inside a span."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(any(s <= start < e for s, e in spans)) for start, _ in enc["offset_mapping"]]
        return ids, mask
    # Slow tokenizers give no offsets: tokenize the pieces between span boundaries separately.
    ids, mask, pos = [], [], 0
    for s, e in spans + [(len(text), len(text))]:
        for piece, m in ((text[pos:s], 0), (text[s:e], 1)):
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids += piece_ids
                mask += [m] * len(piece_ids)
        pos = e
    return ids, mask


def checked_messages(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRow(f"'{where}' is not a non-empty list of messages")
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRow(f"a message in '{where}' has no role")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image"}, ...]
            texts = [IMAGE_MARK if is_image_part(p) else p.get("text") for p in content if isinstance(p, dict)]
            content = "".join(t for t in texts if isinstance(t, str)) if texts else None
        calls = m.get("tool_calls")
        if calls is not None and m["role"] == "assistant":
            m = {**m, "tool_calls": _checked_tool_calls(calls, where)}
            content = content if isinstance(content, str) else ""  # OpenAI: content null beside tool_calls
        elif "tool_calls" in m:
            m = {k: v for k, v in m.items() if k != "tool_calls"}  # null (a column other rows fill) or misplaced
        if not isinstance(content, str):
            raise BadRow(f"a message in '{where}' has no text content")
        out.append({**m, "content": content})
    return out


def _checked_tool_calls(calls, where: str) -> list[dict]:
    """OpenAI/HF tool calls, normalised to ``{"type": "function", "function": {"name", "arguments": dict}}``
    (chat templates expect the arguments as an object; OpenAI stores them as JSON text)."""
    import json

    if not isinstance(calls, list):
        raise BadRow(f"'tool_calls' of a message in '{where}' is not a list")
    out = []
    for call in calls:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRow(f"a tool call in '{where}' has no function name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise BadRow(f"a tool call's arguments in '{where}' are not JSON") from None
        if not isinstance(args, dict):
            raise BadRow(f"a tool call's arguments in '{where}' are not a JSON object")
        normal = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            normal["id"] = call["id"]
        out.append(normal)
    return out


def row_tools(row: dict) -> list[dict] | None:
    """The ``tools`` column of a chat row: function schemas (a list, or its JSON text), for the template."""
    import json

    tools = row.get("tools")
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise BadRow("'tools' is not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRow("'tools' is not a list of function schemas")
    return tools


def use_chat_template(tokenizer, cfg: RunConfig):
    """``tokenizer`` with ``data.chat_template`` (a Jinja file) as its chat template, when one is given;
    the recipes call it right after loading the tokenizer, so the data, the rollouts and the exported
    tokenizer all use it."""
    if cfg.data.chat_template:
        from pathlib import Path

        path = Path(cfg.data.chat_template).expanduser()
        if not path.is_file():
            raise UserError(f"chat template file not found: {path} (--chat-template takes a Jinja file)")
        tokenizer.chat_template = path.read_text()
    return tokenizer


def with_system(messages: list[dict], system: str) -> list[dict]:
    """``messages`` with a system message first (data.system_prompt) unless they hold one."""
    if not system or any(m.get("role") == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def row_tokens(row: dict, tokenizer, cfg: RunConfig) -> tuple[list[int], list[int]]:
    """Token ids and the 0/1 assistant mask of one row (before truncation)."""
    text, spans, plain = _row_text(row, tokenizer, cfg)
    return plain if plain is not None else _tokenize_with_spans(tokenizer, text, spans)


def row_vision_tokens(row: dict, vision, cfg: RunConfig, base_dir=None):
    """A vision-language model's row: (token ids, assistant mask, (pixel_values, image_grid_thw) or None).

    ``vision`` is the model's :class:`rlctl.data.vision.VisionProcessor`; each ``<image>`` of the text (an
    image content part or verl's placeholder) becomes the model's vision span, expanded to one image token
    per merged patch of that image."""
    text, spans, plain = _row_text(row, vision.tokenizer, cfg)
    if plain is not None:
        if row_image_values(row):
            raise BadRow("a row with images needs a chat template")
        return *plain, None
    messages = row.get(cfg.data.messages_field) or row.get(cfg.data.prompt_field)
    try:
        pixels = row_pixels(
            row, messages, vision, count=text.count(IMAGE_MARK), max_pixels=cfg.data.max_image_pixels, base_dir=base_dir
        )
    except BadImage as e:
        raise BadRow(str(e)) from None
    text, spans = replace_marks(text, spans, vision.placeholder)
    ids, mask = _tokenize_with_spans(vision.tokenizer, text, spans)
    if pixels is None:
        return ids, mask, None
    try:
        ids, mask = vision.expand(ids, pixels[1], mask)
    except BadImage as e:
        raise BadRow(str(e)) from None
    return ids, mask, pixels


def _row_text(row: dict, tokenizer, cfg: RunConfig):
    """(rendered text, assistant character spans, None), or (None, None, (ids, mask)) for a pairs row
    without a chat template (tokenized in two pieces)."""
    d = cfg.data
    fmt = d.format
    if fmt is None:
        fmt = "chat" if d.messages_field in row else "pairs" if d.prompt_field in row else ""
    if fmt == "chat":
        if d.messages_field not in row:
            raise BadRow(f"missing field '{d.messages_field}'")
        messages = with_system(checked_messages(row[d.messages_field], d.messages_field), d.system_prompt)
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRow("no assistant turn")
        tools = row_tools(row)
        if (tools or any(m.get("tool_calls") for m in messages)) and "tool" not in str(tokenizer.chat_template):
            raise BadRow("tool calls, but the chat template has no tool support (give one with --chat-template)")
        text, spans = assistant_spans(tokenizer, messages, tools=tools)
    elif fmt == "pairs":
        for name in (d.prompt_field, d.response_field):
            if not isinstance(row.get(name), (str, list)) or not row.get(name):
                raise BadRow(f"missing field '{name}'")
        response = row[d.response_field]
        if not isinstance(response, str):
            raise BadRow(f"'{d.response_field}' is not text")
        prompt = row[d.prompt_field]
        if tokenizer.chat_template:
            messages = (
                checked_messages(prompt, d.prompt_field)
                if isinstance(prompt, list)
                else [{"role": "user", "content": prompt}]
            )
            text, spans = assistant_spans(
                tokenizer,
                with_system(messages, d.system_prompt) + [{"role": "assistant", "content": response}],
                last_only=True,
            )
        else:
            if not isinstance(prompt, str):
                raise BadRow(f"'{d.prompt_field}' is a message list but the tokenizer has no chat template")
            p_ids = tokenizer(f"{d.system_prompt}\n\n{prompt}" if d.system_prompt else prompt)["input_ids"]
            r_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            return None, None, (p_ids + r_ids, [0] * len(p_ids) + [1] * len(r_ids))
    else:
        raise BadRow(f"no '{d.messages_field}' or '{d.prompt_field}'/'{d.response_field}' field")
    if not spans:
        raise BadRow("no assistant tokens")
    return text, spans, None


def make_example(ids: list[int], mask: list[int], *, max_len: int, truncation: str, pixels=None) -> Example:
    """Truncate (or reject) and shift the mask into labels: labels[j] = ids[j+1] where mask[j+1].
    ``pixels``: a vision row's (pixel_values, image_grid_thw); such a row is never truncated."""
    if len(ids) > max_len:
        if pixels is not None:
            raise BadRow(f"longer than max_len {max_len} with its image tokens (raise --max-len)")
        if truncation == "skip":
            raise BadRow(f"longer than max_len {max_len} (raise --max-len or set data.truncation=right)")
        sl = slice(None, max_len) if truncation == "right" else slice(len(ids) - max_len, None)
        ids, mask = ids[sl], mask[sl]
    ids_a = np.asarray(ids, dtype=np.int32)
    labels = np.full(len(ids_a), IGNORE, dtype=np.int32)
    m = np.asarray(mask[1:], dtype=bool)
    labels[:-1][m] = ids_a[1:][m]
    if not m.any():
        raise BadRow("no assistant tokens left after truncation")
    return Example(ids_a, labels, *(pixels if pixels is not None else (None, None)))


# ---------------------------------------------------------------------------------------------
# A whole file


def tokenize_rows(
    path: str, tokenizer, cfg: RunConfig, split: str = "train", *, cache_dir=None, log=lambda msg: None, vision=None
) -> tuple[list[Example], DataReport]:
    """Every row of a data source tokenized (through ``datasets.map``, cached in ``cache_dir`` and done
    once: :func:`rlctl.data.mapped.map_rows`), and the report of the rows skipped. ``vision``: a VL model's
    :class:`rlctl.data.vision.VisionProcessor`; its rows' images are processed once and cached with the tokens."""
    from dataclasses import asdict

    from rlctl.data.mapped import cache_key, map_rows, source_stamp, tokenizer_stamp

    rows = read_rows(path, split=split)
    report = DataReport(total=len(rows))
    for reason in rows.unreadable:
        report.bad[reason] += 1

    base_dir = data_dir(path)

    def tokenize(row: dict) -> dict:
        try:
            pixels = None
            if vision is not None:
                ids, mask, pixels = row_vision_tokens(row, vision, cfg, base_dir)
            elif has_images(row, row.get(cfg.data.messages_field) or row.get(cfg.data.prompt_field)):
                raise BadRow("images, but the model has no vision tower")
            else:
                ids, mask = row_tokens(row, tokenizer, cfg)
            ex = make_example(ids, mask, max_len=cfg.train.max_len, truncation=cfg.data.truncation, pixels=pixels)
            out = {"input_ids": ex.input_ids.tolist(), "labels": ex.labels.tolist(), "bad": ""}
        except BadRow as e:
            out, ex = {"input_ids": [], "labels": [], "bad": str(e)}, None
        return {**out, **pixel_columns(ex)} if vision is not None else out

    key = cache_key(
        kind="sft",
        source=source_stamp(path),
        split=split,
        data=asdict(cfg.data),
        max_len=cfg.train.max_len,
        tokenizer=tokenizer_stamp(tokenizer),
        **({"vision": vision.stamp()} if vision is not None else {}),
    )
    features = {"input_ids": "int32 list", "labels": "int32 list", "bad": "string"}
    if vision is not None:
        features.update(PIXEL_FEATURES)
    examples = []
    for out in map_rows(rows.rows, tokenize, cache_dir=cache_dir, key=key, desc="sft", features=features, log=log):
        if out["bad"]:
            report.bad[out["bad"]] += 1
        else:
            ids, labels = np.asarray(out["input_ids"], np.int32), np.asarray(out["labels"], np.int32)
            examples.append(Example(ids, labels, *pixels_from_columns(out)))
    return examples, report


PIXEL_FEATURES = {"pixel_values": "float32 list", "image_grid_thw": "int32 list"}


def pixel_columns(ex: Example | None) -> dict:
    """An example's images as two flat columns of the data cache (empty for a text row)."""
    if ex is None or ex.pixel_values is None:  # typed like a row with images: datasets concatenates the batches
        return {"pixel_values": np.zeros(0, np.float32), "image_grid_thw": []}
    return {"pixel_values": ex.pixel_values.reshape(-1), "image_grid_thw": ex.image_grid_thw.reshape(-1).tolist()}


def pixels_from_columns(out: dict) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(pixel_values [P, D], image_grid_thw [I, 3]) back from :func:`pixel_columns`' columns."""
    grid = np.asarray(out.get("image_grid_thw", []), np.int64).reshape(-1, 3)
    if not len(grid):
        return None, None
    flat = np.asarray(out["pixel_values"], np.float32)
    return flat.reshape(int(np.prod(grid, axis=1).sum()), -1), grid


def build_sft_data(cfg: RunConfig, tokenizer, *, cache_dir=None, log=lambda msg: None, vision=None) -> SFTData:
    """Tokenize the training data (and the validation data or a held-out share of it).

    Deterministic: every rank computes the same result. Raises UserError when more than
    ``data.max_bad_fraction`` of the rows are bad or nothing usable is left.
    """
    if cfg.data.format == "rl":
        raise UserError("data.format=rl is for grpo/ppo; sft reads chat (messages) or pairs (prompt/response) rows")
    if not cfg.data.path:
        raise UserError("no data given: pass --data FILE (JSONL, Parquet or a datasets directory)")
    examples, report = tokenize_rows(
        cfg.data.path, tokenizer, cfg, cfg.data.split, cache_dir=cache_dir, log=log, vision=vision
    )
    if report.bad_fraction > cfg.data.max_bad_fraction:
        raise UserError(
            f"{cfg.data.path}: too many bad rows, more than data.max_bad_fraction="
            f"{cfg.data.max_bad_fraction}: {report.summary()}"
        )
    if not examples:
        raise UserError(f"{cfg.data.path}: no usable rows ({report.summary()})")
    val: list[Example] = []
    val_report = None
    if cfg.data.val_path:
        val, val_report = tokenize_rows(
            cfg.data.val_path, tokenizer, cfg, val_split(cfg), cache_dir=cache_dir, log=log, vision=vision
        )
    elif cfg.data.val_fraction > 0:
        n_val = max(1, round(cfg.data.val_fraction * len(examples)))
        if n_val >= len(examples):
            raise UserError(f"data.val_fraction={cfg.data.val_fraction} leaves no training rows out of {len(examples)}")
        rng = np.random.default_rng(cfg.train.seed)
        held = set(rng.permutation(len(examples))[:n_val].tolist())
        val = [ex for i, ex in enumerate(examples) if i in held]
        examples = [ex for i, ex in enumerate(examples) if i not in held]
    return SFTData(examples, val, report, val_report)
