"""The rank side every recipe shares (rlctl.runtime): RNG state without pickle, per-rank error files,
a Ctrl-C during start-up, and the policy loss a recipe picks by name with its own defaults."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.cli import REPO
from tests.support.rl import arith_rows, failure, rl_args, train_records
from tests.support.sft import chat_rows, write_jsonl


def _draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(1))]


# ---------------------------------------------------------------------------------------------
# RNG state


def test_rng_state_round_trips_as_json_and_safetensors(tmp_path):
    from safetensors.torch import load_file

    from rlctl.runtime.rng import load_rng, rng_state, save_rng, seed_everything

    seed_everything(7)
    _draws()
    save_rng(tmp_path, 3, rng_state())
    want = _draws()
    seed_everything(8)  # something else in between
    _draws()
    from rlctl.runtime.rng import set_rng_state

    set_rng_state(load_rng(tmp_path, 3))
    assert _draws() == want
    # plain formats: JSON lists and a safetensors file, no pickle anywhere
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_3.json", "rank_3.safetensors"]
    plain = json.loads((tmp_path / "rank_3.json").read_text())
    assert len(plain["python"]["state"]) == 625 and len(plain["numpy"]["keys"]) == 624
    assert load_file(str(tmp_path / "rank_3.safetensors"))["torch"].dtype == torch.uint8
    assert load_rng(tmp_path, 4) is None  # no state for another rank


def test_rng_file_of_an_older_checkpoint_is_read_without_plain_pickle(tmp_path):
    """Older checkpoints hold a pickled rng/rank_N.pt: it loads through the restricted unpickler and
    restores the same draws; a file smuggling any other object is refused."""
    from rlctl.runtime.rng import load_rng, rng_state, set_rng_state

    state = rng_state()
    torch.save(state, tmp_path / "rank_0.pt")  # exactly what rlctl wrote before
    want = _draws()
    set_rng_state(load_rng(tmp_path, 0))
    assert _draws() == want

    bad = tmp_path / "bad"
    bad.mkdir()
    torch.save({**state, "evil": os.getcwd}, bad / "rank_0.pt")  # a callable: needs a global outside the list
    from rlctl.formats.safe_load import UntrustedCheckpoint

    with pytest.raises(UntrustedCheckpoint, match="rank_0.pt: refusing to unpickle posix.getcwd"):
        load_rng(bad, 0)


# ---------------------------------------------------------------------------------------------
# Per-rank error files

_BODIES = {
    "user": "raise UserError('data not found: x.jsonl\\n(pass --data)')",
    "internal": "raise RuntimeError('boom')",
    "interrupted": "raise KeyboardInterrupt",
}


@pytest.mark.parametrize("kind,code", [("user", 2), ("internal", 1), ("interrupted", 130)])
def test_a_failing_rank_writes_its_error_file(tmp_path, kind, code):
    from rlctl.config import build_config, save_config
    from rlctl.runtime.layout import RunPaths

    paths = RunPaths(tmp_path)
    save_config(build_config("sft", [{"hardware": {"device": "cpu"}}]), paths.config)
    script = (
        "from rlctl.errors import UserError\nfrom rlctl.runtime.entry import recipe_main\n"
        f"def body(ctx):\n    {_BODIES[kind]}\n"
        f"recipe_main(body, ['--run-dir', {str(tmp_path)!r}])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    began = time.time()
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == code, res.stderr[-3000:]
    record = json.loads(paths.rank_error(0).read_text())
    assert record["rank"] == 0 and record["kind"] == kind and began <= record["time"] <= time.time()
    assert "\n" not in record["message"]
    if kind == "user":
        assert record["message"] == "data not found: x.jsonl (pass --data)" and record["traceback"] is None
    elif kind == "internal":
        assert record["message"] == "RuntimeError: boom" and "in body\nRuntimeError: boom" in record["traceback"]
    else:
        assert json.loads(paths.summary.read_text())["status"] == "interrupted"


def _free_port() -> int:
    from rlctl.runtime.net import free_port

    return free_port()


# ---------------------------------------------------------------------------------------------
# Ctrl-C during start-up


@pytest.mark.slow
def test_ctrl_c_during_start_up_stops_cleanly(tiny_model_dir, tmp_path):
    """SIGINT while the rank still imports torch and builds its engine: no traceback; it stops before
    step 1 with summary.json "interrupted", like a Ctrl-C during training."""
    from rlctl.config import save_config
    from rlctl.plan import apply_plan
    from rlctl.runtime.layout import RunPaths
    from tests.support.sft import cpu_plan, sft_config

    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40))
    cfg = sft_config(tiny_model_dir, data, paths.root, train__micro_batch_size=2)
    save_config(apply_plan(cfg, cpu_plan(1)), paths.config)  # the launcher saves the resolved config
    paths.plan.write_text(json.dumps(cpu_plan(1)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlctl.recipes.sft", "--run-dir", str(paths.root)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(1.0)  # python is up; torch and the engine are still loading
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    assert "Traceback" not in output and "stopped before step 1" in output
    summary = json.loads(paths.summary.read_text())
    assert summary["status"] == "interrupted" and summary["step"] == 0 and summary["checkpoint"] is None
    assert not paths.hf.exists() and not paths.errors.exists()


# ---------------------------------------------------------------------------------------------
# Policy losses by name, each with its own defaults


def _gspo_by_hand(logp, old, adv, mask, clip_low, clip_high, n_seqs):
    """GSPO written out: sequence ratio exp(mean_t(logp - old)), clipped, per token; seq-mean-token-mean."""
    total = 0.0
    for b in range(logp.shape[0]):
        m = mask[b].bool()
        s = torch.exp((logp[b][m] - old[b][m]).mean())
        a = adv[b][m]
        per_token = torch.maximum(-a * s, -a * s.clamp(1 - clip_low, 1 + clip_high))
        total = total + per_token.mean()
    return total / n_seqs


@pytest.mark.parametrize(
    "sets,clip",
    [({}, (3e-4, 4e-4)), ({"algo.clip_high": 0.3}, (3e-4, 0.3)), ({"algo.clip_low": 0.1}, (0.1, 4e-4))],
)
def test_recipe_loss_uses_gspo_defaults_unless_overridden(sets, clip):
    """The actor's loss function of the recipe, with algo.policy_loss=gspo: GSPO's clip range and
    seq-mean-token-mean aggregation reach the loss, except for the keys the user set."""
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.recipes.rl.batch import micro_batches
    from rlctl.recipes.rl.spec import AlgoSpec
    from rlctl.recipes.rl.update import policy_loss_fn
    from tests.recipes.test_grpo import _random_batch

    cfg = build_config("grpo", [dotted_to_nested({"algo.policy_loss": "gspo", "rollout.temperature": 1.0, **sets})])
    batch = _random_batch(2, 3, 50, width=6)
    gen = torch.Generator().manual_seed(0)
    batch.old_logp = -torch.rand(batch.mask.shape, generator=gen) * batch.mask
    batch.advantages = torch.randn(len(batch), generator=gen)[:, None] * batch.mask
    (mb,) = micro_batches(batch, list(range(len(batch))), budget=10_000, pad_id=0, device=torch.device("cpu"))
    logits = torch.randn(1, mb.input_ids.shape[1], 50, generator=gen) * 0.05
    denoms = {"global_tokens": float(batch.mask.sum()), "global_seqs": 9.0, "norm_len": 6}
    loss, stats = policy_loss_fn(batch, AlgoSpec.from_config(cfg), denoms, kl_loss_coef=0.0)(logits, mb)

    sel = logits[0, mb.logit_index].log_softmax(-1).gather(-1, mb.labels[:, None]).squeeze(-1)
    logp = torch.zeros_like(batch.mask)
    logp[mb.rows[mb.token_row], mb.token_col] = sel
    want = _gspo_by_hand(logp, batch.old_logp, batch.advantages, batch.mask, *clip, n_seqs=9.0)
    assert torch.allclose(loss, want, atol=1e-6), (float(loss), float(want))
    ppo_like = _gspo_by_hand(logp, batch.old_logp, batch.advantages, batch.mask, 0.2, 0.2, n_seqs=9.0)
    assert not torch.allclose(loss, ppo_like, atol=1e-4)  # the clip range matters on this batch


@pytest.mark.slow
def test_grpo_run_with_gspo_uses_its_defaults_and_the_user_override(tiny_model_dir, tmp_path):
    """A real 2-process run with algo.policy_loss=gspo and one key overridden: the settings that reached
    the loss are GSPO's except that key; with two PPO epochs the tight clip range clips tokens."""
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(16))
    run = tmp_path / "run"
    from tests.support.cli import run_cli

    res = run_cli(
        "grpo",
        *rl_args(tiny_model_dir, data, run, "--rollout", "hf", "--max-steps", "2"),
        "--set",
        "algo.policy_loss=gspo",
        "--set",
        "algo.clip_high=0.3",
        "--set",
        "algo.ppo_epochs=2",
    )
    assert res.returncode == 0, failure(res, run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["policy_loss"] == {
        "policy_loss": "gspo",
        "clip_low": 3e-4,
        "clip_high": 0.3,
        "dual_clip": 0.0,
        "loss_agg": "seq-mean-token-mean",
    }
    records = train_records(run)
    assert [r["step"] for r in records] == [1, 2]
    # the second epoch's sequence ratios moved by far more than 3e-4 below 1: tokens were clipped
    assert all(r["pg/clip_frac"] > 0 for r in records), [r["pg/clip_frac"] for r in records]


class _FileEngine:
    """The engine side of a checkpoint, reduced to a file (checkpoint.py leaves the model to the engine)."""

    backend = "fsdp"

    def save_checkpoint(self, path):
        (Path(path) / ".metadata").write_text("model")

    def load_checkpoint(self, path):
        assert (Path(path) / ".metadata").read_text() == "model"

    def lora_info(self):
        return None


def test_checkpoint_rng_new_format_and_older_pickled_file_resume_the_same_draws(tmp_path):
    """save_checkpoint writes the RNG state as JSON + safetensors; load_checkpoint restores it exactly,
    and restores it from an older checkpoint's pickled rng/rank_0.pt just the same."""
    import torch.distributed as dist

    from rlctl.runtime.checkpoint import load_checkpoint, save_checkpoint
    from rlctl.runtime.rng import rng_state, seed_everything, set_rng_state

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        seed_everything(3)
        _draws()
        state = rng_state()
        final = save_checkpoint(
            tmp_path,
            1,
            {"": _FileEngine()},
            trainer_state={"method": "sft"},
            meta_dir=None,
            rng_state=state,
            keep_last=2,
        )
        want = _draws()
        assert sorted(p.name for p in (final / "rng").iterdir()) == ["rank_0.json", "rank_0.safetensors"]
        _, rng = load_checkpoint(final, {"": _FileEngine()})
        set_rng_state(rng)
        assert _draws() == want
        for f in (final / "rng").iterdir():  # the layout of a checkpoint written before this format
            f.unlink()
        torch.save(state, final / "rng" / "rank_0.pt")
        _, rng = load_checkpoint(final, {"": _FileEngine()})
        set_rng_state(rng)
        assert _draws() == want
    finally:
        if created:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# RLCTL_PROFILE


@pytest.mark.parametrize(
    "value, steps",
    [("3:6", (3, 6)), ("4", (4, 4)), (" 2:2 ", (2, 2)), ("", None), ("6:3", None), ("0:2", None), ("a:b", None)],
)
def test_profile_steps_parse(value, steps):
    from rlctl.runtime.profile import parse_steps

    assert parse_steps(value) == steps


def test_step_profiler_writes_the_table_and_the_trace_on_rank_0_only(tmp_path):
    from rlctl.runtime.profile import StepProfiler

    logs: list[str] = []
    for rank in (0, 1):
        profiler = StepProfiler(tmp_path / f"run{rank}", rank, logs.append, env="2:3")
        for step in range(1, 5):
            profiler.begin(step)
            torch.randn(64, 64) @ torch.randn(64, 64)
            profiler.end(step)
        profiler.close()
    table = (tmp_path / "run0" / "profile" / "rank0.txt").read_text()
    assert "steps 2..3" in table and "aten::mm" in table and "Self CPU" in table
    assert json.loads((tmp_path / "run0" / "profile" / "rank0.trace.json").read_text())["traceEvents"]
    assert not (tmp_path / "run1" / "profile").exists() and len(logs) == 1
    StepProfiler(tmp_path / "bad", 0, logs.append, env="5:1")
    assert "not START:END" in logs[-1]


@pytest.mark.slow
def test_a_grpo_run_profiles_the_steps_rlctl_profile_names(tiny_model_dir, tmp_path):
    """One process, RLCTL_PROFILE=2:2: the table holds the step's phases as named ranges."""
    from tests.support.cli import run_cli

    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(16))
    run = tmp_path / "run"
    args = rl_args(tiny_model_dir, data, run, "--rollout", "hf", "--max-steps", "2")
    args[args.index("--nproc") + 1] = "1"
    res = run_cli("grpo", *args, env={"RLCTL_PROFILE": "2:2"})
    assert res.returncode == 0, failure(res, run)
    table = (run / "profile" / "rank0.txt").read_text()
    assert "time/update" in table and "time/rollout" in table
    assert (run / "profile" / "rank0.trace.json").exists()


def test_step_metrics_merge_sums_the_phases_several_steps_time():
    """The RL steps return their metrics; a step's record joins them, adding up the seconds of a phase
    that several steps time (reference, old and value passes: time/logprobs) and keeping the rest."""
    from rlctl.recipes.rl.metrics import merged, timed

    m: dict[str, float] = {}
    with timed(m, "time/logprobs"):
        pass
    assert m["time/logprobs"] >= 0.0
    parts = ({"time/logprobs": 0.25, "kl": 0.5}, {"time/logprobs": 0.5, "entropy": 2.0}, {"time/update": 1.0}, {})
    assert merged(*parts) == {"time/logprobs": 0.75, "kl": 0.5, "entropy": 2.0, "time/update": 1.0}
