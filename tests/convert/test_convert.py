"""`rlctl convert`: FSDP2 checkpoints (rlctl DCP, verl rank files, HSDP) -> HF, LoRA folding,
inspect, verification, the streaming HF writer, Megatron wiring and every user error.

The FSDP2 checkpoints come from one real 2-process torchrun on gloo
(tests/support/scripts/make_fsdp_checkpoints.py) that also saves the gathered full state dict
(``full_tensor()``) as the truth; LoRA folds are checked against the formula computed here.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlctl.errors import UserError
from tests.support.cli import convert_cli as cli

HELPER = Path(__file__).resolve().parents[1] / "support" / "scripts" / "make_fsdp_checkpoints.py"


# ----------------------------------------------------------------------------- helpers


def flat(text: str) -> str:
    """Rich wraps long lines to the terminal width: join them back for substring checks."""
    return " ".join(text.split())


def read_model(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def hf_logits(state_or_dir, config_dir: Path | None = None) -> torch.Tensor:
    """Logits of a fresh transformers model on fixed tokens, from a saved dir or a state dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(state_or_dir, Path):
        model = AutoModelForCausalLM.from_pretrained(str(state_or_dir), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config_dir)), dtype=torch.float32)
        model.load_state_dict(state_or_dir, strict=False)
    ids = torch.arange(24).reshape(2, 12) * 7 % model.config.vocab_size
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    """One torchrun launch writing every FSDP2 scenario (see the helper's docstring)."""
    root = tmp_path_factory.mktemp("fsdp")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HELPER),
        str(root),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


def reference(ckpts: Path, scenario: str) -> dict[str, torch.Tensor]:
    return torch.load(ckpts / scenario / "reference.pt")


# ----------------------------------------------------------------------------- FSDP2 -> HF


CASES = {
    "plain-rlctl-run-dir": ("plain", "rlctl"),
    "plain-verl-root": ("plain", "verl"),
    "tied-rlctl-step-dir": ("tied", "rlctl/checkpoints/step_000002"),
    "tied-verl-global-step": ("tied", "verl/global_step_2"),
    "hsdp-verl-actor": ("hsdp", "verl/global_step_2/actor"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_checkpoint_converts_to_the_trained_model(ckpts, tmp_path, case):
    from rlctl.convert.pipeline import fsdp_to_hf

    scenario, sub = CASES[case]
    out = tmp_path / "hf"
    result = fsdp_to_hf(ckpts / scenario / sub, out)
    assert result.committed and result.verdict.ok, result.verdict.to_dict()
    assert result.checkpoint.step == 2
    truth = reference(ckpts, scenario)
    got = read_model(out)
    tied = scenario == "tied"
    assert set(got) == set(truth) - ({"lm_head.weight"} if tied else set())
    for name, tensor in got.items():
        assert torch.equal(tensor, truth[name]), name
    if scenario == "plain":  # the odd-length buffer is taken once, not concatenated across ranks
        assert torch.equal(got["model.norm.calib"], torch.arange(5, dtype=torch.float32) + 0.5)
    # the step-1 weights differ: the converter really read step 2
    init = load_file(ckpts / scenario / "init" / "model.safetensors")
    assert not torch.equal(init["model.layers.0.mlp.up_proj.weight"], got["model.layers.0.mlp.up_proj.weight"])
    config_dir = ckpts / scenario / "init"
    torch.testing.assert_close(hf_logits(out), hf_logits(truth, config_dir), rtol=0, atol=1e-6)
    if tied:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(out))
        assert torch.equal(model.lm_head.weight, truth["lm_head.weight"])


@pytest.mark.slow
def test_latest_step_is_announced_and_dtype_and_shards(ckpts, tmp_path):
    code, output = cli(
        "fsdp-to-hf",
        str(ckpts / "plain" / "verl"),
        str(tmp_path / "bf16"),
        "--dtype",
        "bf16",
        "--max-shard-size",
        "300KB",
    )
    assert code == 0, output
    assert "global_step_2" in flat(output) and "PASSED" in output
    out = tmp_path / "bf16"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    truth = reference(ckpts, "plain")
    for name, tensor in read_model(out).items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, truth[name].bfloat16()), name
    for f in ("tokenizer.json", "generation_config.json", "chat_template.jinja"):
        assert (out / f).is_file()


