"""A disk that fills up while a checkpoint is written, and bytes changed in place (issue 24): one line
naming the path, the space and the checkpoint kept, no ``.tmp-`` debris; a byte flipped in any file
of a checkpoint (its size unchanged) is named by its sha256 on resume (explicit: an error; auto: the
previous checkpoint) and by ``rlctl convert``. In one process, with real torch.distributed.checkpoint
saves (the fixtures of test_damage.py), and one real run through the CLI."""

from __future__ import annotations

import errno
import traceback

import pytest

from rlctl.errors import UserError
from rlctl.runtime.layout import checkpoint_problem, checksum_problem, choose_resume, step_name
from tests.faults.test_damage import NEWEST, _DcpEngine, _save
from tests.support.cli import one_line_error, rlctl_in_process

FLIPS = ["__0_0.distcp", "rng/rank_0.safetensors", "huggingface/merges.txt", ".metadata"]


def _flip(path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    i = min(len(data) - 1, int(len(data) * at))
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("rel", FLIPS)
def test_a_flipped_byte_is_named_on_resume(run, rel):
    newest = run / "checkpoints" / NEWEST
    victim = newest / rel
    size = victim.stat().st_size
    _flip(victim, 0.99 if rel == ".metadata" else 0.5)  # .metadata: in its last bytes (it still unpickles)
    assert victim.stat().st_size == size
    assert checksum_problem(newest) is not None
    with pytest.raises(UserError, match=rf"{victim} damaged: its bytes differ from the checksum"):
        choose_resume(str(newest), run)
    choice = choose_resume("auto", run)
    assert choice.path == run / "checkpoints" / step_name(4)
    assert str(victim) in choice.note() and "checksum" in choice.note()


def test_a_flipped_byte_is_named_by_convert(monkeypatch, capsys, run, tmp_path):
    newest = run / "checkpoints" / NEWEST
    _flip(newest / "__0_0.distcp")
    args = ("convert", "fsdp-to-hf", str(newest), str(tmp_path / "hf"))
    line = one_line_error(*rlctl_in_process(monkeypatch, capsys, *args))
    assert str(newest / "__0_0.distcp") in line and "checksum" in line, line
    assert not (tmp_path / "hf").exists()


def _assert_kept_no_debris(run) -> None:
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", step_name(2), step_name(4), NEWEST]
    assert (root / "latest").read_text().strip() == NEWEST
    assert checkpoint_problem(root / NEWEST) is None and checksum_problem(root / NEWEST) is None


def test_disk_full_while_writing_is_one_line_and_keeps_the_previous_checkpoint(monkeypatch, run, process_group):
    monkeypatch.setenv("RLCTL_FAULT", "enospc:8")
    with pytest.raises(UserError) as e:
        _save(run / "checkpoints", 8, run / "model_meta")
    msg = str(e.value)
    assert "\n" not in msg and "No space left on device" in msg and ".tmp-step_000008" in msg, msg
    assert "free there" in msg and "a checkpoint of this run takes about" in msg, msg
    assert f"the previous checkpoint {NEWEST} is intact" in msg, msg
    _assert_kept_no_debris(run)


class _FullDiskEngine(_DcpEngine):
    """Writes part of its shard, then fails as torch.distributed.checkpoint reports a rank's failure."""

    def save_checkpoint(self, path):
        from torch.distributed.checkpoint.api import CheckpointException

        (path / "__0_0.distcp").write_bytes(b"\0" * 1000)
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(path / "__0_0.distcp"))
        except OSError as exc:
            raise CheckpointException("save failed", {0: (exc, traceback.extract_tb(exc.__traceback__))}) from None


def test_disk_full_inside_torch_distributed_checkpoint_is_one_line(run, process_group):
    from rlctl.runtime.checkpoint import save_checkpoint
    from rlctl.runtime.rng import rng_state

    with pytest.raises(UserError, match="saving checkpoint step_000008 in .* failed: No space left on device"):
        save_checkpoint(
            run / "checkpoints",
            8,
            {"": _FullDiskEngine(8)},
            trainer_state={"method": "sft"},
            meta_dir=run / "model_meta",
            rng_state=rng_state(),
            keep_last=10,
        )
    _assert_kept_no_debris(run)


@pytest.mark.slow
def test_disk_full_in_a_real_run_is_one_line_exit_2(tiny_model_dir, tmp_path):
    from tests.support.cli import run_cli
    from tests.support.sft import chat_rows, write_jsonl

    data, out = write_jsonl(tmp_path / "chat.jsonl", chat_rows(16)), tmp_path / "run"
    args = ["sft", "--model", str(tiny_model_dir), "--data", str(data), "--device", "cpu", "--nproc", "1"]
    args += ["--max-steps", "4", "--save-every", "2", "--batch-size", "4", "-o", str(out)]
    r = run_cli(*args, env={"RLCTL_FAULT": "enospc:4"}, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "step_000002 is intact" in errors[0]
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", step_name(2)]
    assert checkpoint_problem(root / step_name(2)) is None and checksum_problem(root / step_name(2)) is None
