"""Global batches, their split over ranks, sequence packing and collation.

Order never depends on the number of processes:

1. :class:`StepSampler` gives the global batch of each optimizer step (``batch_size`` sequence
   indices from a per-epoch permutation seeded by ``seed + epoch``) -- a function of the step alone.
2. :func:`group_micro_batches` cuts that global batch into micro-batches: with packing, bins of at
   most ``budget`` tokens filled first-fit-decreasing; without, runs of ``micro_batch_size``
   sequences. Every rank computes the same list.
3. :func:`rank_micro_batches` deals micro-batch ``i`` to rank ``i % world``. A rank left short gets
   empty *dummy* micro-batches, so every rank runs the same number of forward/backward passes
   (FSDP's collectives require it).

A packed micro-batch is one row ``[1, T]`` holding several documents, with position ids restarting
at 0 for each document and ``attention_mask=None``: transformers then keeps attention inside each
document (sdpa: a block-diagonal causal mask; flash-attention: varlen kernels). Each document's
last label is -100, so no token is trained to predict the next document.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from rlctl.data.sft import IGNORE, Example


@dataclass
class MicroBatch:
    """One forward pass of an engine: SFT's packed or padded rows, or RL's packed samples.

    The engine reads ``input_ids``, ``position_ids`` and ``attention_mask``; the rest belongs to the
    loss. SFT: ``labels`` is ``[B, T]`` (-100 where no loss). RL (one packed row ``[1, T]``):
    ``labels`` are the ``[N]`` response tokens, ``logit_index`` the positions whose logits predict them,
    ``rows`` the rows of the step's batch it holds, ``token_row`` / ``token_col`` where each response
    token goes in the ``[k, width]`` matrix of those rows.
    """

    input_ids: torch.Tensor  # [B, T] int64
    position_ids: torch.Tensor  # [B, T] int64
    labels: torch.Tensor  # SFT: [B, T], -100 where no loss; RL: [N] response tokens
    attention_mask: torch.Tensor | None = None  # [B, T] 0/1 for padded rows; None for packed rows
    num_seqs: int = 0  # real sequences in it (0 for a dummy)
    rows: torch.Tensor | None = None  # RL: [k] the batch rows it holds
    logit_index: torch.Tensor | None = None  # RL: [N] positions whose logits predict the response tokens
    token_row: torch.Tensor | None = None  # RL: [N] row (0..k-1) of each response token
    token_col: torch.Tensor | None = None  # RL: [N] its index within its response
    width: int = 0  # RL: longest response in it
    # RL with shared prompts (rlctl.recipes.rl.batch): one row per prompt group, the prompt once and then
    # its samples' responses, ``attention_mask`` None and ``blocks`` saying what attends to what (the engine
    # builds a mask from them where it needs one); the logits are computed at the columns ``keep_cols`` only,
    # and ``logit_index`` indexes the flattened [G, K] of those.
    keep_cols: torch.Tensor | None = None  # [K] int64
    # Which positions attend to which, for engines that split rows (rlctl.engines.varlen.Block tuples)
    blocks: list[tuple[int, int, int, int, int]] | None = None
    # Vision-language models: the images of its documents, in the order of their image tokens (None: no
    # image); the engine computes the multimodal rope positions from them (rlctl.engines.vision)
    pixel_values: torch.Tensor | None = None  # [P, D] float32, the image processor's patches
    image_grid_thw: torch.Tensor | None = None  # [I, 3] int64

    @property
    def dummy(self) -> bool:
        """Runs only to keep this rank in step with the others' collectives."""
        return self.num_seqs == 0

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        if self.attention_mask is not None:
            return int(self.attention_mask.sum())
        return self.input_ids.numel() if self.num_seqs else 0

    @property
    def num_loss_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())

    def at_labelled(self, output, *grids: torch.Tensor) -> tuple:
        """SFT / DPO (``labels`` ``[B, T]``): ``output`` and each ``[B, T]`` grid (its labels, ...) at the
        columns whose logits the engine computed, ``keep_cols`` (:func:`labelled_columns`; every column when
        None). An engine that computed every column anyway (Megatron) has its logits cut to them; an
        output under sequence parallelism already holds those columns only."""
        cols = self.keep_cols
        if cols is None:
            return (output, *grids)
        if isinstance(output, torch.Tensor):
            if output.shape[1] != cols.numel():
                output = output[:, cols]
        elif hasattr(output, "columns"):  # split over the vocabulary (Megatron's TP): every column computed
            output = output.columns(cols)
        return (output, *(g[:, cols] for g in grids))

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {f.name: v.to(device) for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    def to_matrix(self, flat: torch.Tensor) -> torch.Tensor:
        """RL: per-token values [N] -> [k, width] (zero past each response); differentiable."""
        out = flat.new_zeros(self.num_seqs, self.width)
        return out.index_put((self.token_row, self.token_col), flat)

    def at_response(self, output: torch.Tensor) -> torch.Tensor:
        """RL: the rows of the model's output ([B, T, ...]) at the positions that predict the response
        tokens, [N, ...]. An engine may already have computed only those (``logits_to_keep``): [1, N, ...]."""
        n = self.logit_index.numel()
        if self.keep_cols is not None:
            if output.shape[1] != self.keep_cols.numel():  # an engine that computed every position
                output = output[:, self.keep_cols]
            return output.flatten(0, 1)[self.logit_index]
        if output.shape[1] == n and self.input_ids.shape[1] != n:
            return output[0]
        return output[0, self.logit_index]

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """RL: this micro-batch's rows of a per-token batch tensor [b, W] -> [k, width]."""
        return t[self.rows, : self.width]


def labelled_columns(labels: torch.Tensor) -> torch.Tensor:
    """The columns of ``labels`` ``[B, T]`` where some row has a label (``labels[:, t]`` is the token that
    position ``t`` predicts, already shifted): the only ones whose logits a loss or log-prob reads (at least
    one, so that the head stays in the graph). Set as a micro-batch's ``keep_cols``, the engine runs the LM
    head (and the loss its log-softmax) there only (``logits_to_keep``); :meth:`MicroBatch.at_labelled`
    reads the labels at the same columns."""
    cols = torch.nonzero((labels != IGNORE).any(0)).flatten()
    return cols if cols.numel() else torch.zeros(1, dtype=torch.long, device=labels.device)


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """Optimizer steps in one pass over ``num_examples`` (a batch larger than the data is the whole data)."""
    return math.ceil(num_examples / min(batch_size, num_examples))


class StepSampler:
    """Which example indices form the global batch of optimizer step ``step`` (0-based)."""

    def __init__(self, num_examples: int, batch_size: int, *, seed: int, shuffle: bool = True):
        if num_examples < 1:
            raise ValueError("no examples")
        self.n = num_examples
        self.batch_size = min(batch_size, num_examples)
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = steps_per_epoch(self.n, batch_size)
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            order = np.arange(self.n)
            if self.shuffle:
                order = np.random.default_rng(self.seed + epoch).permutation(self.n)
            self._perm, self._perm_epoch = order, epoch
        return self._perm

    def indices(self, step: int) -> list[int]:
        """The global batch: the last batch of an epoch may be smaller (no example is dropped)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        return self._permutation(epoch)[k * self.batch_size : (k + 1) * self.batch_size].tolist()

    def first(self, step: int) -> int:
        """Where step ``step``'s batch starts in the stream of examples (every epoch's order in turn)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        return epoch * self.n + k * self.batch_size

    def stream(self, start: int, count: int) -> list[int]:
        """``count`` examples from position ``start`` of the stream (across epochs when it gets there):
        ``indices(step) == stream(first(step), len(indices(step)))``."""
        out: list[int] = []
        while count > 0:
            epoch, k = divmod(start, self.n)
            part = self._permutation(epoch)[k : k + count].tolist()
            out += part
            start, count = start + len(part), count - len(part)
        return out


