"""Preference data for `rlctl dpo` and `rlctl rm`: rows -> tokenized pairs (or KTO's unpaired rows), and
their micro-batches.

Row layouts, told apart row by row (field names from ``pref.*`` and ``data.prompt_field``):

* TRL standard: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``;
* TRL conversational: ``{"prompt": [messages], "chosen": [assistant message], "rejected": [...]}``;
* TRL implicit prompt: ``{"chosen": [whole conversation], "rejected": [whole conversation]}`` (the
  prompt is every message before the last; both must share it), or two strings (their common prefix);
* TRL unpaired (KTO): ``{"prompt": ..., "completion": ..., "label": true|false}``;
* LLaMA-Factory alpaca: ``{"instruction", "input", "chosen", "rejected"}`` (+ ``system``, ``history``);
* LLaMA-Factory sharegpt: ``{"conversations": [{"from": "human", "value": ...}], "chosen": {"from": "gpt",
  "value": ...}, "rejected": {...}}`` (+ ``system``); with ``kto_tag`` instead of chosen/rejected: KTO.

A response is tokenized as sft's pairs rows are (:func:`rlctl.data.sft.row_tokens`: the chat template,
loss on the response's tokens and its end-of-turn marker): :func:`pair_examples`. A reward model reads
text as ``rlctl ppo --reward-model`` scores it (:mod:`rlctl.rewards.model`): the rendered prompt, decoded
with its special tokens, then the response, tokenized as one string; the score is read at the last token
that is not padding (:func:`rlctl.data.pref_batches.score_position`, Hugging Face's sequence-classification
rule). Their micro-batches: :mod:`rlctl.data.pref_batches`. No torch here (the checks before launch parse rows).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlctl.config import RunConfig, val_split
from rlctl.data.io import read_rows
from rlctl.data.sft import IGNORE, BadRow, DataReport, Example, checked_messages, make_example, row_tokens
from rlctl.errors import UserError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class PrefRow:
    """One row, normalised: the prompt (text or messages) and one or two responses."""

    prompt: str | list[dict]
    chosen: str  # the preferred response (KTO: the completion)
    rejected: str | None  # None for an unpaired (KTO) row
    label: bool = True  # KTO: a desirable completion
    margin: float = 0.0  # rm: how much better chosen is (the row's margin field)


@dataclass
class Unit:
    """What one loss term reads: a pair's chosen and rejected sequences, or one unpaired row (KTO) with the
    mismatched row its KL estimate uses."""

    seqs: tuple[Example, ...]  # (chosen, rejected) or (row,)
    label: bool = True
    margin: float = 0.0
    kl_seq: Example | None = None  # KTO: this row's prompt with another row's completion

    def __len__(self) -> int:
        return sum(len(s) for s in self.seqs)


@dataclass
class PrefData:
    train: list[Unit]
    val: list[Unit]
    report: DataReport
    val_report: DataReport | None = None
    paired: bool = True


# ---------------------------------------------------------------------------------------------
# Rows


def _assistant_text(value: Any, where: str) -> str:
    """A response: text, one assistant message (a dict), or a list of messages ending with the assistant's."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, dict):  # LLaMA-Factory sharegpt: {"from": "gpt", "value": ...}; or one message
        value = [value]
    if isinstance(value, list) and value:
        messages = _messages(value, where)
        if messages[-1]["role"] == "assistant":
            return messages[-1]["content"]
    raise BadRow(f"'{where}' is not a response (text, or messages ending with the assistant's)")


def _messages(value: list, where: str) -> list[dict]:
    """Chat messages, from HF's ``role``/``content`` or LLaMA-Factory's sharegpt ``from``/``value``."""
    out = []
    for m in value:
        if isinstance(m, dict) and "from" in m and "value" in m:
            role = SHAREGPT_ROLES.get(m["from"])
            if role is None:
                raise BadRow(f"a message in '{where}' is from {m['from']!r} (rlctl reads human, gpt and system)")
            m = {"role": role, "content": m["value"]}
        out.append(m)
    return checked_messages(out, where)


def _implicit_prompt(row: dict, c: str, r: str) -> tuple[Any, str, str]:
    """TRL's implicit prompt: the messages before the last (shared by both), or the strings' common prefix."""
    chosen, rejected = row[c], row[r]
    if isinstance(chosen, list) and isinstance(rejected, list):
        mc, mr = _messages(chosen, c), _messages(rejected, r)
        if len(mc) < 2 or mc[:-1] != mr[:-1]:
            raise BadRow(f"'{c}' and '{r}' do not share a prompt (every message before the last)")
        return mc[:-1], _assistant_text(mc[-1:], c), _assistant_text(mr[-1:], r)
    if isinstance(chosen, str) and isinstance(rejected, str):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if not n or n in (len(chosen), len(rejected)):
            raise BadRow(f"no '{c}'/'{r}' prompt: the two texts share no prefix, or one is the other's prefix")
        return chosen[:n], chosen[n:], rejected[n:]
    raise BadRow(f"'{c}' and '{r}' are neither two texts nor two message lists")


