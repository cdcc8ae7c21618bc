"""Preference rows in TRL's and LLaMA-Factory's layouts (rlctl.data.preference), and their packed
micro-batches: a pair's two sequences in one row, each attending only to itself, give the same summed
log-probs as plain Hugging Face forwards of each sequence alone; the reward model's score position is
Hugging Face's sequence-classification rule."""

from __future__ import annotations

import pytest
import torch

from rlctl.config import build_config, dotted_to_nested
from rlctl.data.preference import PrefRow, build_pref_data, parse_row
from rlctl.data.sft import BadRow
from rlctl.errors import UserError
from tests.support.pref import format_pairs
from tests.support.sft import write_jsonl

U = {"role": "user", "content": "What is 3 + 4?"}
A = {"role": "assistant", "content": "7"}
B = {"role": "assistant", "content": "8"}


def _cfg(model_dir="", data="", **sets):
    base = {"model.name": str(model_dir), "data.path": str(data), "train.max_len": 64, **sets}
    return build_config("dpo", [dotted_to_nested(base)])


@pytest.mark.parametrize(
    "row, want",
    [
        ({"prompt": "What is 3 + 4?", "chosen": "7", "rejected": "8"}, PrefRow("What is 3 + 4?", "7", "8")),
        ({"prompt": [U], "chosen": [A], "rejected": [B]}, PrefRow([U], "7", "8")),  # conversational
        ({"chosen": [U, A], "rejected": [U, B]}, PrefRow([U], "7", "8")),  # implicit prompt
        ({"chosen": "Q: 3 + 4? A: 7", "rejected": "Q: 3 + 4? A: 8"}, PrefRow("Q: 3 + 4? A: ", "7", "8")),
        ({"prompt": "Q", "completion": "7", "label": True}, PrefRow("Q", "7", None, True)),  # kto
        ({"prompt": [U], "completion": [B], "label": False}, PrefRow([U], "8", None, False)),
        (  # LLaMA-Factory alpaca, with a system prompt and history
            {
                "instruction": "What is 3 + 4?",
                "input": "",
                "chosen": "7",
                "rejected": "8",
                "system": "Be brief.",
                "history": [["Hi", "Hello"]],
            },
            PrefRow(
                [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                    U,
                ],
                "7",
                "8",
            ),
        ),  # fmt: skip
        (  # LLaMA-Factory sharegpt
            {
                "conversations": [{"from": "human", "value": "What is 3 + 4?"}],
                "chosen": {"from": "gpt", "value": "7"},
                "rejected": {"from": "gpt", "value": "8"},
            },
            PrefRow([U], "7", "8"),
        ),  # fmt: skip
        (  # LLaMA-Factory sharegpt kto
            {
                "conversations": [{"from": "human", "value": "What is 3 + 4?"}, {"from": "gpt", "value": "8"}],
                "kto_tag": False,
            },
            PrefRow([U], "8", None, False),
        ),  # fmt: skip
        ({"prompt": "Q", "chosen": "7", "rejected": "8", "margin": 2}, PrefRow("Q", "7", "8", margin=2)),
    ],
)
def test_every_layout_parses_to_the_same_row(row, want):
    assert parse_row(row, _cfg()) == want


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"prompt": "Q", "chosen": "7"}, "no 'chosen' and 'rejected' fields"),
        ({"chosen": [U, A], "rejected": [B]}, "do not share a prompt"),
        ({"prompt": "Q", "completion": "7", "label": "yes"}, "'label' is not true or false"),
        ({"prompt": "Q", "chosen": [U], "rejected": "8"}, "'chosen' is not a response"),
        ({"conversations": [{"from": "observation", "value": "x"}], "chosen": "7", "rejected": "8"}, "observation"),
    ],
)
def test_a_bad_row_names_its_problem(row, reason):
    with pytest.raises(BadRow, match=reason):
        parse_row(row, _cfg())


