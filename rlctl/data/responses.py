"""Another model's responses as RL samples (``--teacher-data``, GKD's mixture, docs/distill.md): rows in sft's
layouts (``prompt``/``response`` pairs or chat ``messages``, :mod:`rlctl.data.sft`), tokenized as sft does, each
split where its first assistant token starts into the prompt (the context) and the response (the tokens the loss
reads, with the 0/1 mask of the assistant's tokens: a multi-turn row's tool and user turns are context only).

A row whose prompt is longer than ``rollout.max_prompt_len`` is skipped and counted; a response longer than
``rollout.max_response_len`` is cut there and marked truncated, as a sample of that length would be. More bad
rows than ``data.max_bad_fraction``, or none usable, is a one-line UserError naming the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlctl.config import RunConfig
from rlctl.data.io import read_rows
from rlctl.data.rl import TOO_LONG
from rlctl.data.sft import BadRow, DataReport, row_tokens
from rlctl.data.vision import has_images
from rlctl.errors import UserError


@dataclass(frozen=True)
class ResponseRow:
    """One row: its prompt's token ids, its response's, the response's loss mask, whether it was cut."""

    prompt: list[int]
    response: list[int]
    mask: list[int]
    truncated: bool


def split_row(ids: list[int], mask: list[int], max_prompt: int, max_response: int) -> ResponseRow:
    """The tokens of a row (``mask``: 1 on the assistant's) as a prompt and a response; raises :class:`BadRow`."""
    first = next((i for i, m in enumerate(mask) if m), None)
    if first is None or first == 0:
        raise BadRow("no assistant tokens" if first is None else "an assistant turn with no prompt before it")
    if first > max_prompt:
        raise BadRow(TOO_LONG)
    response, resp_mask = ids[first:], mask[first:]
    cut = len(response) > max_response
    response, resp_mask = response[:max_response], resp_mask[:max_response]
    return ResponseRow(list(ids[:first]), list(response), list(resp_mask), cut)


def read_responses(path: str, tokenizer, cfg: RunConfig) -> tuple[list[ResponseRow], DataReport]:
    """Every usable row of ``path`` and the report of those skipped."""
    rows = read_rows(path)
    report = DataReport(total=len(rows))
    for reason in rows.unreadable:
        report.bad[reason] += 1
    sft_cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, format=None))  # pairs or chat, per row
    r = cfg.rollout
    out = []
    for row in rows.rows:
        try:
            if has_images(row, row.get(cfg.data.messages_field) or row.get(cfg.data.prompt_field)):
                raise BadRow("images (teacher data is text only)")
            ids, mask = row_tokens(row, tokenizer, sft_cfg)
            out.append(split_row(list(ids), list(mask), r.max_prompt_len, r.max_response_len))
        except BadRow as e:
            report.bad[str(e)] += 1
    if report.bad_fraction > cfg.data.max_bad_fraction or not out:
        what = "no usable rows" if not out else f"more bad rows than data.max_bad_fraction={cfg.data.max_bad_fraction}"
        raise UserError(f"--teacher-data {path}: {what} ({report.summary()}); rows need prompt/response or messages")
    return out, report
