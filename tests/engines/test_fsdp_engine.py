"""The FSDP2 engine in one process (gloo, world size 1): weights, buffers, packing, LoRA, critic, checkpoints.

The multi-process behaviour (2 ranks, resharding on resume) is covered end to end in test_sft.py.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.support.sft import chat_rows, cpu_plan, cpu_spec, sft_config, write_jsonl

PLAN = SimpleNamespace(**cpu_plan(1))


pytestmark = pytest.mark.usefixtures("process_group")  # one gloo rank for the whole module


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", chat_rows(24))


def make_cfg(tiny_model_dir, data_file, tmp_path, **sets):
    return sft_config(tiny_model_dir, data_file, tmp_path / "run", **sets)


def make_engine(cfg, **kw):
    from rlctl.engines.fsdp import FSDPEngine

    return FSDPEngine(cpu_spec(cfg), **kw)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()


def test_the_builder_is_a_function_of_what_and_where(tiny_model_dir):
    """build_sharded_model needs no engine: a critic built from a BuildSpec and a Placement over the trivial
    (sp 1) grid holds the HF backbone's weights under the critic's names, and its values are its value head
    on the plain backbone's hidden states (the head drawn from the seed on rank 0)."""
    from transformers import AutoModel

    from rlctl.engines.base import model_source
    from rlctl.engines.dims import parallel_dims
    from rlctl.engines.modules import CriticAdapter
    from rlctl.engines.sharding import BuildSpec, Placement, Precision, build_sharded_model

    dims = parallel_dims(1, "cpu")
    assert (dims.dp, dims.dp_rank, dims.sp, dims.sp_group, dims.dp_group) == (1, 0, 1, None, None)
    source = model_source(str(tiny_model_dir))
    installed = []
    spec = BuildSpec(
        adapter=CriticAdapter(),
        source=source,
        hf_config=source.load_config(),
        attn="sdpa",
        lora=None,
        train_vision=False,
        seed=3,
        activation_checkpointing=False,
        selective_checkpointing=False,
        install_attention=installed.append,
    )
    fp32 = torch.float32
    placement = Placement(torch.device("cpu"), dims, True, False, True, Precision(fp32, fp32, fp32, False))
    parts = build_sharded_model(spec, placement)
    assert parts.state is parts.root and parts.hf is parts.root.model and installed == [parts.hf.config]
    backbone = AutoModel.from_pretrained(str(tiny_model_dir), dtype=fp32, attn_implementation="sdpa").eval()
    ids = torch.randint(0, backbone.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        values = parts.root(ids)
        hidden = backbone(input_ids=ids).last_hidden_state
        head = {k: v.full_tensor() for k, v in parts.root.value_head.state_dict().items()}
    want = hidden @ head["weight"].T + head["bias"]
    assert (values - want[..., 0]).abs().max().item() <= 1e-5
    assert head["bias"].abs().max() == 0 and head["weight"].abs().max() > 0


def test_lr_schedule_by_hand():
    from rlctl.engines.schedule import lr_factor

    # 10 steps, warmup int(0.2 * 10) = 2 steps: 1/2, 2/2, then cosine from 1 down to 0.1 at step 10
    assert lr_factor(0, 10, 0.2, 0.1) == pytest.approx(0.5)
    assert lr_factor(1, 10, 0.2, 0.1) == pytest.approx(1.0)
    assert lr_factor(2, 10, 0.2, 0.1) == pytest.approx(1.0)
    assert lr_factor(6, 10, 0.2, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: cos(pi/2) = 0
    assert lr_factor(10, 10, 0.2, 0.1) == pytest.approx(0.1)
    assert lr_factor(3, 10, 0.0, 1.0) == pytest.approx(1.0)  # constant


def test_sharded_model_matches_plain_hf(tiny_model_dir, data_file, tmp_path):
    """Meta init + broadcast from rank 0 gives the HF model exactly, RoPE buffers included."""
    engine = make_engine(make_cfg(tiny_model_dir, data_file, tmp_path), trainable=False)
    ref = hf_model(tiny_model_dir)
    assert torch.equal(engine.model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    ids = torch.randint(0, ref.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40).expand(2, 40)
    with torch.no_grad():
        ours = engine.forward(ids, pos)
        theirs = ref(input_ids=ids, position_ids=pos).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    # full parameters come back with HF names and the HF values
    full = dict(engine.iter_full_params())
    assert set(full) == set(dict(ref.named_parameters()))
    assert all(torch.equal(full[n], p) for n, p in ref.named_parameters())


def test_a_frozen_models_root_is_resharded_after_its_forward(tiny_model_dir, data_file, tmp_path):
    """FSDP2 keeps the root's parameters (embedding, final norm, lm_head) gathered after a forward, for the
    backward that follows: right for the actor, a waste for the reference model, whose root would stay
    gathered on every GPU through rollout and update. After a frozen engine's forward every parameter is a
    shard again (a DTensor); the trainable actor's root stays gathered until its backward."""
    from torch.distributed.tensor import DTensor

    cfg = make_cfg(tiny_model_dir, data_file, tmp_path)
    ids, pos = torch.randint(0, 100, (2, 16)), torch.arange(16).expand(2, 16)
    ref = make_engine(cfg, trainable=False)
    with torch.no_grad():
        ref.forward(ids, pos)
    gathered = [n for n, p in ref.model.named_parameters() if not isinstance(p, DTensor)]
    assert not gathered
    actor = make_engine(cfg)
    loss = actor.forward(ids, pos).float().mean()
    assert any(not isinstance(p, DTensor) for p in actor.model.parameters())  # the check can fail
    loss.backward()
    assert all(isinstance(p, DTensor) for p in actor.model.parameters())


def _docs(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, vocab, (n,), generator=g) for n in (7, 12, 5)]


def _per_doc_losses(model, docs) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for d in docs:
            logits = model(input_ids=d[None], position_ids=torch.arange(len(d))[None]).logits[0]
            out.append(F.cross_entropy(logits[:-1], d[1:], reduction="none"))
    return out


def test_packed_rows_keep_documents_apart(tiny_model_dir):
    """transformers detects packed rows from restarting position ids (attention_mask=None): each
    document's per-token losses equal those of the document alone. With positions that do NOT
    restart, attention leaks across documents and the losses differ (the control)."""
    model = hf_model(tiny_model_dir)
    docs = _docs(model.config.vocab_size)
    alone = _per_doc_losses(model, docs)
    ids = torch.cat(docs)[None]
    restart = torch.cat([torch.arange(len(d)) for d in docs])[None]
    bounds = torch.tensor([0] + [len(d) for d in docs]).cumsum(0).tolist()

    def packed_losses(pos):
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits[0]
        return [
            F.cross_entropy(logits[s : e - 1], ids[0, s + 1 : e], reduction="none")
            for s, e in itertools.pairwise(bounds)
        ]

    packed = packed_losses(restart)
    for a, p in zip(alone, packed):
        assert (a - p).abs().max().item() <= 1e-5
    leaked = packed_losses(torch.arange(ids.shape[1])[None])
    assert (alone[1] - leaked[1]).abs().max().item() > 1e-3


def test_packed_and_padded_micro_batches_give_the_same_loss(tiny_model_dir, data_file, tmp_path):
    """The recipe's collators: one packed row vs right-padded rows, through the engine."""
    from rlctl.data.packing import collate_packed, collate_padded
    from rlctl.data.sft import build_sft_data
    from rlctl.engines.base import load_tokenizer, model_source
    from rlctl.recipes.sft import token_loss_sum

    cfg = make_cfg(tiny_model_dir, data_file, tmp_path)
    tok = load_tokenizer(model_source(cfg.model.name))
    examples = build_sft_data(cfg, tok).train[:5]
    engine = make_engine(cfg, trainable=False)

    def per_token(mb):
        with torch.no_grad():
            logits = engine.forward(mb.input_ids, mb.position_ids, mb.attention_mask)
        keep = mb.labels != -100
        return F.cross_entropy(logits[keep], mb.labels[keep], reduction="none"), token_loss_sum(logits, mb.labels)

    packed, packed_sum = per_token(collate_packed(examples))
    padded, padded_sum = per_token(collate_padded(examples, tok.pad_token_id))
    assert packed.shape == padded.shape and packed.numel() == sum(ex.num_loss_tokens for ex in examples)
    assert (packed - padded).abs().max().item() <= 1e-5
    assert packed_sum.item() == pytest.approx(padded_sum.item(), rel=1e-6)


@pytest.mark.parametrize("layout", ["packed", "padded", "lora"])
def test_sft_lm_head_at_the_labelled_positions_only_gives_the_full_loss_and_gradients(
    layout, tiny_model_dir, data_file, tmp_path
):
    """``keep_labelled`` (the recipe's micro-batches): the engine runs the LM head at the columns that carry a
    label only (the prompts' columns, bar each one's last, and padding never reach it); the loss and every
    gradient equal every position's logits' (fp32, 1e-5). The head at the columns one off (the labels read
    where they belong) gives another loss: what an off-by-one in the kept columns would."""
    from dataclasses import replace

    from rlctl.data.packing import rank_micro_batches
    from rlctl.data.sft import build_sft_data
    from rlctl.engines.base import load_tokenizer, model_source
    from rlctl.recipes.sft import sft_loss_sum

    lora = {"lora__rank": 4, "lora__alpha": 8, "lora__targets": "q_proj,v_proj"} if layout == "lora" else {}
    cfg = make_cfg(tiny_model_dir, data_file, tmp_path, **lora)
    tok = load_tokenizer(model_source(cfg.model.name))
    examples = build_sft_data(cfg, tok).train[:6]
    engine = make_engine(cfg, total_steps=1)
    head_rows = []
    engine.model.get_output_embeddings().register_forward_hook(lambda m, a, out: head_rows.append(a[0].shape[1]))

    def run(keep: bool, shift: int = 0):
        (mb,) = rank_micro_batches(
            examples, 0, 1, packing=layout != "padded", budget=4096, micro_batch_size=6, pad_id=tok.pad_token_id,
            keep_labelled=keep,
        )  # fmt: skip
        cols = mb.keep_cols
        if shift:  # the engine's head one column off; the labels read at the true labelled columns
            mb.keep_cols = (cols + shift).clamp(0, mb.input_ids.shape[1] - 1)

        def loss_fn(out, m):
            loss_sum = sft_loss_sum(out, replace(m, keep_cols=cols))
            return loss_sum / 100.0, loss_sum

        (loss_sum,) = engine.forward_backward([mb], loss_fn)
        grads = {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters() if p.grad is not None}
        engine.model.zero_grad(set_to_none=True)
        return float(loss_sum), grads, mb

    full_loss, full_grads, full_mb = run(False)
    loss, grads, mb = run(True)
    width = mb.input_ids.shape[1]
    expected = torch.nonzero((mb.labels != -100).any(0)).flatten()  # the columns whose logits predict a label
    assert torch.equal(mb.keep_cols, expected) and expected.numel() < width
    assert head_rows[:2] == [width, expected.numel()]  # the head ran at the kept columns only
    assert loss == pytest.approx(full_loss, rel=1e-6, abs=1e-5)
    assert grads.keys() == full_grads.keys() and len(grads) > 0
    for n, g in full_grads.items():
        assert (g - grads[n]).abs().max().item() <= 1e-5 * max(g.abs().max().item(), 1.0), n
    assert max(g.abs().max().item() for g in grads.values()) > 1e-4  # real gradients, not zeros
    for shift in (-1, 1):
        assert abs(run(True, shift)[0] - full_loss) > 1e-2


def _fake_ctx(cfg, plan):
    from rlctl.runtime.dist import Dist

    return SimpleNamespace(cfg=cfg, plan=plan, dist=Dist(0, 1, 0, torch.device("cpu")))


def test_micro_batch_split_does_not_change_the_update(tiny_model_dir, data_file, tmp_path):
    """Loss normalised by the global loss-token count: 1 micro-batch or many give the same step."""
    from rlctl.data.packing import StepSampler
    from rlctl.data.sft import build_sft_data
    from rlctl.engines.base import load_tokenizer, model_source
    from rlctl.recipes.sft import SFTTrainer

    params = []
    for budget in (4096, 96):  # everything in one row vs several rows
        cfg = make_cfg(tiny_model_dir, data_file, tmp_path, train__max_tokens_per_micro_batch=budget)
        tok = load_tokenizer(model_source(cfg.model.name))
        data = build_sft_data(cfg, tok)
        engine = make_engine(cfg, total_steps=4)
        trainer = SFTTrainer(
            _fake_ctx(cfg, PLAN),
            engine,
            data,
            StepSampler(len(data.train), 8, seed=0),
            pad_id=tok.pad_token_id,
            total_steps=4,
        )
        n_micro = len(trainer._micro_batches([data.train[i] for i in trainer.sampler.indices(0)]))
        assert n_micro == 1 if budget > 1000 else n_micro > 1
        grads = {}

        def capture_then_step(engine=engine, grads=grads, step=engine.step):
            grads.update({n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters()})
            return step()

        engine.step = capture_then_step
        params.append((trainer.train_step(0), grads))
    (rec1, g1), (rec2, g2) = params
    assert rec1["loss"] == pytest.approx(rec2["loss"], rel=1e-6)
    assert rec1["grad_norm"] == pytest.approx(rec2["grad_norm"], rel=1e-5)
    for n in g1:
        assert (g1[n] - g2[n]).abs().max().item() <= 1e-5 * g1[n].abs().max().item() + 1e-8, n


def test_lora_yields_merged_weights(tiny_model_dir, data_file, tmp_path):
    cfg = make_cfg(tiny_model_dir, data_file, tmp_path, lora__rank=4, lora__alpha=8, lora__targets="q_proj,v_proj")
    engine = make_engine(cfg, total_steps=1)
    assert engine.lora_info()["r"] == 4
    trainable = [n for n, p in engine.parts.state.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # peft initialises B to zero: give it values so the merge matters
    q = engine.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():  # one rank: the local shard is the whole tensor
        q.lora_B["default"].weight.to_local().copy_(torch.randn(q.lora_B["default"].weight.shape))
    a, b = q.lora_A["default"].weight.full_tensor(), q.lora_B["default"].weight.full_tensor()
    full = dict(engine.iter_full_params())
    base = dict(hf_model(tiny_model_dir).named_parameters())
    assert set(full) == set(base)  # HF names, no peft names
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(full[name], base[name] + (b @ a) * (8 / 4), atol=1e-6)
    assert not torch.allclose(full[name], base[name])
    assert torch.equal(full["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"])
    # the checkpoint keys are peft's names
    keys = set(engine.state_dict()["model"])
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in keys
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in keys


def test_bad_lora_targets_are_a_user_error(tiny_model_dir, data_file, tmp_path):
    from rlctl.errors import UserError

    cfg = make_cfg(tiny_model_dir, data_file, tmp_path, lora__rank=4, lora__targets="q_prj")
    with pytest.raises(UserError, match="q_proj") as e:
        make_engine(cfg, total_steps=1)
    assert "\n" not in str(e.value)


def test_critic_values_and_names(tiny_model_dir, data_file, tmp_path):
    engine = make_engine(make_cfg(tiny_model_dir, data_file, tmp_path), role="critic", total_steps=1)
    ids = torch.randint(0, 100, (2, 9))
    values = engine.forward(ids, torch.arange(9).expand(2, 9))
    assert values.shape == (2, 9) and values.dtype == torch.float32
    names = [n for n, _ in engine.iter_full_params()]
    assert "value_head.weight" in names and "value_head.bias" in names
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" not in names
    # the backbone carries the pretrained weights
    base = dict(hf_model(tiny_model_dir).named_parameters())
    full = dict(engine.iter_full_params())
    assert torch.equal(full["model.layers.1.mlp.up_proj.weight"], base["model.layers.1.mlp.up_proj.weight"])
    values.sum().backward()
    assert engine.step() > 0


def test_checkpoint_save_load_roundtrip(tiny_model_dir, data_file, tmp_path):
    """Model, optimizer and schedule come back; keep_last prunes; a half-written step is ignored."""
    from rlctl.errors import UserError
    from rlctl.runtime.checkpoint import load_checkpoint, save_checkpoint
    from rlctl.runtime.layout import latest_checkpoint, resolve_resume
    from rlctl.runtime.rng import rng_state

    cfg = make_cfg(tiny_model_dir, data_file, tmp_path)
    engine = make_engine(cfg, total_steps=10)
    ids = torch.randint(0, 100, (1, 16))
    pos = torch.arange(16)[None]
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2, 3):
        engine.backward(engine.forward(ids, pos).float().logsumexp(-1).mean())
        engine.step()
        save_checkpoint(
            root,
            step,
            {"": engine},
            trainer_state={"method": "sft"},
            meta_dir=tiny_model_dir,
            rng_state=rng_state(),
            keep_last=2,
        )
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_000002", "step_000003"]
    assert (root / "latest").read_text().strip() == "step_000003"
    assert (root / "step_000003" / "huggingface" / "config.json").is_file()
    (root / ".tmp-step_000004").mkdir()  # as if a save had died
    assert latest_checkpoint(root).name == "step_000003"
    assert resolve_resume("auto", root.parent).name == "step_000003"
    assert resolve_resume(str(root.parent), tmp_path).name == "step_000003"  # a run directory
    assert resolve_resume(str(root / "step_000002"), tmp_path).name == "step_000002"
    with pytest.raises(UserError, match="no complete checkpoint"):
        resolve_resume(str(tmp_path / "nowhere"), tmp_path)
    want = {n: t.clone() for n, t in engine.iter_full_params()}
    want_lr = engine.lr

    fresh = make_engine(cfg, total_steps=10)
    state, rng = load_checkpoint(root / "step_000003", {"": fresh})
    assert state["step"] == 3 and state["world_size"] == 1 and rng is not None
    assert fresh.global_step == 3 and fresh.lr == pytest.approx(want_lr)
    got = dict(fresh.iter_full_params())
    assert all(torch.equal(got[n], want[n]) for n in want)
    # the optimizer state came back too: one more identical step gives identical weights
    for e in (engine, fresh):
        e.backward(e.forward(ids, pos).float().logsumexp(-1).mean())
        e.step()
    a, b = dict(engine.iter_full_params()), dict(fresh.iter_full_params())
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_stop_request_catches_sigint():
    from rlctl.runtime.entry import StopRequest

    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = StopRequest()
        assert not stop.local(1)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.local(1)
        from rlctl.runtime.signals import stop_requested

        assert stop_requested()  # long work (reward calls) sees it too
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _grads_after_one_backward(engine, ids, pos):
    engine.backward(engine.forward(ids, pos).float().logsumexp(-1).mean())
    return {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters()}


def test_activation_checkpointing_gives_the_same_gradients(tiny_model_dir, data_file, tmp_path):
    from rlctl.engines.fsdp import FSDPEngine

    cfg = make_cfg(tiny_model_dir, data_file, tmp_path)
    ids, pos = torch.randint(0, 100, (2, 24)), torch.arange(24).expand(2, 24)
    plain = _grads_after_one_backward(FSDPEngine(cpu_spec(cfg), total_steps=1), ids, pos)
    ckpt_engine = FSDPEngine(cpu_spec(cfg, activation_checkpointing=True), total_steps=1)
    assert ckpt_engine.model.model.gradient_checkpointing
    ckpt = _grads_after_one_backward(ckpt_engine, ids, pos)
    for n in plain:
        assert torch.allclose(plain[n], ckpt[n], atol=1e-6, rtol=1e-5), n


def test_bf16_compute_keeps_fp32_master_weights(tiny_model_dir, data_file, tmp_path):
    from rlctl.engines.fsdp import FSDPEngine

    cfg = make_cfg(tiny_model_dir, data_file, tmp_path)
    engine = FSDPEngine(cpu_spec(cfg, dtype="bf16"), total_steps=1)
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    ids, pos = torch.randint(0, 100, (1, 16)), torch.arange(16)[None]
    logits = engine.forward(ids, pos)
    assert logits.dtype == torch.bfloat16
    with torch.no_grad():
        ref = hf_model(tiny_model_dir)(input_ids=ids, position_ids=pos).logits
    assert (logits.float() - ref).abs().max().item() < 0.1  # bf16 rounding, same model
    engine.backward(logits.float().logsumexp(-1).mean())
    assert math.isfinite(engine.step())
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())


def test_tied_embeddings(tmp_path, data_file):
    """A tied model: one shared weight, yielded once under the embedding's name; logits match HF."""
    from rlctl.testing import build_tiny_model

    tied_dir = build_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    engine = make_engine(make_cfg(tied_dir, data_file, tmp_path), total_steps=1)
    names = [n for n, _ in engine.iter_full_params()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    ref = hf_model(tied_dir)
    ids, pos = torch.randint(0, 100, (1, 12)), torch.arange(12)[None]
    logits = engine.forward(ids, pos)
    with torch.no_grad():
        assert (logits - ref(input_ids=ids, position_ids=pos).logits).abs().max().item() <= 1e-5
    engine.backward(logits.logsumexp(-1).mean())
    engine.step()
    full = dict(engine.iter_full_params())
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert not torch.equal(full["model.embed_tokens.weight"], ref.model.embed_tokens.weight)


def test_lora_keeps_the_frozen_base_in_the_compute_dtype(tiny_model_dir, data_file, tmp_path):
    """With LoRA only the adapters are trained: they get fp32 master weights, the frozen base stays in
    the compute dtype (bf16 here, forced on CPU; fp32 is the CPU default)."""
    from rlctl.engines.fsdp import FSDPEngine

    cfg = make_cfg(tiny_model_dir, data_file, tmp_path, lora__rank=4, lora__targets="q_proj,v_proj")
    engine = FSDPEngine(cpu_spec(cfg, dtype="bf16"), total_steps=1)
    params = dict(engine.parts.state.named_parameters())
    adapters = {n: p for n, p in params.items() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert {p.dtype for p in adapters.values()} == {torch.float32}
    assert {p.dtype for n, p in params.items() if n not in adapters} == {torch.bfloat16}
    base = hf_model(tiny_model_dir)
    q = "model.layers.0.self_attn.q_proj.weight"  # B = 0 at the start: the merged weight is the base
    assert torch.equal(dict(engine.iter_full_params())[q], base.get_parameter(q).to(torch.bfloat16))
    ids, pos = torch.randint(0, 100, (1, 16)), torch.arange(16)[None]
    logits = engine.forward(ids, pos)
    with torch.no_grad():
        ref = base(input_ids=ids, position_ids=pos).logits
    assert logits.dtype == torch.bfloat16 and (logits.float() - ref).abs().max().item() < 0.1
    engine.backward(logits.float().logsumexp(-1).mean())
    assert math.isfinite(engine.step())
    assert {p.dtype for p in adapters.values()} == {torch.float32}
    # on CPU without a forced dtype everything stays fp32
    plain = FSDPEngine(cpu_spec(cfg), total_steps=1)
    assert {p.dtype for p in plain.parts.state.parameters()} == {torch.float32}


class _RecordingEngine:
    """Stands in for an engine in the checkpoint module: records where it was asked to save and load."""

    backend = "megatron"

    def __init__(self):
        self.saved, self.loaded = [], []

    def save_checkpoint(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / ".metadata").write_text("written by the engine")
        self.saved.append(Path(path))

    def load_checkpoint(self, path):
        self.loaded.append(Path(path))

    def lora_info(self):
        return None


def test_checkpoints_are_written_and_read_by_the_engines(tmp_path, tiny_model_dir, data_file):
    """checkpoint.py leaves the files of each model to its engine's save_checkpoint / load_checkpoint
    (the Megatron engine writes megatron-core dist checkpoints there) and keeps the backend in
    trainer_state.json: another backend cannot load it."""
    from rlctl.errors import UserError
    from rlctl.runtime.checkpoint import load_checkpoint, save_checkpoint
    from rlctl.runtime.rng import rng_state

    actor, critic = _RecordingEngine(), _RecordingEngine()
    final = save_checkpoint(
        tmp_path / "ckpts",
        5,
        {"": actor, "critic": critic},
        trainer_state={"method": "ppo"},
        meta_dir=None,
        rng_state=rng_state(),
        keep_last=2,
    )
    tmp = tmp_path / "ckpts" / ".tmp-step_000005"
    assert actor.saved == [tmp] and critic.saved == [tmp / "critic"]  # written before the rename
    assert (final / ".metadata").read_text() == "written by the engine" and (final / "critic" / ".metadata").is_file()
    state, rng = load_checkpoint(final, {"": actor, "critic": critic})
    assert actor.loaded == [final] and critic.loaded == [final / "critic"]
    assert state["backend"] == "megatron" and state["step"] == 5 and rng is not None
    fsdp = make_engine(make_cfg(tiny_model_dir, data_file, tmp_path), trainable=False)
    with pytest.raises(UserError, match=r"saved by the megatron engine; resume it with --set parallel.backend=mega"):
        load_checkpoint(final, {"": fsdp})


def test_build_engine_picks_the_backend_of_the_spec(tiny_model_dir, data_file, tmp_path, monkeypatch):
    from rlctl.engines import build_engine
    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.engines.megatron import engine as megatron_engine

    cfg = make_cfg(tiny_model_dir, data_file, tmp_path)
    engine = build_engine(cpu_spec(cfg), role="ref", trainable=False)
    assert isinstance(engine, FSDPEngine) and engine.backend == "fsdp" and engine.role == "ref"
    assert (engine.dp_rank, engine.dp_size, engine.dp_group, engine.mp_size) == (0, 1, None, 1)
    calls = []
    monkeypatch.setattr(megatron_engine, "MegatronEngine", lambda spec, **kw: calls.append((spec, kw)) or "mg")
    spec = cpu_spec(cfg, backend="megatron")
    assert build_engine(spec, role="actor", total_steps=7) == "mg"
    assert calls == [(spec, {"role": "actor", "trainable": True, "total_steps": 7, "source": None})]


def test_engine_spec_reads_the_resolved_config_once(tiny_model_dir, data_file, tmp_path):
    """EngineSpec.from_config reads the config the planner resolved (apply_plan); an "auto" or a None left
    (the plan not applied) is an internal error naming the field."""
    from rlctl.engines.spec import EngineSpec, LoraSpec, OptimizerSpec, UnresolvedConfig
    from rlctl.errors import UserError
    from rlctl.plan import apply_plan

    raw = make_cfg(
        tiny_model_dir, data_file, tmp_path, parallel__offload_optimizer=True, model__attn="auto"
    )  # reads as None
    plan = SimpleNamespace(**cpu_plan(1, backend="megatron", tp=2, pp=1, ep=1, sp=2, activation_checkpointing=True))
    assert EngineSpec.from_config(apply_plan(raw, plan)) == EngineSpec(
        backend="megatron",
        device="cpu",
        dtype="fp32",
        tp=2,
        pp=1,
        cp=1,
        ep=1,
        sp=2,  # from the plan (None in the config)
        sequence_parallel=False,
        activation_checkpointing=True,  # from the plan ("auto" in the config)
        offload_params=False,
        offload_optimizer=True,  # the user's choice wins over the plan's False
        attn=None,  # the engine picks at run time
        micro_batch_size=2,
        model=str(tiny_model_dir),
        seed=raw.train.seed,
        max_seq_len=max(raw.train.max_len, raw.rollout.max_prompt_len + raw.rollout.max_response_len),
        optimizer=OptimizerSpec(
            lr=raw.train.lr,
            weight_decay=raw.train.weight_decay,
            betas=tuple(raw.train.betas),
            grad_clip=raw.train.grad_clip,
            warmup_ratio=raw.train.warmup_ratio,
            min_lr_ratio=raw.train.min_lr_ratio,
        ),
        lora=LoraSpec(rank=raw.lora.rank, alpha=raw.lora.alpha, dropout=raw.lora.dropout, targets=raw.lora.targets),
    )
    assert LoraSpec(rank=4).scaled_alpha == 8 and LoraSpec(rank=4, alpha=3.0).scaled_alpha == 3.0
    assert LoraSpec(targets="q_proj, v_proj").target_modules == ["q_proj", "v_proj"]
    assert LoraSpec().target_modules == "all-linear"
    with pytest.raises(UnresolvedConfig, match="parallel.backend is None"):
        EngineSpec.from_config(raw)
    resolved = apply_plan(raw, SimpleNamespace(**cpu_plan(1)))
    resolved.parallel.sequence_parallel = None
    with pytest.raises(UnresolvedConfig, match="parallel.sequence_parallel is None"):
        EngineSpec.from_config(resolved)
    resolved.parallel.sequence_parallel, resolved.parallel.tp = False, 0
    with pytest.raises(UnresolvedConfig, match="parallel.tp is 0"):
        EngineSpec.from_config(resolved)
    resolved.parallel.tp, resolved.model.dtype = 1, None
    with pytest.raises(UnresolvedConfig, match="model.dtype is None"):
        EngineSpec.from_config(resolved)
    assert not issubclass(UnresolvedConfig, UserError)  # a bug of the caller, never the user's input
    with pytest.raises(UserError, match="fdsp"):  # a misspelt backend is the user's: the config rejects it
        make_cfg(tiny_model_dir, data_file, tmp_path, parallel__backend="fdsp")


@pytest.mark.parametrize("share_prefix", [False, True])
def test_rl_log_prob_passes_run_the_lm_head_at_the_response_positions_only(share_prefix, tiny_model_dir, tmp_path):
    """GRPO / PPO's log-prob passes (old, reference): the head runs at the positions that predict a response
    token only (packed: ``logit_index``; shared prompts: ``keep_cols``), and the log-probs equal a plain
    forward's every-position logits, each sample alone (fp32)."""
    import numpy as np

    from rlctl.config import build_config, dotted_to_nested
    from rlctl.recipes.rl.batch import RolloutBatch
    from rlctl.recipes.rl.passes import compute_logprobs

    cfg = build_config("grpo", [dotted_to_nested({"model.name": str(tiny_model_dir)})])
    engine = make_engine(cfg, total_steps=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=k).tolist() for k in (11, 17, 8)]
    responses = [rng.integers(3, 500, size=int(rng.integers(2, 9))).tolist() for _ in range(6)]
    batch = RolloutBatch.build(
        [prompts[i // 2] for i in range(6)], responses, [[0.0] * len(r) for r in responses], list(range(6)),
        n=2, batch_size=3, mini_batch_size=0, width=8,
    )  # fmt: skip
    head_rows = []
    engine.model.get_output_embeddings().register_forward_hook(lambda m, a, out: head_rows.append(a[0].shape[1]))
    logp, _ = compute_logprobs(engine, batch, temperature=1.0, budget=4096, pad_id=0, share_prefix=share_prefix)
    if share_prefix:  # a row per prompt, its prompt once: its last column, then its samples' responses bar their last
        cols = [{len(p) - 1, *range(len(p), len(p) + len(responses[2 * g]) + len(responses[2 * g + 1]) - 2)}
                for g, p in enumerate(prompts)]  # fmt: skip
        assert head_rows == [len(set().union(*cols))] and len(cols[1]) < len(prompts[1])
    else:  # packed samples: the positions that predict a response token
        assert head_rows == [sum(len(r) for r in responses)]
    for i, (p, r) in enumerate(zip(batch.prompts, responses)):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            full = torch.log_softmax(engine.forward(ids, torch.arange(ids.shape[1])[None]).float(), -1)[0]
        want = full[len(p) - 1 : len(p) + len(r) - 1].gather(1, torch.tensor(r)[:, None])[:, 0]
        assert (logp[i, : len(r)] - want).abs().max().item() < 1e-5
