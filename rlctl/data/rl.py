"""RL prompts: rows -> prompt token ids plus what the reward function needs.

Two row formats, told apart row by row:

* verl's RL schema (Parquet as verl's preprocessing scripts write it)::

      {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "..."}],
       "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {...}}

* plain rows ``{"prompt": "...", "answer": "..."}`` (field names from ``data.prompt_field`` and
  ``data.answer_field``); a string prompt becomes one user message.

The prompt is rendered with the tokenizer's chat template and the generation prompt (a string
prompt is used as is when the tokenizer has none). Prompts longer than ``rollout.max_prompt_len``
tokens are skipped and counted; malformed rows are *bad rows*, skipped and counted, and the run fails
when more than ``data.max_bad_fraction`` of the rows are bad. A dataset in which no row carries an
answer is a :class:`UserError` naming the field to set.

Vision-language models (``vision``: the model's :class:`rlctl.data.vision.VisionProcessor`): a prompt's
``<image>`` placeholders (verl's geo3k layout) or image content parts (HF chat) are the row's images, in
order; each becomes the model's vision span expanded to one image token per merged patch, and the images
are processed once and cached with the token ids (``Prompt.pixel_values``, ``Prompt.image_grid_thw``). The
prompt length counts the image tokens. A row whose images cannot be used is a bad row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rlctl.config import RunConfig, val_split
from rlctl.data.io import read_rows
from rlctl.data.sft import (
    PIXEL_FEATURES,
    BadRow,
    DataReport,
    checked_messages,
    pixel_columns,
    pixels_from_columns,
    with_system,
)
from rlctl.data.vision import IMAGE_MARK, BadImage, data_dir, has_images, replace_marks, row_pixels
from rlctl.errors import UserError

TOO_LONG = "prompt longer than rollout.max_prompt_len"


@dataclass
class Prompt:
    """One RL prompt: its token ids and the reward function's arguments."""

    token_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict | None
    row: dict | None = None  # the dataset row (an environment's reset(**row), a TRL reward's columns)
    pixel_values: np.ndarray | None = None  # float32 [patches, D]: a VL prompt's images, processed
    image_grid_thw: np.ndarray | None = None  # int64 [images, 3], in the order of its image tokens


@dataclass
class RLData:
    train: list[Prompt]
    val: list[Prompt]
    report: DataReport
    too_long: int  # prompts skipped for length (also counted in report.bad)


def _ground_truth(row: dict, answer_field: str) -> tuple[bool, Any]:
    """(found, value): ``reward_model.ground_truth`` (verl) or the answer field (plain rows)."""
    rm = row.get("reward_model")
    if isinstance(rm, dict) and "ground_truth" in rm:
        return True, rm["ground_truth"]
    if answer_field in row:
        return True, row[answer_field]
    return False, None


def prompt_messages(prompt: Any, field: str, system: str = "") -> list[dict]:
    """A prompt (a string or a chat message list) as chat messages, ``system`` first unless it has one."""
    messages = checked_messages(prompt, field) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return with_system(messages, system)


def render_prompt(prompt: Any, tokenizer, field: str, system: str = "", tools: list[dict] | None = None) -> list[int]:
    """Token ids of a prompt (a string or a chat message list), ending with the generation prompt;
    ``system`` (data.system_prompt) goes first unless the prompt has a system message; ``tools`` (OpenAI
    function schemas, agent runs) go to the chat template."""
    if isinstance(prompt, str) and not prompt:
        raise BadRow(f"empty '{field}'")
    if not tokenizer.chat_template:
        if not isinstance(prompt, str):
            raise BadRow(f"'{field}' is a message list but the tokenizer has no chat template")
        return list(tokenizer(f"{system}\n\n{prompt}" if system else prompt)["input_ids"])
    messages = prompt_messages(prompt, field, system)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 (jinja raises many types)
        raise BadRow(f"chat template failed ({str(e).splitlines()[0][:80]})") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def row_prompt(
    row: dict,
    tokenizer,
    cfg: RunConfig,
    tools: list[dict] | None = None,
    *,
    vision=None,
    base_dir=None,
    answer_required: bool = True,
) -> Prompt:
    """One row as a :class:`Prompt`; raises :class:`BadRow` with the reason when it cannot be used.
    ``vision``: a VL model's VisionProcessor (its images processed, their tokens expanded). Without
    ``answer_required`` (no reward reads it: :func:`rlctl.rewards.needs_answer`) a row may have no answer."""
    field = cfg.data.prompt_field
    prompt = row.get(field)
    if not isinstance(prompt, (str, list)):
        raise BadRow(f"missing field '{field}'")
    found, truth = _ground_truth(row, cfg.data.answer_field)
    if not found and answer_required:
        raise BadRow(f"missing field '{cfg.data.answer_field}'")
    pixels = None
    if vision is not None:
        ids, pixels = _vision_prompt(row, prompt, vision, cfg, tools, base_dir)
    elif has_images(row, prompt):
        raise BadRow("images, but the model has no vision tower")
    else:
        ids = render_prompt(prompt, tokenizer, field, cfg.data.system_prompt, tools)
    if len(ids) > cfg.rollout.max_prompt_len:
        raise BadRow(TOO_LONG)
    out = _with_meta(ids, row, cfg)
    if pixels is not None:
        out.pixel_values, out.image_grid_thw = pixels
    return out


