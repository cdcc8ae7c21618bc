"""The share of a micro batch's positions that carry a label, measured on the data's first rows, for the memory
estimate: sft and dpo run the LM head (and the loss its log-softmax) there only
(:func:`rlctl.data.packing.labelled_columns`), so their logits scale with it. Rows tokenized as the recipes do
(sft: :func:`rlctl.data.sft.row_tokens`; dpo: each pair packed with its prompt once, as the engine that shares
prefixes runs it); rows that fail to parse are left out (the checks before launch report them)."""

from __future__ import annotations

from rlctl.config import RunConfig
from rlctl.data.io import first_rows
from rlctl.data.sft import BadRow

SAMPLE_ROWS = 64  # rows read: the estimate's figure, not the whole data's


def labelled_fraction(cfg: RunConfig, tokenizer) -> float | None:
    """Labelled positions over all positions of the first rows of ``cfg.data.path`` packed (sft, dpo); None
    for another method, no local data, or no row that parses."""
    found = first_rows(cfg.data.path, SAMPLE_ROWS) if cfg.data.path and cfg.method in ("sft", "dpo") else None
    if not found:
        return None
    counts = [c for row in found[0] if (c := _row_counts(row, tokenizer, cfg)) is not None]
    total = sum(n for _, n in counts)
    return sum(k for k, _ in counts) / total if total else None


def _row_counts(row: dict, tokenizer, cfg: RunConfig) -> tuple[int, int] | None:
    """(labelled positions, positions) of one row as its micro batch holds it; None for a bad row."""
    from rlctl.data.packing import collate_packed, labelled_columns
    from rlctl.data.pref_batches import collate_units
    from rlctl.data.preference import parse_row, row_unit
    from rlctl.data.sft import make_example, row_tokens

    try:
        if cfg.method == "sft":
            ids, mask = row_tokens(row, tokenizer, cfg)
            mb = collate_packed([make_example(ids, mask, max_len=cfg.train.max_len, truncation=cfg.data.truncation)])
        else:
            unit = row_unit(parse_row(row, cfg), tokenizer, cfg, score_text=False)
            mb = collate_units([unit], [0], packing=True, pad_id=0, share_prompt=True)
    except BadRow:
        return None
    return labelled_columns(mb.labels).numel(), mb.input_ids.shape[1]