def lora_expectation(truth: dict[str, torch.Tensor], scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """W + scale * B @ A for every LoRA module of a peft state dict, worked out here independently."""
    expected = {}
    for key, tensor in truth.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        module = name.removesuffix(".weight")
        a_key = f"base_model.model.{module}.lora_A.default.weight"
        if a_key in truth:
            a, b = truth[a_key], truth[f"base_model.model.{module}.lora_B.default.weight"]
            kind = module.rsplit(".", 1)[1]
            tensor = tensor + scales[kind] * (b @ a)
        expected[name] = tensor
    return expected


LORA_SCALES = {
    "lora": {"q_proj": 8 / 4, "v_proj": 8 / 4},
    # rsLoRA: alpha / sqrt(r); gate_proj has r=2 (rank_pattern), o_proj alpha=16 (alpha_pattern)
    "rslora": {"q_proj": 8 / 2, "k_proj": 8 / 2, "v_proj": 8 / 2, "o_proj": 16 / 2, "gate_proj": 8 / math.sqrt(2)},
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario,sub", [("lora", "rlctl"), ("lora", "verl"), ("rslora", "rlctl"), ("rslora", "verl")])
def test_lora_checkpoint_is_folded_by_the_formula(ckpts, tmp_path, scenario, sub):
    from rlctl.convert.pipeline import fsdp_to_hf

    truth = reference(ckpts, scenario)
    b = truth["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    assert b.abs().sum() > 0  # training moved B off zero, so folding matters
    result = fsdp_to_hf(ckpts / scenario / sub, tmp_path / "hf")
    assert result.committed and result.verdict.ok, result.verdict.to_dict()
    kinds = LORA_SCALES[scenario]
    assert result.folded == sorted(
        f"model.layers.{i}.{'mlp' if k == 'gate_proj' else 'self_attn'}.{k}" for i in range(2) for k in kinds
    )
    expected = lora_expectation(truth, kinds)
    got = read_model(tmp_path / "hf")
    assert set(got) == set(expected)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-6, atol=1e-7, msg=name)
    unfolded = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(got[unfolded], truth[f"base_model.model.{unfolded}"])


@pytest.mark.slow
def test_keep_adapter_writes_a_peft_adapter(ckpts, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    code, output = cli("fsdp-to-hf", str(ckpts / "lora" / "rlctl"), str(out), "--keep-adapter")
    assert code == 0, output
    truth = reference(ckpts, "lora")
    got = read_model(out)
    for key, tensor in truth.items():
        if ".lora_" not in key:
            name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(got[name], tensor), name
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(out)), str(out / "adapter"))
    ids = torch.arange(24).reshape(2, 12) * 7 % model.config.vocab_size
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits
    expected = lora_expectation(truth, LORA_SCALES["lora"])
    torch.testing.assert_close(logits, hf_logits(expected, ckpts / "lora" / "init"), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_inspect_describes_checkpoints(ckpts, tmp_path):
    from rlctl.convert.inspect import inspect_checkpoint

    info = inspect_checkpoint(ckpts / "hsdp" / "verl")
    assert info["format"] == "verl-fsdp" and info["world_size"] == 2 and info["step"] == 2
    assert info["mesh"] == {"shape": [2, 1], "dims": ["ddp", "fsdp"]}
    truth = reference(ckpts, "hsdp")
    assert info["params"] == sum(t.numel() for t in truth.values()) and info["lora"] is None
    info = inspect_checkpoint(ckpts / "rslora" / "rlctl")
    assert info["format"] == "rlctl-dcp" and info["lora"]["r"] == 4 and info["lora"]["use_rslora"]
    assert info["lora"]["modules"] == 10
    code, output = cli("inspect", str(ckpts / "plain" / "init"), "--json")
    assert code == 0 and json.loads(output)["format"] == "hf"


@pytest.mark.slow
def test_failed_verification_writes_nothing_and_exits_1(ckpts, tmp_path, monkeypatch):
    from rlctl.convert import lora

    real = lora.base_tensors
    calls = []

    def corrupt_first_stream(source, layout):
        calls.append(1)
        for name, tensor in real(source, layout):
            yield name, (tensor + 1e-3 if len(calls) == 1 and name.endswith("up_proj.weight") else tensor)

    monkeypatch.setattr(lora, "base_tensors", corrupt_first_stream)
    out = tmp_path / "hf"
    code, output = cli("fsdp-to-hf", str(ckpts / "plain" / "verl"), str(out))
    assert code == 1, output
    assert "FAIL" in output and "was not written" in flat(output)
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


def broken_copy(ckpts: Path, tmp_path: Path) -> Path:
    actor = tmp_path / "actor"
    shutil.copytree(ckpts / "plain" / "verl" / "global_step_2" / "actor", actor)
    return actor


@pytest.mark.slow
def test_bad_inputs_are_one_clear_line(ckpts, tmp_path):
    out = str(tmp_path / "out")
    actor = broken_copy(ckpts, tmp_path)
    (actor / "model_world_size_2_rank_1.pt").unlink()
    code, msg = cli("fsdp-to-hf", str(actor), out)
    assert code == 2 and "missing model_world_size_2_rank_1.pt" in msg

    shutil.rmtree(actor)
    actor = broken_copy(ckpts, tmp_path)
    shutil.copy(actor / "model_world_size_2_rank_0.pt", actor / "model_world_size_4_rank_0.pt")
    code, msg = cli("fsdp-to-hf", str(actor), out)
    assert code == 2 and "mixed world sizes (2, 4)" in msg

    (actor / "model_world_size_4_rank_0.pt").unlink()
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    code, msg = cli("fsdp-to-hf", str(actor), out)
    assert code == 2 and "fsdp_config.json: world_size 4" in msg

    (actor / "fsdp_config.json").unlink()  # absent: the world size comes from the file names
    config = json.loads((actor / "huggingface" / "config.json").read_text())
    (actor / "huggingface" / "config.json").write_text(json.dumps(dict(config, intermediate_size=512)))
    code, msg = cli("fsdp-to-hf", str(actor), out)
    assert code == 2 and "mlp.gate_proj.weight has shape [256, 128] but config.json implies [512, 128]" in msg

    (tmp_path / "empty").mkdir()
    code, msg = cli("fsdp-to-hf", str(tmp_path / "empty"), out)
    assert code == 2 and "unknown checkpoint format" in msg
    code, msg = cli("fsdp-to-hf", str(ckpts / "plain" / "init"), out)
    assert code == 2 and "already a Hugging Face model" in msg
    code, msg = cli("fsdp-to-hf", str(tmp_path / "nope"), out)
    assert code == 2 and "does not exist" in msg
    code, msg = cli("fsdp-to-hf", str(ckpts / "plain" / "verl"), str(tmp_path), "--no-verify")
    assert code == 2 and "already exists; pass --force" in msg
    code, msg = cli("fsdp-to-hf", str(ckpts / "plain" / "verl"), out, "--dtype", "bf61")
    assert code == 2 and "unknown --dtype" in msg

    step = tmp_path / "lora_step"
    shutil.copytree(ckpts / "lora" / "rlctl" / "checkpoints" / "step_000002", step)
    shutil.rmtree(step / "lora_adapter")
    code, msg = cli("fsdp-to-hf", str(step), out)
    assert code == 2 and "no lora_adapter/adapter_config.json" in msg
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_real_cli_entry_point_exit_codes(ckpts, tmp_path):
    from tests.support.cli import run_cli

    try:
        import rlctl.cli.app  # noqa: F401
    except ImportError as e:  # the lead's app module wires every sub-app
        pytest.skip(f"rlctl.cli.app not importable yet: {e}")
    proc = run_cli("convert", "fsdp-to-hf", str(tmp_path / "missing"), str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr
    proc = run_cli("convert", "inspect", str(ckpts / "tied" / "verl"), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["format"] == "verl-fsdp"


# ----------------------------------------------------------------------------- lora-merge (no torchrun)


def test_lora_merge_matches_the_formula(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["o_proj", "down_proj", "embed_tokens"], use_rslora=True)
    peft_model = get_peft_model(model, config)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    lora_state = {k: v.clone() for k, v in peft_model.state_dict().items() if "lora_" in k}
    out = tmp_path / "merged"
    code, output = cli("lora-merge", str(tiny_model_dir), str(tmp_path / "adapter"), str(out))
    assert code == 0, output
    assert "folded LoRA into 5 module(s)" in flat(output) and "PASSED" in output
    base = load_file(tiny_model_dir / "model.safetensors")
    got = read_model(out)
    assert set(got) == set(base)
    scale = 16 / math.sqrt(4)
    for name, w in base.items():
        prefix = f"base_model.model.{name.removesuffix('.weight')}"
        if f"{prefix}.lora_A.default.weight" in lora_state:
            w = (
                w
                + scale * lora_state[f"{prefix}.lora_B.default.weight"] @ lora_state[f"{prefix}.lora_A.default.weight"]
            )
        elif f"{prefix}.lora_embedding_A.default" in lora_state:  # embeddings: (B @ A) transposed
            w = (
                w
                + scale
                * (
                    lora_state[f"{prefix}.lora_embedding_B.default"] @ lora_state[f"{prefix}.lora_embedding_A.default"]
                ).T
            )
        torch.testing.assert_close(got[name], w, rtol=1e-6, atol=1e-7, msg=name)
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.embed_tokens.weight"):
        assert not torch.equal(got[name], base[name])


def test_lora_merge_bad_adapter(tiny_model_dir, tmp_path):
    (tmp_path / "adapter").mkdir()
    code, msg = cli("lora-merge", str(tiny_model_dir), str(tmp_path / "adapter"), str(tmp_path / "out"))
    assert code == 2 and "no adapter_config.json" in msg
    (tmp_path / "adapter" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True})
    )
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    code, msg = cli("lora-merge", str(tiny_model_dir), str(tmp_path / "adapter"), str(tmp_path / "out"))
    assert code == 2 and "DoRA" in msg
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    code, msg = cli("lora-merge", str(tiny_model_dir), str(tmp_path / "adapter"), str(tmp_path / "out"))
    assert code == 2 and "adapter_model.safetensors: not a readable safetensors file" in msg


# ----------------------------------------------------------------------------- the HF writer


def test_writer_streams_odd_sizes_and_mixed_dtypes(tiny_model_dir, tmp_path, monkeypatch):
    import rlctl.formats.hf_writer as w

    monkeypatch.setattr(w, "_STREAM_AFTER", 0)  # stream every tensor to disk behind a reserved header
    torch.manual_seed(0)
    tensors = [
        ("a", torch.randn(3, dtype=torch.bfloat16)),
        ("b", torch.randn(100, 10)),
        ("c", torch.arange(5)),
        ("d", torch.ones(3, dtype=torch.bool)),
        ("e", torch.randn(64, 64).half()),
        ("f", torch.tensor(2.5)),
        ("g", torch.randn(7).half()),
        ("h", torch.randn(0, 4)),
    ]
    for max_bytes in (10**9, 3000):
        out = w.save_hf_model(
            tmp_path / f"o{max_bytes}", iter(tensors), meta_dir=tiny_model_dir, max_shard_bytes=max_bytes
        )
        got = read_model(out)
        assert set(got) == {n for n, _ in tensors}
        for name, t in tensors:
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert (tmp_path / "o3000" / "model.safetensors.index.json").is_file()
    assert (tmp_path / f"o{10**9}" / "model.safetensors").is_file()
    # thousands of small tensors overflow a shard's reserved header space: it rolls to a new shard
    many = [(f"layer.{i}.a_long_parameter_name_{i}", torch.full((3,), float(i))) for i in range(3000)]
    out = w.save_hf_model(tmp_path / "many", iter(many), meta_dir=tiny_model_dir, max_shard_bytes=10**9)
    got = read_model(out)
    assert len(list(out.glob("*.safetensors"))) > 1 and len(got) == 3000
    assert all(torch.equal(got[n], t) for n, t in many)


def test_writer_drops_tied_head_casts_and_is_atomic(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlctl.formats.hf_writer import save_hf_model

    meta = tmp_path / "meta"
    shutil.copytree(tiny_model_dir, meta)
    config = json.loads((meta / "config.json").read_text())
    (meta / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))
    state = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).state_dict()
    out = save_hf_model(tmp_path / "out", state.items(), meta_dir=meta, dtype="fp16")
    got = read_model(out)
    assert "lm_head.weight" not in got and all(t.dtype == torch.float16 for t in got.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert not (out / "model.safetensors.index.json").exists()
    assert AutoModelForCausalLM.from_pretrained(str(out)).lm_head.weight.dtype == torch.float16

    with pytest.raises(UserError, match="already exists; pass --force"):
        save_hf_model(out, state.items(), meta_dir=meta)

    def failing():
        yield "x", torch.zeros(2)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_hf_model(tmp_path / "out", failing(), meta_dir=meta, force=True)
    assert read_model(out).keys() == got.keys()  # the previous output is untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ----------------------------------------------------------------------------- Megatron wiring


def test_hf_megatron_round_trip_via_cli(tmp_path):
    from rlctl.testing import build_tiny_model

    hf = build_tiny_model(tmp_path / "hf", seed=2, num_key_value_heads=2)
    code, output = cli("hf-to-megatron", str(hf), str(tmp_path / "mcore"), "--tp", "2", "--pp", "2")
    assert code == 0, output
    assert (tmp_path / "mcore" / "mp_rank_01_001").is_dir() and "PASSED" in output
    code, output = cli("inspect", str(tmp_path / "mcore"), "--json")
    info = json.loads(output)
    assert info["tp"] == 2 and info["pp"] == 2
    assert info["params"] == sum(t.numel() for t in load_file(hf / "model.safetensors").values())
    code, output = cli("megatron-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back"))
    assert code == 0, output
    original = load_file(hf / "model.safetensors")
    back = read_model(tmp_path / "back")
    assert set(back) == set(original) and all(torch.equal(back[k], v) for k, v in original.items())
    code, msg = cli("hf-to-megatron", str(hf), str(tmp_path / "mcore"), "--tp", "2")
    assert code == 2 and "already exists" in msg


@pytest.mark.slow
def test_real_fsdp2_files_need_nothing_beyond_the_allowlist(ckpts):
    """torch's own scanner lists what each real verl rank file needs: exactly the DTensor classes we admit."""
    from rlctl.formats.safe_load import load_dcp_metadata, load_pt

    rank_files = sorted(ckpts.glob("*/verl/global_step_*/actor/model_world_size_*_rank_*.pt"))
    assert len(rank_files) >= 10
    wanted = set()
    for f in rank_files:
        wanted |= set(torch.serialization.get_unsafe_globals_in_checkpoint(f))
        assert isinstance(load_pt(f, mmap=True), dict)
    core = {
        "torch.distributed.device_mesh.DeviceMesh",
        "torch.distributed.tensor.DTensor",
        "torch.distributed.tensor._dtensor_spec.DTensorSpec",
        "torch.distributed.tensor._dtensor_spec.TensorMeta",
        "torch.distributed.tensor.placement_types.Replicate",
        "torch.distributed.tensor.placement_types.Shard",
    }
    # ShardOrderEntry appears when a 2-D mesh records a shard order (not in every run)
    assert core <= wanted <= core | {"torch.distributed.tensor._dtensor_spec.ShardOrderEntry"}
    metadata = sorted(ckpts.glob("*/rlctl/checkpoints/step_*/.metadata"))
    assert len(metadata) >= 8
    for f in metadata:
        assert any(k.startswith("optim.") for k in load_dcp_metadata(f).state_dict_metadata)