def _vision_prompt(row: dict, prompt, vision, cfg: RunConfig, tools, base_dir):
    """A VL prompt's token ids (its image spans expanded) and its processed images (None without images)."""
    field = cfg.data.prompt_field
    if not vision.tokenizer.chat_template:
        raise BadRow("a vision-language model's prompts need a chat template")
    messages = prompt_messages(prompt, field, cfg.data.system_prompt)
    try:
        text = vision.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 (jinja raises many types)
        raise BadRow(f"chat template failed ({str(e).splitlines()[0][:80]})") from None
    try:
        pixels = row_pixels(
            row,
            prompt,
            vision,
            count=text.count(IMAGE_MARK),
            max_pixels=cfg.data.max_image_pixels,
            base_dir=base_dir,
        )
        text, _ = replace_marks(text, [], vision.placeholder)
        ids = list(vision.tokenizer(text, add_special_tokens=False)["input_ids"])
        if pixels is not None:
            ids, _ = vision.expand(ids, pixels[1])
    except BadImage as e:
        raise BadRow(str(e)) from None
    return ids, pixels


def _with_meta(ids: list[int], row: dict, cfg: RunConfig) -> Prompt:
    """A usable row's :class:`Prompt`: its token ids and what the reward function needs."""
    _, truth = _ground_truth(row, cfg.data.answer_field)
    extra = row.get("extra_info")
    extra = dict(extra) if isinstance(extra, dict) else None
    if cfg.reward.format_pattern:
        extra = {**(extra or {}), "pattern": cfg.reward.format_pattern}
    return Prompt(ids, str(row.get("data_source") or ""), truth, extra, dict(row))


def read_prompts(
    path: str,
    tokenizer,
    cfg: RunConfig,
    split: str = "train",
    *,
    cache_dir=None,
    log=lambda msg: None,
    tools: list[dict] | None = None,
    vision=None,
    answer_required: bool = True,
) -> tuple[list[Prompt], DataReport]:
    """Every usable prompt of a data source (rendered through ``datasets.map``, cached in ``cache_dir``
    and done once: :func:`rlctl.data.mapped.map_rows`), and the report of what was skipped. ``vision``: a
    VL model's VisionProcessor; the prompts' images are processed once and cached with the token ids."""
    from rlctl.data.mapped import map_rows

    rows = read_rows(path, split=split)
    report = DataReport(total=len(rows))
    for reason in rows.unreadable:
        report.bad[reason] += 1
    if answer_required:
        _require_answers(path, rows.rows, cfg.data.answer_field)

    base_dir = data_dir(path)

    def render(row: dict) -> dict:
        try:
            p = row_prompt(
                row, tokenizer, cfg, tools, vision=vision, base_dir=base_dir, answer_required=answer_required
            )
            out = {"token_ids": p.token_ids, "bad": ""}
        except BadRow as e:
            p, out = None, {"token_ids": [], "bad": str(e)}
        if vision is None:
            return out
        columns = pixel_columns(p)
        if p is None or p.pixel_values is None:  # typed like the rows with images (datasets concatenates them)
            columns["pixel_values"] = np.zeros(0, np.float32)
        return {**out, **columns}

    key = _cache_key(path, split, cfg, tokenizer, tools, vision, answer_required)
    features = {"token_ids": "int32 list", "bad": "string"} | (PIXEL_FEATURES if vision is not None else {})
    prompts = []
    outs = map_rows(rows.rows, render, cache_dir=cache_dir, key=key, desc="prompts", features=features, log=log)
    for row, out in zip(rows.rows, outs):
        if out["bad"]:
            report.bad[out["bad"]] += 1
        else:
            p = _with_meta(list(out["token_ids"]), row, cfg)
            p.pixel_values, p.image_grid_thw = pixels_from_columns(out)
            prompts.append(p)
    return prompts, report


