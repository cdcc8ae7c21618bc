"""Damaged checkpoints, in one process: every file of a real checkpoint (torch.distributed.checkpoint
shards and metadata, trainer state, RNG files, huggingface/ files, ``latest``) deleted or truncated in
turn. An explicit ``--resume PATH`` ends in ONE line naming the damaged file; ``--resume auto`` passes
over the damaged checkpoint to the newest intact one and says which and why; ``latest`` is only a hint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlctl.errors import UserError
from rlctl.runtime.layout import checkpoint_problem, choose_resume, step_name

STEPS = (2, 4, 6)
NEWEST = step_name(6)


class _DcpEngine:
    """A model and optimizer state written with torch.distributed.checkpoint, as the FSDP engine does."""

    backend = "fsdp"

    def __init__(self, step: int):
        g = torch.Generator().manual_seed(step)
        self.state = {
            "model": {"embed.weight": torch.randn(96, 32, generator=g), "norm.weight": torch.randn(32, generator=g)},
            "optim": {"exp_avg": torch.randn(96, 32, generator=g)},
        }

    def save_checkpoint(self, path):
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, checkpoint_id=str(path))

    def lora_info(self):
        return None


def _save(root: Path, step: int, meta: Path, keep_last: int = 10) -> Path:
    from rlctl.runtime.checkpoint import save_checkpoint
    from rlctl.runtime.rng import rng_state

    return save_checkpoint(
        root,
        step,
        {"": _DcpEngine(step)},
        trainer_state={"method": "sft", "epoch": 0},
        meta_dir=meta,
        rng_state=rng_state(),
        keep_last=keep_last,
    )


@pytest.fixture(scope="module")
def pristine(process_group, tmp_path_factory) -> Path:
    """A run directory with checkpoints after steps 2, 4 and 6 (each a complete save_checkpoint)."""
    run = tmp_path_factory.mktemp("pristine") / "run"
    meta = run / "model_meta"
    meta.mkdir(parents=True)
    (meta / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 32}))
    (meta / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (meta / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"vocab": {"a": 0}}}))
    (meta / "merges.txt").write_text("#version: 0.2\na b\n")
    for step in STEPS:
        _save(run / "checkpoints", step, meta)
    return run


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(pristine, copy)
    return copy


def _files(checkpoint: Path) -> list[str]:
    return sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())


def test_the_checkpoint_holds_every_kind_of_file(pristine):
    files = _files(pristine / "checkpoints" / NEWEST)
    assert files == [
        ".metadata",
        "__0_0.distcp",
        "huggingface/config.json",
        "huggingface/generation_config.json",
        "huggingface/merges.txt",
        "huggingface/tokenizer.json",
        "rng/rank_0.json",
        "rng/rank_0.safetensors",
        "trainer_state.json",
    ]
    assert all(checkpoint_problem(pristine / "checkpoints" / step_name(s)) is None for s in STEPS)
    choice = choose_resume("auto", pristine)
    assert choice.path == pristine / "checkpoints" / NEWEST and choice.note() == ""


FILES = [
    ".metadata",
    "__0_0.distcp",
    "trainer_state.json",
    "rng/rank_0.json",
    "rng/rank_0.safetensors",
    "huggingface/config.json",
    "huggingface/generation_config.json",
    "huggingface/merges.txt",
    "huggingface/tokenizer.json",
]


@pytest.mark.parametrize("how", ["deleted", "truncated", "emptied"])
@pytest.mark.parametrize("rel", FILES)
def test_a_damaged_file_is_named_and_auto_takes_the_previous_checkpoint(run, rel, how):
    newest = run / "checkpoints" / NEWEST
    victim = newest / rel
    size = victim.stat().st_size
    if how == "deleted":
        victim.unlink()
    else:
        keep = size // 2 if how == "truncated" else 0
        with open(victim, "r+b") as f:
            f.truncate(keep)
    # an explicit path: one line naming the file, never a fallback
    for explicit in (newest, run, run / "checkpoints"):
        with pytest.raises(UserError) as e:
            choose_resume(str(explicit), run / "elsewhere")
        message = str(e.value)
        assert str(victim) in message and "\n" not in message and NEWEST in message, message
    if rel.endswith(".distcp") and how == "truncated":  # the sizes: on disk now, and the whole file before
        assert f"{victim} truncated: {size // 2} of {size} bytes" in message, message
    # auto: the newest intact one, saying which one it passed over and why
    choice = choose_resume("auto", run)
    assert choice.path == run / "checkpoints" / step_name(4)
    note = choice.note()
    assert note.startswith(f"resuming from {step_name(4)}: {NEWEST} is damaged (") and str(victim) in note, note


@pytest.mark.parametrize("rel", [".metadata", "__0_0.distcp", "rng/rank_0.json", "rng/rank_0.safetensors"])
def test_a_checkpoint_without_a_manifest_is_checked_by_content(run, rel):
    """Checkpoints saved before trainer_state.json listed its files: the metadata, shards and RNG files
    are still checked by what they say of themselves."""
    newest = run / "checkpoints" / NEWEST
    state = json.loads((newest / "trainer_state.json").read_text())
    del state["files"]
    (newest / "trainer_state.json").write_text(json.dumps(state))
    assert checkpoint_problem(newest) is None
    victim = newest / rel
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 7)
    problem = checkpoint_problem(newest)
    assert problem is not None and problem.startswith(str(victim)), problem


def test_a_path_that_is_no_checkpoint_says_so(run):
    for missing in (run / "checkpoints" / step_name(8), run / "nothing-here"):
        with pytest.raises(UserError, match="no complete checkpoint there"):
            choose_resume(str(missing), run)


def test_every_checkpoint_damaged_is_an_error_naming_each(run):
    for step in STEPS:
        (run / "checkpoints" / step_name(step) / "rng" / "rank_0.safetensors").unlink()
    with pytest.raises(UserError) as e:
        choose_resume("auto", run)
    message = str(e.value)
    assert "no intact checkpoint" in message and "\n" not in message
    assert all(
        f"{step_name(s)}: {run / 'checkpoints' / step_name(s) / 'rng' / 'rank_0.safetensors'}" in message for s in STEPS
    )


def test_the_critic_of_a_ppo_checkpoint_is_checked_too(run):
    newest = run / "checkpoints" / NEWEST
    state = json.loads((newest / "trainer_state.json").read_text())
    (newest / "trainer_state.json").write_text(json.dumps({**state, "method": "ppo"}))
    assert checkpoint_problem(newest) == f"{newest / 'critic' / '.metadata'} missing"


@pytest.mark.parametrize("latest", ["deleted", "emptied", "names a missing step", "names an older step"])
def test_latest_is_only_a_hint(run, latest):
    marker = run / "checkpoints" / "latest"
    if latest == "deleted":
        marker.unlink()
    elif latest == "emptied":
        marker.write_text("")
    elif latest == "names a missing step":
        marker.write_text(step_name(8) + "\n")
    else:
        marker.write_text(step_name(4) + "\n")
    # auto: always the newest intact checkpoint, whatever ``latest`` says
    assert choose_resume("auto", run).path == run / "checkpoints" / NEWEST
    # a run directory: the checkpoint ``latest`` names when it names one, else the newest
    want = step_name(4) if latest == "names an older step" else NEWEST
    assert choose_resume(str(run), run).path == run / "checkpoints" / want


def test_unfinished_saves_are_ignored_then_cleaned_by_the_next_save(run):
    ckpts = run / "checkpoints"
    half = ckpts / f".tmp-{step_name(8)}"  # a save killed mid-write
    shutil.copytree(ckpts / NEWEST, half)
    (half / "trainer_state.json").unlink()
    old = ckpts / f".tmp-old-{step_name(2)}"  # a prune killed mid-delete
    (ckpts / step_name(2)).rename(old)
    assert choose_resume("auto", run).path == ckpts / NEWEST
    with pytest.raises(UserError, match="an unfinished save"):
        choose_resume(str(half), run)
    _save(ckpts, 8, run / "model_meta", keep_last=2)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", step_name(6), step_name(8)]
    assert checkpoint_problem(ckpts / step_name(8)) is None
    assert (ckpts / "latest").read_text().strip() == step_name(8)


def test_a_checkpoint_saved_again_replaces_the_old_one_whole(run):
    ckpts = run / "checkpoints"
    (ckpts / NEWEST / "stale-file").write_text("from the first save")
    _save(ckpts, 6, run / "model_meta")
    assert not (ckpts / NEWEST / "stale-file").exists() and checkpoint_problem(ckpts / NEWEST) is None
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".tmp-")]


def test_a_crash_between_the_renames_of_a_re_save_keeps_the_new_copy(run):
    """A step saved again moves its old copy out of sight, then renames the new one in: killed between
    the two, the complete new copy waits under .tmp-step_N while `latest` names step_N. Cleaning the
    leftovers puts it back under its name instead of deleting both copies."""
    from rlctl.runtime.checkpoint import remove_leftovers

    ckpts = run / "checkpoints"
    (ckpts / NEWEST).rename(ckpts / f".tmp-{NEWEST}")  # the complete new copy, not yet renamed
    shutil.copytree(ckpts / step_name(2), ckpts / f".tmp-old-{NEWEST}")  # the old copy, half deleted
    (ckpts / f".tmp-old-{NEWEST}" / "trainer_state.json").unlink()
    remove_leftovers(ckpts)
    assert checkpoint_problem(ckpts / NEWEST) is None
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".tmp-")]
    assert choose_resume("auto", run).path == ckpts / NEWEST


def test_the_damaged_checkpoint_is_refused_before_launch(run):
    """rlctl/checks.py's pre-launch check: explicit -> the one-line error; auto -> the note on the console."""
    from types import SimpleNamespace

    from rlctl.checks import check_run_dir

    victim = run / "checkpoints" / NEWEST / "__0_0.distcp"
    victim.unlink()
    job = {"method": "sft", "lora": SimpleNamespace(rank=0), "model": SimpleNamespace(name="")}
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(resume=str(run / "checkpoints" / NEWEST)), **job)
    with pytest.raises(UserError, match=f"{victim} missing"):
        check_run_dir(cfg, run)
    check_run_dir(SimpleNamespace(checkpoint=SimpleNamespace(resume="auto"), **job), run)


@pytest.mark.slow
def test_the_cli_refuses_a_damaged_checkpoint_in_one_line_before_launch(run, tiny_model_dir, tmp_path):
    """`rlctl sft --resume PATH` of a checkpoint whose .metadata is cut short: exit 2, one line naming
    the file, nothing written (the check runs before torchrun starts)."""
    from tests.support.cli import run_cli
    from tests.support.sft import chat_rows, write_jsonl

    victim = run / "checkpoints" / NEWEST / ".metadata"
    victim.write_bytes(victim.read_bytes()[:100])
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    other = tmp_path / "other"
    argv = ["--model", str(tiny_model_dir), "--data", str(data), "--output-dir", str(other), "--device", "cpu"]
    res = run_cli("sft", *argv, "--nproc", "2", "--resume", str(run / "checkpoints" / NEWEST))
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(victim) in lines[0] and "Traceback" not in res.stdout + res.stderr, res.stderr
    assert not other.exists()  # refused before anything was written