def _alpaca_prompt(row: dict) -> list[dict]:
    """LLaMA-Factory's alpaca layout: ``history`` [[query, answer], ...], then instruction + input."""
    messages = []
    if isinstance(row.get("system"), str) and row["system"]:
        messages.append({"role": "system", "content": row["system"]})
    for turn in row.get("history") or []:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
            raise BadRow("'history' is not a list of [query, answer] pairs")
        messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    text = "\n".join(t for t in (row.get("instruction"), row.get("input")) if isinstance(t, str) and t)
    return checked_messages([*messages, {"role": "user", "content": text}], "instruction")


def _sharegpt_prompt(row: dict) -> list[dict]:
    messages = _messages(row["conversations"], "conversations")
    if isinstance(row.get("system"), str) and row["system"] and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": row["system"]}, *messages]
    return messages


def parse_row(row: dict, cfg: RunConfig) -> PrefRow:
    """One row in any layout of the module docstring, normalised; :class:`BadRow` names what is wrong."""
    p, d = cfg.pref, cfg.data
    c, r = p.chosen_field, p.rejected_field
    margin = row.get(p.margin_field) or 0.0
    if not isinstance(margin, (int, float)) or isinstance(margin, bool):
        raise BadRow(f"'{p.margin_field}' is not a number")
    if "conversations" in row:  # LLaMA-Factory sharegpt
        prompt = _sharegpt_prompt(row)
        if "kto_tag" in row:
            return PrefRow(prompt[:-1], _assistant_text(prompt[-1:], "conversations"), None, bool(row["kto_tag"]))
        return PrefRow(prompt, _assistant_text(row.get(c), c), _assistant_text(row.get(r), r), margin=margin)
    if "instruction" in row:  # LLaMA-Factory alpaca
        return PrefRow(
            _alpaca_prompt(row), _assistant_text(row.get(c), c), _assistant_text(row.get(r), r), margin=margin
        )
    if p.completion_field in row or p.label_field in row:  # TRL unpaired (KTO)
        label = row.get(p.label_field)
        if not isinstance(label, bool):
            raise BadRow(f"'{p.label_field}' is not true or false")
        completion = _assistant_text(row.get(p.completion_field), p.completion_field)
        return PrefRow(_prompt(row, d.prompt_field), completion, None, label)
    if c not in row or r not in row:
        raise BadRow(f"no '{c}' and '{r}' fields")
    if d.prompt_field not in row:
        prompt, chosen, rejected = _implicit_prompt(row, c, r)
        return PrefRow(prompt, chosen, rejected, margin=margin)
    return PrefRow(_prompt(row, d.prompt_field), _assistant_text(row[c], c), _assistant_text(row[r], r), margin=margin)


def _prompt(row: dict, field: str) -> str | list[dict]:
    value = row.get(field)
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value:
        return _messages(value, field)
    raise BadRow(f"missing field '{field}'")


# ---------------------------------------------------------------------------------------------
# Tokens


def _pairs_cfg(cfg: RunConfig) -> RunConfig:
    """``cfg`` reading sft's pairs rows {"prompt", "response"}: how a response is tokenized, written once."""
    data = dataclasses.replace(cfg.data, format="pairs", prompt_field="prompt", response_field="response")
    return dataclasses.replace(cfg, data=data)


def response_example(prompt: str | list[dict], response: str, tokenizer, cfg: RunConfig) -> Example:
    """The prompt and ``response`` as one sequence, labels on the response's tokens (as sft's pairs rows)."""
    ids, mask = row_tokens({"prompt": prompt, "response": response}, tokenizer, _pairs_cfg(cfg))
    return make_example(ids, mask, max_len=cfg.train.max_len, truncation=cfg.data.truncation)


def score_text_example(prompt: str | list[dict], response: str, tokenizer, cfg: RunConfig) -> Example:
    """A reward model's input: the text :class:`rlctl.rewards.model.RewardModel` scores for this response.
    Its labels are unused (IGNORE); the score is read at :func:`rlctl.data.pref_batches.score_position`."""
    from rlctl.data.rl import render_prompt

    prompt_ids = render_prompt(prompt, tokenizer, "prompt", cfg.data.system_prompt)
    text = tokenizer.decode(prompt_ids) + response
    ids = tokenizer(text)["input_ids"]
    if len(ids) > cfg.train.max_len:
        raise BadRow(f"longer than max_len {cfg.train.max_len} (raise --max-len)")
    return Example(np.asarray(ids, np.int32), np.full(len(ids), IGNORE, np.int32))