def _require_answers(path: str, rows: list[dict], answer_field: str) -> None:
    """Some row of a source that needs answers has one (a source where none has is a misnamed field)."""
    if rows and not any(_ground_truth(r, answer_field)[0] for r in rows):
        fields = sorted({k for r in rows[:20] for k in r})
        raise UserError(
            f"{path}: no row has an answer field '{answer_field}' (nor verl's reward_model.ground_truth); "
            f"the rows have {', '.join(fields)}: name the answer with --set data.answer_field=FIELD"
        )


def _cache_key(path: str, split: str, cfg: RunConfig, tokenizer, tools, vision, answer_required: bool) -> str:
    """The rendered prompts' cache key: everything the rendering reads (the source, the settings, the tokenizer)."""
    from dataclasses import asdict

    from rlctl.data.mapped import cache_key, source_stamp, tokenizer_stamp

    return cache_key(
        kind="rl",
        source=source_stamp(path),
        split=split,
        data=asdict(cfg.data),
        max_prompt_len=cfg.rollout.max_prompt_len,
        tokenizer=tokenizer_stamp(tokenizer),
        **({"tools": tools} if tools else {}),
        **({"vision": vision.stamp()} if vision is not None else {}),
        **({} if answer_required else {"answer_required": False}),
    )


def _environment_tasks(cfg: RunConfig, tokenizer, tools: list[dict] | None) -> RLData:
    """No dataset, an environment that samples its own tasks (TRL's convention): ``train.batch_size`` rows of
    one empty user message, cycled over the steps; each trajectory's ``reset()`` returns its task, appended
    to that message."""
    rows = [{"prompt": [{"role": "user", "content": ""}]} for _ in range(cfg.train.batch_size)]
    prompts = [row_prompt(r, tokenizer, cfg, tools, answer_required=False) for r in rows]
    return RLData(prompts, [], DataReport(total=len(rows)), 0)


def build_rl_data(
    cfg: RunConfig,
    tokenizer,
    *,
    cache_dir=None,
    log=lambda msg: None,
    tools: list[dict] | None = None,
    vision=None,
    answer_required: bool = True,
) -> RLData:
    """The training prompts (and validation prompts from ``data.val_path`` or ``data.val_fraction``).

    Deterministic, so every rank computes the same list. Prompts too long are skipped (not counted
    against ``data.max_bad_fraction``); other bad rows are. UserError when nothing is left. Without a
    ``data.path``, an environment (``agent.env``) samples its own tasks (:func:`_environment_tasks`).
    """
    if cfg.data.format not in (None, "rl"):
        raise UserError(
            f"data.format={cfg.data.format} is for sft; grpo/ppo read RL prompt rows (data.format=rl or unset)"
        )
    if not cfg.data.path and cfg.agent.env:
        return _environment_tasks(cfg, tokenizer, tools)
    if not cfg.data.path:
        raise UserError("no data given: pass --data FILE (JSONL, Parquet or a datasets directory of prompts)")
    kw = dict(cache_dir=cache_dir, log=log, tools=tools, vision=vision, answer_required=answer_required)
    prompts, report = read_prompts(cfg.data.path, tokenizer, cfg, cfg.data.split, **kw)
    too_long = report.bad.get(TOO_LONG, 0)
    malformed = report.num_bad - too_long
    if report.total and malformed / report.total > cfg.data.max_bad_fraction:
        raise UserError(
            f"{cfg.data.path}: too many bad rows, more than data.max_bad_fraction="
            f"{cfg.data.max_bad_fraction}: {report.summary()}"
        )
    if not prompts:
        hint = " (raise --max-prompt-len)" if too_long else ""
        raise UserError(f"{cfg.data.path}: no usable prompts{hint}: {report.summary()}")
    val: list[Prompt] = []
    if cfg.data.val_path:
        val, _ = read_prompts(cfg.data.val_path, tokenizer, cfg, val_split(cfg), **kw)
    elif cfg.data.val_fraction > 0:
        import numpy as np

        n_val = max(1, round(cfg.data.val_fraction * len(prompts)))
        if n_val >= len(prompts):
            raise UserError(
                f"data.val_fraction={cfg.data.val_fraction} leaves no training prompts out of {len(prompts)}"
            )
        held = set(np.random.default_rng(cfg.train.seed).permutation(len(prompts))[:n_val].tolist())
        val = [p for i, p in enumerate(prompts) if i in held]
        prompts = [p for i, p in enumerate(prompts) if i not in held]
    return RLData(prompts, val, report, too_long)