def test_pairs_tokenize_like_sft_and_kto_rows_get_mismatched_kl_rows(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    pairs = write_jsonl(tmp_path / "p.jsonl", format_pairs(6))
    data = build_pref_data(_cfg(tiny_model_dir, pairs, **{"data.val_fraction": 0.34}), tok, paired=True, loss="x")
    assert (len(data.train), len(data.val)) == (4, 2)
    chosen, rejected = data.train[0].seqs
    text = tok.decode(chosen.input_ids)
    assert text.startswith("<|im_start|>user\nWhat is") and text.endswith("<|im_end|>\n")
    labelled = tok.decode([t for t in chosen.labels if t >= 0])  # the response and its end of turn
    assert labelled.startswith("The answer is") and "####" in labelled and labelled.endswith("<|im_end|>\n")
    assert "####" not in tok.decode([t for t in rejected.labels if t >= 0])
    with pytest.raises(UserError, match="are pairs; --loss kto trains on unpaired rows"):
        build_pref_data(_cfg(tiny_model_dir, pairs), tok, paired=False, loss="--loss kto")

    rows = [{"prompt": f"Q{i}", "completion": f"A{i}", "label": i % 2 == 0} for i in range(3)]
    kto = build_pref_data(_cfg(tiny_model_dir, write_jsonl(tmp_path / "k.jsonl", rows)), tok, paired=False, loss="k")
    kl = kto.train[0].kl_seq  # row 0's prompt with row 1's completion
    assert "Q0" in tok.decode(kl.input_ids) and tok.decode([t for t in kl.labels if t >= 0]).startswith("A1")
    assert [u.label for u in kto.train] == [True, False, True]


@pytest.mark.parametrize("packing, keep", [(True, False), (False, False), (True, True), (False, True)])
def test_packed_pairs_give_each_sequences_own_logps(packing, keep, tiny_model_dir, tmp_path, process_group):
    """A micro-batch of two pairs, packed in one row (or padded, one row each): every sequence's summed response
    log-prob equals a plain forward of that sequence alone (per-document attention, positions restarting at 0),
    also through the engine with the LM head at the labelled columns only (``keep``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlctl.data.pref_batches import unit_micro_batches
    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.recipes.dpo import sequence_logps
    from tests.support.sft import cpu_spec

    cfg = _cfg(tiny_model_dir, write_jsonl(tmp_path / "p.jsonl", format_pairs(2)), **{"model.attn": "sdpa"})
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    units = build_pref_data(cfg, tok, paired=True, loss="x").train
    (mb,) = unit_micro_batches(
        units, 0, 1, packing=packing, budget=1024, pad_id=tok.pad_token_id, per_micro=2, keep_labelled=keep
    )
    assert mb.input_ids.shape[0] == (1 if packing else 4) and mb.units == [0, 1]  # both pairs in one micro-batch
    assert (mb.keep_cols is not None) == keep
    engine = FSDPEngine(cpu_spec(cfg), role="ref", trainable=False)
    (packed,) = engine.forward_backward([mb], lambda out, m: (None, sequence_logps(out, m)), forward_only=True)

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    alone = []
    for seq in [s for u in units for s in u.seqs]:
        ids, labels = (
            torch.as_tensor(seq.input_ids[None], dtype=torch.long),
            torch.as_tensor(seq.labels, dtype=torch.long),
        )
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        keep = labels >= 0
        alone.append(float(logp[keep].gather(1, labels[keep][:, None]).sum()))
    assert packed.tolist() == pytest.approx(alone, abs=1e-4)
    assert mb.seq_len.tolist() == [float((torch.as_tensor(s.labels) >= 0).sum()) for u in units for s in u.seqs]


def test_the_score_is_read_at_the_last_token_that_is_not_padding():
    import numpy as np

    from rlctl.data.pref_batches import score_position

    assert score_position(np.array([5, 6, 7]), pad_id=0) == 2
    assert score_position(np.array([5, 6, 0, 0]), pad_id=0) == 1


@pytest.mark.parametrize("dense", [True, False])
def test_a_pairs_shared_prompt_gives_the_log_probs_of_the_unshared_packing(
    dense, tiny_model_dir, tmp_path, process_group
):
    """``share_prompt``: each pair's prompt once in the packed row (its chosen and rejected responses both attend
    to it). Every sequence's summed log-prob equals the old packing's (each sequence whole, per-document
    attention) and a plain forward of it alone, on both of the engine's paths: one masked sdpa call (short
    rows on CPU) and the per-block calls; the row is shorter by each pair's prompt and each sequence's
    unlabelled tail."""
    from transformers import AutoTokenizer

    from rlctl.data.pref_batches import answer_end, shared_prompt, unit_micro_batches
    from rlctl.engines import varlen
    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.recipes.dpo import sequence_logps
    from tests.support.sft import cpu_spec

    cfg = _cfg(tiny_model_dir, write_jsonl(tmp_path / "p.jsonl", format_pairs(3)), **{"model.attn": "sdpa"})
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    units = build_pref_data(cfg, tok, paired=True, loss="x").train
    engine = FSDPEngine(cpu_spec(cfg), role="ref", trainable=False)

    def logps(share: bool) -> tuple[list[float], int]:
        (mb,) = unit_micro_batches(
            units, 0, 1, packing=True, budget=4096, pad_id=tok.pad_token_id, per_micro=3, share_prompt=share
        )
        (out,) = engine.forward_backward([mb], lambda o, m: (None, sequence_logps(o, m)), forward_only=True)
        return out.tolist(), mb.input_ids.shape[1]

    old, old_len = logps(False)
    saved = varlen.DENSE_MAX_LEN
    varlen.DENSE_MAX_LEN = 10**6 if dense else 0
    try:
        new, new_len = logps(True)
    finally:
        varlen.DENSE_MAX_LEN = saved
    prompts = [shared_prompt(u.seqs) for u in units]
    tails = [len(s) - answer_end(s) for u in units for s in u.seqs]  # the closing newline: no label
    assert all(p > 0 for p in prompts) and all(t > 0 for t in tails)
    assert new_len == old_len - sum(prompts) - sum(tails)
    assert new == pytest.approx(old, abs=1e-4)


def test_a_pairs_shared_prompt_gives_the_gradients_of_the_unshared_packing(tiny_model_dir, tmp_path):
    """The prompt held once gets the sum of both sequences' gradients: a weighted sum of the sequences'
    log-probs has the same gradient on every parameter with the prompt shared as with each sequence whole."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlctl.data.pref_batches import unit_micro_batches
    from rlctl.engines import varlen
    from rlctl.recipes.dpo import sequence_logps

    cfg = _cfg(tiny_model_dir, write_jsonl(tmp_path / "p.jsonl", format_pairs(2)))
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    units = build_pref_data(cfg, tok, paired=True, loss="x").train
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa")
    varlen.install(hf.config)
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0])  # chosen and rejected of two pairs, apart

    def grads(share: bool) -> list[torch.Tensor]:
        (mb,) = unit_micro_batches(
            units, 0, 1, packing=True, budget=4096, pad_id=tok.pad_token_id, per_micro=2, share_prompt=share
        )
        blocks = mb.blocks if share else varlen.blocks_from_positions(mb.position_ids)
        kwargs = varlen.attention_kwargs(blocks, mb.input_ids)
        hf.zero_grad()
        out = hf(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, **kwargs).logits
        (sequence_logps(out, mb) * weights).sum().backward()
        return [p.grad.clone() for p in hf.parameters()]

    old, new = grads(False), grads(True)
    assert max(float((a - b).abs().max() / (a.abs().max() + 1e-12)) for a, b in zip(old, new)) < 1e-4
    assert all(float(g.abs().max()) > 0 for g in old[:3])  # the gradient reaches the embeddings and layers