def _split_prompt(ex: Example) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids, response ids) of a response example: the response starts where the labels do."""
    first = int(np.argmax(ex.labels != IGNORE)) + 1
    return ex.input_ids[:first], ex.input_ids[first:]


def mismatched(prompt_of: Example, response_of: Example, cfg: RunConfig) -> Example:
    """KTO's KL row: ``prompt_of``'s prompt followed by ``response_of``'s response."""
    p, _ = _split_prompt(prompt_of)
    _, r = _split_prompt(response_of)
    ids = np.concatenate([p, r]).tolist()
    return make_example(ids, [0] * len(p) + [1] * len(r), max_len=cfg.train.max_len, truncation="right")


def row_unit(row: PrefRow, tokenizer, cfg: RunConfig, *, score_text: bool) -> Unit:
    """A parsed row tokenized: ``score_text`` for a reward model (:func:`score_text_example`), else the
    response-labelled sequences of dpo."""
    make = score_text_example if score_text else response_example
    chosen = make(row.prompt, row.chosen, tokenizer, cfg)
    if row.rejected is None:
        return Unit((chosen,), label=row.label)
    return Unit((chosen, make(row.prompt, row.rejected, tokenizer, cfg)), margin=float(row.margin))


def read_units(path: str, split: str, tokenizer, cfg: RunConfig, *, score_text: bool) -> tuple[list[Unit], DataReport]:
    rows = read_rows(path, split=split)
    report = DataReport(total=len(rows))
    for reason in rows.unreadable:
        report.bad[reason] += 1
    units = []
    for raw in rows.rows:
        try:
            units.append(row_unit(parse_row(raw, cfg), tokenizer, cfg, score_text=score_text))
        except BadRow as e:
            report.bad[str(e)] += 1
    return units, report


def _check_kind(units: list[Unit], path: str, *, paired: bool, loss: str) -> None:
    odd = [u for u in units if (len(u.seqs) == 2) != paired]
    if odd:
        want, got = ("pairs (chosen/rejected)", "unpaired") if paired else ("unpaired rows (completion/label)", "pairs")
        raise UserError(
            f"{path}: {len(odd)} of {len(units)} rows are {got}; {loss} trains on {want} "
            f"(docs/dpo.md lists the layouts{'' if paired else '; pick --loss sigmoid for pairs'})"
        )


def with_kl_rows(units: list[Unit], cfg: RunConfig) -> list[Unit]:
    """KTO: each row's KL row pairs its prompt with the next row's completion (a fixed derangement; a lone
    validation row, its own)."""
    n = len(units)
    return [
        dataclasses.replace(u, kl_seq=mismatched(u.seqs[0], units[(i + 1) % n].seqs[0], cfg))
        for i, u in enumerate(units)
    ]


def build_pref_data(cfg: RunConfig, tokenizer, *, paired: bool, loss: str, score_text: bool = False) -> PrefData:
    """The training units (and the validation ones: data.val_path, or a data.val_fraction held out).
    Deterministic: every rank computes the same. ``paired``: pairs (dpo, rm) or KTO's unpaired rows."""
    d = cfg.data
    if not d.path:
        raise UserError("no data given: pass --data FILE (JSONL, Parquet or a datasets directory)")
    units, report = read_units(d.path, d.split, tokenizer, cfg, score_text=score_text)
    if report.bad_fraction > d.max_bad_fraction:
        raise UserError(
            f"{d.path}: too many bad rows, more than data.max_bad_fraction={d.max_bad_fraction}: {report.summary()}"
        )
    if not units:
        raise UserError(f"{d.path}: no usable rows ({report.summary()})")
    _check_kind(units, d.path, paired=paired, loss=loss)
    val, val_report = [], None
    if d.val_path:
        val, val_report = read_units(d.val_path, val_split(cfg), tokenizer, cfg, score_text=score_text)
        _check_kind(val, d.val_path, paired=paired, loss=loss)
    elif d.val_fraction > 0:
        n_val = max(1, round(d.val_fraction * len(units)))
        if n_val >= len(units):
            raise UserError(f"data.val_fraction={d.val_fraction} leaves no training rows out of {len(units)}")
        held = set(np.random.default_rng(cfg.train.seed).permutation(len(units))[:n_val].tolist())
        val = [u for i, u in enumerate(units) if i in held]
        units = [u for i, u in enumerate(units) if i not in held]
    if not paired:
        if len(units) < 2:
            raise UserError("kto estimates KL(policy || reference) from mismatched rows: it needs at least 2 rows")
        units, val = with_kl_rows(units, cfg), with_kl_rows(val, cfg)
    return PrefData(units, val, report, val_report, paired)
