"""HF <-> Megatron (megatron-core GPTModel) weight layout and checkpoint files.

* HF -> rlctl Megatron shards (tp, pp) -> HF is bit-exact (Qwen2 with QKV bias, tied and untied, Qwen3
  with q/k norm and head_dim != hidden/heads, Llama, bf16).
* Every tensor of every rank equals the slice of the HF tensors derived here by explicit index
  arithmetic (per head / per row loops), not by the code under test.
* With megatron-core installed: a real GPTModel (CPU, gloo) loads the shards with every parameter set,
  reproduces HF's logits, and saves a torch_dist dist checkpoint, which rlctl converts back to HF
  tensor-exactly (tp=2 under torchrun, both dist layouts; tp=1 and tp=2 x pp=2 are marked slow).
* Bad inputs raise UserError.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from rlctl.convert.megatron_io import (  # noqa: E402
    detect_megatron_format,
    load_megatron_to_hf,
    save_hf_from_megatron,
    save_megatron_shards,
)
from rlctl.errors import UserError  # noqa: E402
from rlctl.formats.megatron_layout import (  # noqa: E402
    MegatronLayoutConfig,
    hf_to_megatron_shards,
    megatron_shard_for_rank,
)
from tests.support.cli import torchrun  # noqa: E402

HELPER = Path(__file__).resolve().parents[1] / "support" / "scripts" / "mcore_save.py"
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
needs_mcore = pytest.mark.skipif(
    not HAVE_MCORE, reason="megatron-core is not installed (pip install --no-deps megatron-core==0.16.1)"
)

# Tiny GQA models: 4 query heads in 2 kv groups, 4 layers, ffn 256, vocab 300 (padded by Megatron to
# a multiple of 128 * tp: 384 for tp=1, 512 for tp=2).
HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, VOCAB = 128, 4, 2, 4, 256, 300
PADDED_VOCAB = {1: 384, 2: 512}
HEAD_DIM = {"qwen2": 32, "llama": 32, "qwen3": 48}  # Qwen3: head_dim * heads != hidden


def _build_hf(arch: str, tied: bool, dtype: torch.dtype, path: Path) -> None:
    import transformers

    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[arch]
    config = config_cls(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=LAYERS,
        intermediate_size=FFN,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        head_dim=HEAD_DIM[arch],
    )
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():  # norms and biases start at 1 / 0: make them distinct so a mix-up shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """``hf_model(arch, tied, dtype) -> HF model dir`` (built once per combination)."""
    cache: dict[tuple, Path] = {}

    def get(arch: str, tied: bool = False, dtype: torch.dtype = torch.float32) -> Path:
        key = (arch, tied, dtype)
        if key not in cache:
            cache[key] = tmp_path_factory.mktemp(f"hf_{arch}_{'tied' if tied else 'untied'}")
            _build_hf(arch, tied, dtype, cache[key])
        return cache[key]

    return get


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(hf_dir / "model.safetensors")


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


# ----------------------------------------------------------------------------- round trip


CASES = [("qwen2", False, torch.float32), ("qwen2", True, torch.float32), ("qwen3", False, torch.float32)]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("arch,tied,dtype", CASES + [("llama", False, torch.bfloat16)])
def test_roundtrip_bit_exact(hf_model, tmp_path, arch, tied, dtype, tp, pp):
    hf_dir = hf_model(arch, tied, dtype)
    save_megatron_shards(hf_dir, tmp_path / "mg", tp, pp)
    assert detect_megatron_format(tmp_path / "mg") == "rlctl-shards"
    meta = json.loads((tmp_path / "mg" / "rlctl_megatron.json").read_text())
    assert (meta["tp"], meta["pp"], meta["padded_vocab_size"]) == (tp, pp, PADDED_VOCAB[tp])
    assert (tmp_path / "mg" / "huggingface" / "config.json").is_file()
    _assert_same_tensors(dict(load_megatron_to_hf(tmp_path / "mg")), _hf_tensors(hf_dir))


def test_save_hf_writes_loadable_sharded_model(hf_model, tmp_path):
    import transformers

    hf_dir = hf_model("qwen2", True)
    save_megatron_shards(hf_dir, tmp_path / "mg", 2, 2)
    out = save_hf_from_megatron(tmp_path / "mg", tmp_path / "hf", max_shard_bytes=300_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not list(out.glob("*.tmp"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    want = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    _assert_same_tensors(model.state_dict(), want.state_dict())


# ----------------------------------------------------------------------------- independent layout check


def _expected_rank(
    hf: dict[str, torch.Tensor], arch: str, tied: bool, tp: int, pp: int, t: int, p: int
) -> dict[str, torch.Tensor]:
    """Rank (t, p)'s Megatron tensors, built row by row from the layout description."""
    d = HEAD_DIM[arch]
    per_rank_vocab = PADDED_VOCAB[tp] // tp
    kv_per_rank, q_per_kv, heads_per_rank = KV_HEADS // tp, HEADS // KV_HEADS, HEADS // tp
    ffn = FFN // tp

    def vocab_rows(w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(per_rank_vocab, HIDDEN, dtype=w.dtype)
        for r in range(per_rank_vocab):
            if t * per_rank_vocab + r < VOCAB:
                out[r] = w[t * per_rank_vocab + r]
        return out

    exp: dict[str, torch.Tensor] = {}
    if p == 0:
        exp["embedding.word_embeddings.weight"] = vocab_rows(hf["model.embed_tokens.weight"])
    per_stage = LAYERS // pp
    for i in range(per_stage):
        hfp, mgp = f"model.layers.{p * per_stage + i}.", f"decoder.layers.{i}."

        def fused(kind: str, hfp: str = hfp) -> torch.Tensor:
            q, k, v = (hf[f"{hfp}self_attn.{n}_proj.{kind}"] for n in "qkv")
            rows = []
            for group in range(t * kv_per_rank, (t + 1) * kv_per_rank):
                for head in range(group * q_per_kv, (group + 1) * q_per_kv):
                    rows.append(q[head * d : (head + 1) * d])
                rows += [k[group * d : (group + 1) * d], v[group * d : (group + 1) * d]]
            return torch.cat(rows)

        exp[mgp + "self_attention.linear_qkv.layer_norm_weight"] = hf[hfp + "input_layernorm.weight"]
        exp[mgp + "self_attention.linear_qkv.weight"] = fused("weight")
        if arch == "qwen2":
            exp[mgp + "self_attention.linear_qkv.bias"] = fused("bias")
        if arch == "qwen3":
            exp[mgp + "self_attention.q_layernorm.weight"] = hf[hfp + "self_attn.q_norm.weight"]
            exp[mgp + "self_attention.k_layernorm.weight"] = hf[hfp + "self_attn.k_norm.weight"]
        o = hf[hfp + "self_attn.o_proj.weight"]
        exp[mgp + "self_attention.linear_proj.weight"] = o[:, t * heads_per_rank * d : (t + 1) * heads_per_rank * d]
        exp[mgp + "mlp.linear_fc1.layer_norm_weight"] = hf[hfp + "post_attention_layernorm.weight"]
        gate, up = hf[hfp + "mlp.gate_proj.weight"], hf[hfp + "mlp.up_proj.weight"]
        exp[mgp + "mlp.linear_fc1.weight"] = torch.cat([gate[t * ffn : (t + 1) * ffn], up[t * ffn : (t + 1) * ffn]])
        exp[mgp + "mlp.linear_fc2.weight"] = hf[hfp + "mlp.down_proj.weight"][:, t * ffn : (t + 1) * ffn]
    if p == pp - 1:
        exp["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not tied:
            exp["output_layer.weight"] = vocab_rows(hf["lm_head.weight"])
        elif pp > 1:  # megatron's last stage keeps a copy of the tied embedding
            exp["output_layer.weight"] = vocab_rows(hf["model.embed_tokens.weight"])
    return exp


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("arch,tied,dtype", CASES)
def test_rank_tensors_match_index_arithmetic(hf_model, tmp_path, arch, tied, dtype, tp, pp):
    hf_dir = hf_model(arch, tied, dtype)
    hf = _hf_tensors(hf_dir)
    save_megatron_shards(hf_dir, tmp_path, tp, pp)
    cfg = MegatronLayoutConfig.from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    in_memory = hf_to_megatron_shards(hf, cfg, tp, pp)
    assert sorted(in_memory) == [(t, p) for t in range(tp) for p in range(pp)]
    for t in range(tp):
        for p in range(pp):
            want = _expected_rank(hf, arch, tied, tp, pp, t, p)
            _assert_same_tensors(load_file(tmp_path / f"mp_rank_{t:02d}_{p:03d}" / "model.safetensors"), want)
            _assert_same_tensors(in_memory[(t, p)], want)


# ----------------------------------------------------------------------------- real megatron-core


def _hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def _real_megatron(hf_dirs: list[Path], tmp_path: Path, tp: int, pp: int, singleton: bool = False) -> list[Path]:
    """HF -> rlctl shards -> a real GPTModel per model, in one launch of the helper (tp * pp processes).

    Checks HF's logits when pp == 1; returns each model's output dir (dist checkpoints in ``dist``,
    ``dist_singleton``).
    """
    tmp_path.mkdir(exist_ok=True)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, tmp_path / "tokens.pt")
    args = ["--tp", str(tp), "--pp", str(pp), "--tokens", str(tmp_path / "tokens.pt")]
    args += ["--singleton"] if singleton else []
    outs = []
    for n, hf_dir in enumerate(hf_dirs):
        save_megatron_shards(hf_dir, tmp_path / f"shards{n}", tp, pp)
        outs.append(tmp_path / f"mc{n}")
        outs[-1].mkdir()
        args += ["--model", str(tmp_path / f"shards{n}"), str(outs[-1])]
    nproc = tp * pp
    cmd = [sys.executable, str(HELPER), *args] if nproc == 1 else torchrun(nproc, HELPER, *args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"megatron helper failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for hf_dir, out in zip(hf_dirs, outs):
        if pp == 1:
            logits = torch.cat([torch.load(out / f"logits_tp{r}.pt") for r in range(tp)], dim=-1)
            assert logits.shape == (2, 9, PADDED_VOCAB[tp])
            torch.testing.assert_close(logits[..., :VOCAB], _hf_logits(hf_dir, tokens), atol=1e-5, rtol=0)
            assert torch.count_nonzero(logits[..., VOCAB:]) == 0  # padded vocab rows are zero
    return outs


@needs_mcore
def test_real_megatron_dist_checkpoint_tp2(hf_model, tmp_path):
    """tp=2 under torchrun: Qwen3 (q/k norm, untied) in both dist layouts, read with an explicit HF config;
    Qwen2 (QKV bias, tied) read back from a verl-style actor dir."""
    qwen3, qwen2 = hf_model("qwen3"), hf_model("qwen2", True)
    out3, out2 = _real_megatron([qwen3, qwen2], tmp_path, tp=2, pp=1, singleton=True)
    for name in ("dist", "dist_singleton"):
        assert detect_megatron_format(out3 / name) == "torch_dist"
        _assert_same_tensors(dict(load_megatron_to_hf(out3 / name, hf_config=qwen3)), _hf_tensors(qwen3))
    actor = tmp_path / "actor"
    actor.mkdir()
    (out2 / "dist").rename(actor / "dist_ckpt")
    shutil.copytree(tmp_path / "shards1" / "huggingface", actor / "huggingface")
    converted = save_hf_from_megatron(actor, tmp_path / "hf_out")
    assert (converted / "config.json").is_file()
    _assert_same_tensors(_hf_tensors(converted), _hf_tensors(qwen2))


@needs_mcore
@pytest.mark.slow
def test_real_megatron_dist_checkpoint_tp1_and_tp2_pp2(hf_model, tmp_path):
    """One process (no torchrun), and tp=2 x pp=2 (4 processes, tied: the last stage's output_layer copy)."""
    qwen3, qwen2 = hf_model("qwen3"), hf_model("qwen2", True)
    (out,) = _real_megatron([qwen3], tmp_path / "tp1", tp=1, pp=1)
    _assert_same_tensors(dict(load_megatron_to_hf(out / "dist", hf_config=qwen3)), _hf_tensors(qwen3))
    (out,) = _real_megatron([qwen2], tmp_path / "tp2pp2", tp=2, pp=2)
    _assert_same_tensors(dict(load_megatron_to_hf(out / "dist", hf_config=qwen2)), _hf_tensors(qwen2))


# ----------------------------------------------------------------------------- bad inputs


def _config(hf_dir: Path) -> dict:
    return json.loads((hf_dir / "config.json").read_text())


@pytest.mark.parametrize("tp,message", [(3, "valid tp: 1, 2"), (4, "replicating kv heads is not supported")])
def test_tp_not_dividing_heads(hf_model, tmp_path, tp, message):
    with pytest.raises(UserError, match=message):
        save_megatron_shards(hf_model("qwen2"), tmp_path, tp, 1)
    assert not tmp_path.joinpath("mp_rank_00_000").exists()


def test_pp_not_dividing_layers(hf_model):
    cfg = MegatronLayoutConfig.from_hf_config(_config(hf_model("qwen2")))
    with pytest.raises(UserError, match="pp=3 does not divide the model's 4 layers; valid pp: 1, 2, 4"):
        megatron_shard_for_rank(lambda name: None, cfg, 1, 3, 0, 0)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "'GPT2LMHeadModel' has no Megatron layout"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": True}, "o_proj"),
    ],
)
def test_unsupported_architecture(hf_model, change, message):
    with pytest.raises(UserError, match=message):
        MegatronLayoutConfig.from_hf_config({**_config(hf_model("qwen2")), **change})


def test_missing_shard_file(hf_model, tmp_path):
    save_megatron_shards(hf_model("qwen2"), tmp_path / "mg", 2, 1)
    shutil.rmtree(tmp_path / "mg" / "mp_rank_01_000")
    with pytest.raises(UserError, match=r"missing shard file .*mp_rank_01_000.*tp=2, pp=1"):
        load_megatron_to_hf(tmp_path / "mg")


def test_not_a_checkpoint_and_torch_dist_without_config(hf_model, tmp_path):
    with pytest.raises(UserError, match="not a Megatron checkpoint"):
        load_megatron_to_hf(tmp_path)
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert detect_megatron_format(tmp_path) == "torch_dist"
    with pytest.raises(UserError, match="holds no HF config"):
        load_megatron_to_hf(tmp_path)


def test_refuses_non_empty_output(hf_model, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        save_megatron_shards(hf_model("qwen2"), tmp_path, 1, 1)
