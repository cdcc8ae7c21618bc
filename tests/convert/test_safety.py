"""Convert never runs a checkpoint's code, never destroys its input, and names a damaged file in one line.

Checkpoints here are built in-process (no torchrun): an rlctl DCP step dir written with
``dcp.save(no_dist=True)``, a verl actor dir of two rank files holding plain tensors, and a sharded
HF model; the truth is always the tiny model's own safetensors. Malicious pickles would create a
marker file when unpickled (``builtins.open(marker, "w")``); each test first proves that a plain
unpickling does create it, so the test can fail.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlctl.formats.safe_load import UntrustedCheckpoint, load_dcp_metadata, load_pt
from tests.support.cli import convert_cli as cli
from tests.support.cli import run_cli


class Evil:
    """Unpickling this creates ``marker``: what a crafted checkpoint could do, harmlessly."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def read_model(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def copy_meta(hf_dir: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    for f in hf_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, dest / f.name)


@pytest.fixture(scope="module")
def truth(tiny_model_dir) -> dict[str, torch.Tensor]:
    return load_file(tiny_model_dir / "model.safetensors")


@pytest.fixture(scope="module")
def ckpts(tiny_model_dir, truth, tmp_path_factory) -> Path:
    """``rlctl/step_000003`` (DCP), ``verl/global_step_3/actor`` (2 rank files), ``sharded/`` (HF, 3+ files)."""
    import torch.distributed.checkpoint as dcp

    from rlctl.convert.megatron_io import save_megatron_shards
    from rlctl.formats.hf_writer import save_hf_model

    root = tmp_path_factory.mktemp("ckpts")
    step = root / "rlctl" / "checkpoints" / "step_000003"
    dcp.save({"model": dict(truth)}, checkpoint_id=str(step), no_dist=True)
    copy_meta(tiny_model_dir, step / "huggingface")
    (step / "trainer_state.json").write_text(json.dumps({"step": 3, "world_size": 1}))
    actor = root / "verl" / "global_step_3" / "actor"
    actor.mkdir(parents=True)
    for rank in range(2):  # plain tensors are the same on every rank and taken from rank 0
        torch.save(dict(truth), actor / f"model_world_size_2_rank_{rank}.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2}))
    copy_meta(tiny_model_dir, actor / "huggingface")
    save_hf_model(root / "sharded", truth.items(), meta_dir=tiny_model_dir, max_shard_bytes=700_000)
    save_megatron_shards(tiny_model_dir, root / "mcore", tp=1, pp=2)
    return root


def no_output(out: Path) -> None:
    assert not out.exists(), f"{out} was written"
    assert not list(out.parent.glob(f".tmp-{out.name}*")), "a temporary output was left behind"


# ----------------------------------------------------------------------------- the synthetic checkpoints convert


@pytest.mark.parametrize("sub", ["rlctl", "verl/global_step_3/actor"])
def test_synthetic_checkpoints_convert_to_the_model(ckpts, truth, tmp_path, sub):
    out = tmp_path / "hf"
    code, output = cli("fsdp-to-hf", str(ckpts / sub), str(out))
    assert code == 0, output
    got = read_model(out)
    assert set(got) == set(truth)
    for name, tensor in truth.items():
        assert torch.equal(got[name], tensor), name
    code, output = cli("inspect", str(ckpts / sub), "--json")
    assert code == 0 and json.loads(output)["unpickling"].startswith("restricted"), output
    code, output = cli("inspect", str(ckpts / sub), "--json", "--trust-checkpoint")
    assert code == 0 and json.loads(output[output.index("{") :])["unpickling"].startswith("FULL"), output


# ----------------------------------------------------------------------------- untrusted checkpoints run no code


def test_pickles_would_run_code_unless_restricted(tmp_path):
    """The control: the malicious payloads do create the marker when unpickled the unsafe way."""
    marker = tmp_path / "pwned"
    torch.save({"w": Evil(marker)}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()
    marker.unlink()
    (tmp_path / "evil.pickle").write_bytes(pickle.dumps(Evil(marker)))
    pickle.loads((tmp_path / "evil.pickle").read_bytes())
    assert marker.exists()


def one_line_refusal(proc, file: Path, marker: Path) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and f"{file}: refusing to unpickle io.open" in proc.stderr
    assert "--trust-checkpoint" in proc.stderr
    assert not marker.exists(), "the checkpoint's code ran"


def test_malicious_verl_rank_file_is_refused_through_the_cli(ckpts, tmp_path):
    actor = tmp_path / "actor"
    shutil.copytree(ckpts / "verl" / "global_step_3" / "actor", actor)
    marker = tmp_path / "pwned"
    rank1 = actor / "model_world_size_2_rank_1.pt"
    torch.save({"model.norm.weight": Evil(marker)}, rank1)
    out = tmp_path / "out"
    one_line_refusal(run_cli("convert", "fsdp-to-hf", str(actor), str(out)), rank1, marker)
    one_line_refusal(run_cli("convert", "inspect", str(actor)), rank1, marker)
    no_output(out)


def test_malicious_dcp_metadata_is_refused_through_the_cli(ckpts, tmp_path):
    step = tmp_path / "step_000003"
    shutil.copytree(ckpts / "rlctl" / "checkpoints" / "step_000003", step)
    marker = tmp_path / "pwned"
    (step / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    out = tmp_path / "out"
    one_line_refusal(run_cli("convert", "fsdp-to-hf", str(step), str(out)), step / ".metadata", marker)
    no_output(out)
    # megatron-core torch_dist directories carry the same pickle
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    shutil.copy(step / ".metadata", dist / ".metadata")
    copy_meta(step / "huggingface", dist / "huggingface")
    proc = run_cli("convert", "megatron-to-hf", str(dist), str(out))
    one_line_refusal(proc, dist / ".metadata", marker)
    no_output(out)


def test_legacy_rng_file_loads_safely_and_malicious_one_is_refused(tmp_path):
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(state, tmp_path / "rng")  # the old way: a pickled python + numpy + torch RNG state
    for trust in (False, True):
        got = load_pt(tmp_path / "rng", trust=trust)
        assert got["python"] == state["python"]
        assert got["numpy"][0] == "MT19937" and got["numpy"][2:] == state["numpy"][2:]
        assert np.array_equal(got["numpy"][1], state["numpy"][1]) and got["numpy"][1].dtype == np.uint32
        assert torch.equal(got["torch"], state["torch"])
    random.setstate(got["python"])
    np.random.set_state(got["numpy"])
    assert random.random() == pytest.approx(random.Random(5).random())
    assert np.random.rand() == np.random.RandomState(6).rand()

    marker = tmp_path / "pwned"
    torch.save({"python": Evil(marker)}, tmp_path / "evil_rng")
    with pytest.raises(UntrustedCheckpoint) as err:
        load_pt(tmp_path / "evil_rng")
    assert str(tmp_path / "evil_rng") in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()
    (tmp_path / "evil_meta").write_bytes(pickle.dumps(Evil(marker)))
    with pytest.raises(UntrustedCheckpoint, match="io.open"):
        load_dcp_metadata(tmp_path / "evil_meta")
    assert not marker.exists()


def test_trust_checkpoint_converts_a_benign_legacy_file(ckpts, truth, tmp_path):
    """A rank file pickled as a defaultdict (outside the allowlist): refused, converted with --trust-checkpoint."""
    from collections import defaultdict

    actor = tmp_path / "actor"
    shutil.copytree(ckpts / "verl" / "global_step_3" / "actor", actor)
    for rank in range(2):
        torch.save(defaultdict(list, truth), actor / f"model_world_size_2_rank_{rank}.pt")
    out = tmp_path / "out"
    code, msg = cli("fsdp-to-hf", str(actor), str(out))
    assert code == 2 and "refusing to unpickle collections.defaultdict" in msg and "--trust-checkpoint" in msg
    no_output(out)
    code, output = cli("fsdp-to-hf", str(actor), str(out), "--trust-checkpoint")
    assert code == 0, output
    assert "warning: --trust-checkpoint" in " ".join(output.split())
    got = read_model(out)
    assert set(got) == set(truth) and all(torch.equal(got[k], v) for k, v in truth.items())


# ----------------------------------------------------------------------------- convert never destroys its input


def tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


def test_out_overlapping_the_input_is_refused_even_with_force(ckpts, tiny_model_dir, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(ckpts / "rlctl", root)
    step = root / "checkpoints" / "step_000003"
    (tmp_path / "link").symlink_to(step)
    before = tree(root)
    for out in (step, step / "hf", root, root / "checkpoints", tmp_path / "link", tmp_path / "link" / "x"):
        code, msg = cli("fsdp-to-hf", str(step), str(out), "--force", "--no-verify")
        assert code == 2 and "would destroy the input" in msg and "\n" not in msg, (out, msg)
    assert tree(root) == before
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    before = tree(base)
    for args in (
        ("hf-to-megatron", str(base), str(base), "--force"),
        ("hf-to-megatron", str(base), str(base / "mcore")),
        ("megatron-to-hf", str(ckpts), str(ckpts), "--force", "--hf-config", str(base)),
        ("megatron-to-hf", str(tmp_path / "mc"), str(base), "--force", "--hf-config", str(base)),
        ("lora-merge", str(base), str(tmp_path), str(base), "--force"),
        ("lora-merge", str(base), str(tmp_path / "adapter"), str(tmp_path), "--force"),
    ):
        code, msg = cli(*args)
        assert code == 2 and "would destroy the input" in msg, (args, msg)
    assert tree(base) == before


def test_existing_empty_out_is_accepted_without_force(ckpts, truth, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    code, output = cli("fsdp-to-hf", str(ckpts / "rlctl"), str(out), "--no-verify")
    assert code == 0, output
    assert set(read_model(out)) == set(truth)
    code, msg = cli("fsdp-to-hf", str(ckpts / "rlctl"), str(out), "--no-verify")
    assert code == 2 and "already exists; pass --force" in msg


# ----------------------------------------------------------------------------- damaged checkpoints: one line


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _damage_cases(ckpts: Path, tiny_model_dir: Path) -> list[tuple[str, str, list[str]]]:
    """(name of the file to damage, source to copy, convert command with {src} / {out})."""
    shards = sorted(p.name for p in (ckpts / "sharded").glob("*.safetensors"))
    assert len(shards) >= 2
    cases = [
        ("checkpoints/step_000003/.metadata", "rlctl", ["fsdp-to-hf", "{src}", "{out}"]),
        ("checkpoints/step_000003/__0_0.distcp", "rlctl", ["fsdp-to-hf", "{src}", "{out}"]),
        ("checkpoints/step_000003/trainer_state.json", "rlctl", ["fsdp-to-hf", "{src}", "{out}"]),
        ("global_step_3/actor/model_world_size_2_rank_0.pt", "verl", ["fsdp-to-hf", "{src}", "{out}"]),
        ("global_step_3/actor/model_world_size_2_rank_1.pt", "verl", ["fsdp-to-hf", "{src}", "{out}"]),
        ("global_step_3/actor/fsdp_config.json", "verl", ["fsdp-to-hf", "{src}", "{out}"]),
    ]
    cases += [(name, "sharded", ["hf-to-megatron", "{src}", "{out}"]) for name in shards]
    mcore = sorted(str(p.relative_to(ckpts / "mcore")) for p in (ckpts / "mcore").rglob("*.safetensors"))
    assert len(mcore) == 2
    cases += [(name, "mcore", ["megatron-to-hf", "{src}", "{out}"]) for name in [*mcore, "rlctl_megatron.json"]]
    return cases


@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_each_damaged_file_is_one_line_naming_it(ckpts, tiny_model_dir, tmp_path, how):
    seen = 0
    for name, sub, command in _damage_cases(ckpts, tiny_model_dir):
        if how == "delete" and name.endswith(("fsdp_config.json", "rlctl_megatron.json")):
            continue  # optional in verl's layout; without it, not a Megatron checkpoint (another message)
        src = tmp_path / f"case{seen}"
        shutil.copytree(ckpts / sub, src)
        file = src / name
        file.unlink() if how == "delete" else _truncate(file)
        out = tmp_path / f"out{seen}"
        args = [a.format(src=src, out=out) for a in command]
        code, msg = cli(*args)  # any exception but a UserError (a traceback) fails the test here
        assert code == 2, (name, how, msg)
        assert "\n" not in msg and str(file) in msg, (name, how, msg)
        no_output(out)
        seen += 1
    assert seen >= 7


def test_damaged_adapter_file_is_one_line(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), LoraConfig(r=2))
    model.save_pretrained(str(tmp_path / "adapter"))
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    _truncate(weights)
    code, msg = cli("lora-merge", str(tiny_model_dir), str(tmp_path / "adapter"), str(tmp_path / "out"))
    assert code == 2 and str(weights) in msg and "\n" not in msg, msg
    weights.unlink()
    code, msg = cli("lora-merge", str(tiny_model_dir), str(tmp_path / "adapter"), str(tmp_path / "out"))
    assert code == 2 and str(weights) in msg and "\n" not in msg, msg
    no_output(tmp_path / "out")
    assert os.listdir(tmp_path) == ["adapter"]