def pack_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing: group item indices into bins of at most ``budget`` tokens.

    Deterministic (ties keep the input order); bins come out fullest-first-created. Every
    length must be <= budget.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        if n > budget:
            raise ValueError(f"a sequence of {n} tokens exceeds the packing budget {budget}")
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(budget - n)
    return bins


def group_micro_batches(
    lengths: Sequence[int], *, packing: bool, budget: int, micro_batch_size: int
) -> list[list[int]]:
    """Index groups (into the global batch), one per micro-batch; identical on every rank."""
    if packing:
        return pack_bins(lengths, budget)
    return [list(range(i, min(i + micro_batch_size, len(lengths)))) for i in range(0, len(lengths), micro_batch_size)]


def collate_packed(examples: Sequence[Example]) -> MicroBatch:
    """Several documents in one row, positions restarting at 0 for each."""
    ids = np.concatenate([ex.input_ids for ex in examples])
    labels = np.concatenate([ex.labels for ex in examples])
    pos = np.concatenate([np.arange(len(ex)) for ex in examples])

    def row(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.int64))[None]

    return MicroBatch(row(ids), row(pos), row(labels), None, len(examples), **image_inputs(examples))


def collate_padded(examples: Sequence[Example], pad_id: int) -> MicroBatch:
    """One row per document, right-padded to the longest, with an attention mask."""
    width = max(len(ex) for ex in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for r, ex in enumerate(examples):
        n = len(ex)
        ids[r, :n] = torch.from_numpy(ex.input_ids.astype(np.int64))
        labels[r, :n] = torch.from_numpy(ex.labels.astype(np.int64))
        mask[r, :n] = 1
    pos = torch.arange(width).expand(len(examples), width).clone()
    return MicroBatch(ids, pos, labels, mask, len(examples), **image_inputs(examples))


def image_inputs(examples: Sequence) -> dict:
    """``pixel_values`` and ``image_grid_thw`` of the examples' images, concatenated in order ({} without any).
    An example is anything with those two attributes (arrays or None)."""
    pixels = [ex.pixel_values for ex in examples if getattr(ex, "pixel_values", None) is not None]
    if not pixels:
        return {}
    grids = [ex.image_grid_thw for ex in examples if getattr(ex, "pixel_values", None) is not None]
    return {
        "pixel_values": torch.from_numpy(np.concatenate(pixels).astype(np.float32)),
        "image_grid_thw": torch.from_numpy(np.concatenate(grids).astype(np.int64)),
    }


def dummy_micro_batch(pad_id: int) -> MicroBatch:
    """One padding token with no loss: keeps a rank in step with the others' collectives."""
    one = torch.tensor([[pad_id]], dtype=torch.long)
    return MicroBatch(one, torch.zeros_like(one), torch.full_like(one, IGNORE), None, 0)


def rank_micro_batches(
    batch: Sequence[Example],
    rank: int,
    world: int,
    *,
    packing: bool,
    budget: int,
    micro_batch_size: int,
    pad_id: int,
    keep_labelled: bool = False,
) -> list[MicroBatch]:
    """This rank's micro-batches of a global batch: ``ceil(groups / world)`` of them on every rank.
    ``keep_labelled``: each one's logits at its labelled columns only (:func:`labelled_columns`)."""
    groups = group_micro_batches(
        [len(ex) for ex in batch], packing=packing, budget=budget, micro_batch_size=micro_batch_size
    )
    per_rank = max(1, math.ceil(len(groups) / world))
    out = []
    for k in range(per_rank):
        g = k * world + rank
        if g < len(groups):
            docs = [batch[i] for i in groups[g]]
            out.append(collate_packed(docs) if packing else collate_padded(docs, pad_id))
        else:
            out.append(dummy_micro_batch(pad_id))
        if keep_labelled:
            out[-1].keep_cols = labelled_columns(out[-1].labels)
    return out
