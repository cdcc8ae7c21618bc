"""The shared-run-directory check (rlctl.runtime.shared_dir) on real gloo process groups.

Two processes stand for two nodes (GROUP_RANK 0 and 1); each gets its own run directory path. The same
path on both passes; two different directories (no shared filesystem) end in the same one-line UserError
on both ranks, naming node 1.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from rlctl.runtime.net import free_port


def _worker(rank: int, cases: list[list[str]], port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rlctl.errors import UserError
    from rlctl.runtime.layout import RunPaths
    from rlctl.runtime.shared_dir import check_shared_run_dir

    os.environ["GROUP_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for i, dirs in enumerate(cases):  # every case in one process group: one start-up for all
        try:
            Path(dirs[rank]).mkdir(parents=True, exist_ok=True)
            check_shared_run_dir(RunPaths(Path(dirs[rank])), torch.device("cpu"), retry_s=0.2)
            result = "ok"
        except UserError as e:
            result = "error: " + str(e)
        Path(out, f"case_{i}_rank_{rank}.txt").write_text(result)
    dist.destroy_process_group()


def _run(out: Path, cases: list[list[str]]) -> list[list[str]]:
    out.mkdir()
    mp.start_processes(_worker, args=(cases, free_port(), str(out)), nprocs=2, start_method="spawn")
    return [[(out / f"case_{i}_rank_{r}.txt").read_text() for r in range(2)] for i in range(len(cases))]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Three cases: one shared directory; a directory per node; node 1's own directory with an old token."""
    tmp = tmp_path_factory.mktemp("shared")
    repo = str(Path(__file__).resolve().parents[2])  # the spawned children import this test module
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, old) if p)
    stale = tmp / "stale1"
    stale.mkdir()
    (stale / ".shared_check").write_text("0" * 32 + f" oldhost {tmp / 'stale0'}\n")
    cases = [
        [str(tmp / "run")] * 2,
        [str(tmp / "node0" / "run"), str(tmp / "node1" / "run")],
        [str(tmp / "stale0"), str(stale)],
    ]
    try:
        return tmp, _run(tmp / "out", cases)
    finally:
        os.environ["PYTHONPATH"] = old


def test_one_shared_directory_passes(results):
    tmp, found = results
    assert found[0] == ["ok", "ok"]
    token = (tmp / "run" / ".shared_check").read_text().split()
    assert len(token[0]) == 32 and token[2] == str(tmp / "run")  # a fresh random token, the host, the directory


def test_a_directory_per_node_is_one_line_on_every_rank(results):
    tmp, found = results
    assert found[1][0] == found[1][1]  # the same message on both nodes
    line = found[1][0]
    assert line.startswith("error: the run directory must be on a filesystem all nodes share: node 0 (")
    assert f"wrote {tmp / 'node0' / 'run'}, node 1 (" in line and "cannot see it" in line
    assert "--output-dir" in line and "\n" not in line
    assert not (tmp / "node1" / "run" / ".shared_check").exists()


def test_a_stale_token_from_an_earlier_run_does_not_pass(results):
    """Node 1's own directory holds the token file of an earlier run: the contents differ, so it fails."""
    _, found = results
    assert all(r.startswith("error: the run directory must be on a filesystem all nodes share") for r in found[2])