def _keep_units(kind: str, tok, tiny_model_dir, tmp_path) -> list:
    """Three pairs, or three KTO rows each with its mismatched KL row (as the reference pass holds them)."""
    from rlctl.data.preference import Unit

    if kind == "pairs":
        cfg = _cfg(tiny_model_dir, write_jsonl(tmp_path / "p.jsonl", format_pairs(3)))
        return build_pref_data(cfg, tok, paired=True, loss="x").train
    rows = [
        {"prompt": f"What is {i} + 4?", "completion": f"The answer is {i + 4}.", "label": i % 2 == 0} for i in range(3)
    ]
    kto = build_pref_data(_cfg(tiny_model_dir, write_jsonl(tmp_path / "k.jsonl", rows)), tok, paired=False, loss="k")
    return [Unit((u.seqs[0], u.kl_seq)) for u in kto.train]


@pytest.mark.parametrize(
    "kind, layout", [("pairs", "shared"), ("pairs", "packed"), ("pairs", "padded"), ("kto", "shared")]
)
def test_the_lm_head_at_the_labelled_columns_only_gives_the_full_logits_log_probs_loss_and_gradients(
    kind, layout, tiny_model_dir, tmp_path
):
    """``keep_labelled``: the model's LM head runs at the labelled columns only (``logits_to_keep``; the label
    of position t is token t+1, so the last prompt token is kept and the last answer token is not). Each
    sequence's log-prob, the DPO loss and every parameter's gradient equal the full logits' (fp32), and a plain
    forward of each sequence alone; the kept columns one off give other log-probs (what an off-by-one would)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlctl.algos.preference import get_pref_loss
    from rlctl.algos.preference_losses import PrefInputs
    from rlctl.data.pref_batches import unit_micro_batches
    from rlctl.engines import varlen
    from rlctl.recipes.dpo import sequence_logps

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    units = _keep_units(kind, tok, tiny_model_dir, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa")
    varlen.install(hf.config)
    head_rows = []
    hf.lm_head.register_forward_hook(lambda m, args, out: head_rows.append(args[0].shape[:2]))

    def run(keep: bool, shift: int = 0):
        (mb,) = unit_micro_batches(
            units, 0, 1, packing=layout != "padded", budget=4096, pad_id=tok.pad_token_id, per_micro=3,
            share_prompt=layout == "shared", keep_labelled=keep,
        )  # fmt: skip
        kwargs = {"attention_mask": mb.attention_mask}
        if mb.blocks is not None:
            kwargs = varlen.attention_kwargs(mb.blocks, mb.input_ids)
        elif layout == "packed":
            kwargs = varlen.attention_kwargs(varlen.blocks_from_positions(mb.position_ids), mb.input_ids)
        if keep:
            mb.keep_cols = (mb.keep_cols + shift).clamp(max=mb.input_ids.shape[1] - 1)
            kwargs["logits_to_keep"] = mb.keep_cols
        hf.zero_grad()
        out = hf(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, **kwargs).logits
        logps = sequence_logps(out, mb)
        k = len(logps) // 2
        ref = torch.linspace(-30.0, -10.0, 2 * k)
        b = PrefInputs(logps[0::2], logps[1::2], mb.seq_len[0::2], mb.seq_len[1::2], ref[0::2], ref[1::2])
        loss = get_pref_loss("sigmoid").fn(b, beta=0.1, label_smoothing=0.0, gamma=0.0)[0].sum()
        loss.backward()
        return logps.detach(), loss.detach(), [p.grad.clone() for p in hf.parameters()], mb

    full_logps, full_loss, full_grads, mb_full = run(False)
    logps, loss, grads, mb = run(True)
    width, kept = mb.input_ids.shape[1], mb.keep_cols.numel()
    assert head_rows[0][1] == width and head_rows[1][1] == kept < width  # the head ran at the kept columns only
    assert torch.equal(mb.keep_cols, torch.nonzero((mb.labels >= 0).any(0)).flatten())
    assert logps.tolist() == pytest.approx(full_logps.tolist(), abs=1e-5)
    assert float(loss) == pytest.approx(float(full_loss), abs=1e-5)
    assert max(float((a - b).abs().max() / (a.abs().max() + 1e-12)) for a, b in zip(full_grads, grads)) < 1e-5

    alone = []
    for seq in [s for i in mb.units for s in units[i].seqs]:  # in the micro-batch's order
        ids, labels = torch.as_tensor(seq.input_ids[None]), torch.as_tensor(seq.labels, dtype=torch.long)
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids.long()).logits[0].float(), -1)
        alone.append(float(logp[labels >= 0].gather(1, labels[labels >= 0][:, None]).sum()))
    assert logps.tolist() == pytest.approx(alone, abs=1e-4)
    for shift in (-1, 1):  # the columns one off: the log-probs of other positions' logits
        off = run(True, shift)[0]
        assert (off - full_logps).abs().max() > 0.1
