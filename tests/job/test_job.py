"""Every problem found before launch: one line naming the fix, exit 2, no run directory, in well under a second.

The CLI runs in a subprocess as a user runs it; the data and models are real files (a tiny HF model).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlctl.errors import UserError
from tests.support.cli import run_cli
from tests.support.sft import chat_rows, write_jsonl

SHORT = ("--max-prompt-len", "48", "--max-response-len", "12")
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # this machine shows no GPU, whatever it has


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_dir):
    """Data files and model variants, each with one thing wrong."""
    root = tmp_path_factory.mktemp("inputs")
    write_jsonl(root / "rl.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 4)
    write_jsonl(root / "rl_unknown_source.jsonl", [{"prompt": "1+1=", "answer": "2", "data_source": "my/set"}] * 4)
    write_jsonl(root / "chat.jsonl", chat_rows(4))
    write_jsonl(root / "wrong.jsonl", [{"question": "1+1=", "solution": "2"}] * 4)
    (root / "empty.jsonl").write_text("")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["1+1="], "solution": ["2"]}), root / "wrong.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), root / "empty.parquet")
    no_template = root / "no_template"
    no_template.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_model_dir / name, no_template / name)
    tok = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    tok.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(tok))
    remote = root / "remote"
    remote.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update(model_type="my_own_arch", auto_map={"AutoConfig": "modeling_mine.MyConfig"})
    (remote / "config.json").write_text(json.dumps(config))
    return root


def _cases(root: Path, model: Path) -> list[tuple[str, list[str], str]]:
    m, cpu = str(model), ["--device", "cpu", "--nproc", "2"]
    rl = str(root / "rl.jsonl")
    return [
        ("no GPU", ["grpo", "--model", "Qwen2.5-7B", "--gpus", "8", "--data", rl], "no GPU is visible"),
        ("sft on cuda", ["sft", "--model", m, "--device", "cuda", "--data", str(root / "chat.jsonl")], "--device cpu"),
        (
            "does not fit",
            ["sft", "--model", "Qwen2.5-72B", "--gpus", "1", "--gpu", "A100-40GB", "--data", rl],
            "--ignore-memory-check",
        ),
        ("empty jsonl", ["grpo", "--model", m, *cpu, *SHORT, "--data", str(root / "empty.jsonl")], "holds no rows"),
        ("empty parquet", ["grpo", "--model", m, *cpu, *SHORT, "--data", str(root / "empty.parquet")], "no rows"),
        (
            "wrong parquet columns",
            ["grpo", "--model", m, *cpu, *SHORT, "--reward", "exact", "--data", str(root / "wrong.parquet")],
            "no 'prompt' column (the rows have question, solution)",
        ),
        (
            "wrong sft columns",
            ["sft", "--model", m, *cpu, "--data", str(root / "wrong.jsonl")],
            "sft needs a 'messages' column",
        ),
        ("no data_source", ["grpo", "--model", m, *cpu, *SHORT, "--data", rl], "without a data_source"),
        (
            "data_source without a reward",
            ["grpo", "--model", m, *cpu, *SHORT, "--data", str(root / "rl_unknown_source.jsonl")],
            "'my/set' has no built-in reward",
        ),
        ("grpo gae", ["grpo", "--model", m, *cpu, *SHORT, "--adv", "gae", "--data", rl], "needs a critic"),
        ("ppo grpo", ["ppo", "--model", m, *cpu, *SHORT, "--adv", "grpo", "--data", rl], "needs no critic"),
        ("one sample", ["grpo", "--model", m, *cpu, *SHORT, "--n", "1", "--data", rl], "set rollout.n >= 2"),
        (
            "adaptive kl",
            ["grpo", "--model", m, *cpu, *SHORT, "--kl-coef", "0", "--set", "algo.kl_target=6", "--data", rl],
            "needs an initial algo.kl_coef",
        ),
        (
            "no chat template",
            ["sft", "--model", str(root / "no_template"), *cpu, "--data", str(root / "chat.jsonl")],
            "has no chat template",
        ),
        (
            "context",
            [
                "grpo",
                "--model",
                m,
                *cpu,
                "--reward",
                "exact",
                "--max-prompt-len",
                "400",
                "--max-response-len",
                "200",
                "--data",
                rl,
            ],
            "400 + 200 is longer than the model's context of 512 tokens",
        ),
        (
            "remote code",
            ["sft", "--model", str(root / "remote"), *cpu, "--data", str(root / "chat.jsonl")],
            "pass --trust-remote-code",
        ),
    ]


def test_every_pre_launch_error_is_one_line_exit_2_and_leaves_no_run_dir(files, tiny_model_dir, tmp_path):
    timings = {}
    for name, args, needle in _cases(files, tiny_model_dir):
        out = tmp_path / name.replace(" ", "_")
        start = time.perf_counter()
        r = run_cli(*args, "--output-dir", str(out), env=NO_GPU, cwd=tmp_path)
        timings[name] = time.perf_counter() - start
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
        assert r.returncode == 2, (name, r.stdout, r.stderr)
        assert len(lines) == 1 and lines[0].startswith("error:"), (name, lines)
        assert needle in lines[0], (name, lines[0])
        assert not out.exists(), f"{name}: a job that never started left {out}"
    assert not (tmp_path / "runs").exists()
    # how fast is measured, not asserted (docs/errors.md has the figures): print it for the log
    print({k: round(v, 2) for k, v in timings.items()})


def test_grpo_help_does_not_offer_gae():
    r = run_cli("grpo", "--help-all", env={"COLUMNS": "200"})
    adv = next(ln for ln in r.stdout.splitlines() if "--adv" in ln)
    assert "gae" not in adv and "rloo" in adv
    adv = next(ln for ln in run_cli("ppo", "--help-all", env={"COLUMNS": "200"}).stdout.splitlines() if "--adv" in ln)
    assert "gae" in adv


def test_checks_take_well_under_a_second_in_process(files, tiny_model_dir, tmp_path):
    """resolve + check of a good job that will launch: the cost the user pays before torchrun starts."""
    from rlctl.job import ready_to_launch, resolve_job

    opts = {
        "model.name": str(tiny_model_dir),
        "data.path": str(files / "rl.jsonl"),
        "hardware.device": "cpu",
        "hardware.nproc": 2,
        "reward.fn": "exact",
        "rollout.max_prompt_len": 48,
        "rollout.max_response_len": 12,
        "output_dir": str(tmp_path / "run"),
    }
    resolve_job("grpo", options=opts)  # warm the imports
    start = time.perf_counter()
    ready_to_launch(resolve_job("grpo", options=opts))
    assert time.perf_counter() - start < 1.0
    from rlctl.runtime.run_lock import LOCK_NAME, held

    assert [p.name for p in (tmp_path / "run").iterdir()] == [LOCK_NAME]  # owned (issue 37), nothing written
    held(tmp_path / "run").release()
    assert not (tmp_path / "run").exists()


def test_trust_remote_code_lets_the_remote_check_pass(files):
    from rlctl.config import build_config
    from rlctl.modelfiles import check_remote_code, model_files

    model = model_files(str(files / "remote"))
    cfg = build_config("sft", [{"model": {"name": str(files / "remote")}}])
    with pytest.raises(UserError, match="--trust-remote-code"):
        check_remote_code(cfg, model)
    cfg.model.trust_remote_code = True
    check_remote_code(cfg, model)
    # a known model type with an auto_map (e.g. a Qwen2 repo that ships its code too) needs no flag
    known = model_files(str(files / "remote"))
    known.config["model_type"] = "qwen2"
    cfg.model.trust_remote_code = False
    check_remote_code(cfg, known)


def test_cuda_visible_follows_cuda_visible_devices(monkeypatch):
    from rlctl.checks import gpu_visible

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not gpu_visible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert not gpu_visible()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_visible() == any(p.startswith("nvidia") and p[6:].isdigit() for p in os.listdir("/dev"))


def test_first_rows_reads_only_the_head(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlctl.data.io import first_rows

    lines = ["not json", ""] + [json.dumps({"prompt": str(i), "answer": i}) for i in range(100)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    rows, columns = first_rows(tmp_path / "d.jsonl", n=5)
    assert [r["answer"] for r in rows] == [0, 1, 2, 3, 4] and columns == ["answer", "prompt"]
    (tmp_path / "junk.jsonl").write_text("x\ny\n")
    assert first_rows(tmp_path / "junk.jsonl") is None  # unreadable lines are the ranks' bad rows, not "empty"
    (tmp_path / "blank.jsonl").write_text("\n\n")
    assert first_rows(tmp_path / "blank.jsonl") == ([], [])
    pq.write_table(pa.table({"q": list(range(50)), "a": ["x"] * 50}), tmp_path / "d.parquet")
    rows, columns = first_rows(tmp_path / "d.parquet", n=3)
    assert rows == [{"q": 0, "a": "x"}, {"q": 1, "a": "x"}, {"q": 2, "a": "x"}] and columns == ["q", "a"]


def test_the_algorithm_check_reads_the_registry_without_torch():
    """rlctl.checks checks algorithm choices from the registry the ranks use, in a process without torch."""
    code = (
        "import sys\n"
        "from rlctl.config import build_config\n"
        "from rlctl.config.algorithm import check_algorithm\n"
        "from rlctl.errors import UserError\n"
        "try:\n"
        "    check_algorithm(build_config('grpo', [{'algo': {'adv': 'gae'}}]))\n"
        "except UserError as e:\n"
        "    print(e)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == (
        "grpo cannot use --adv gae: it needs a critic, use `rlctl ppo` (or --adv grpo | rloo | reinforce_pp | "
        "grpo_passk | reinforce_plus_plus_baseline | opo | gpg | remax)"
    )


def test_a_malformed_rlctl_profile_is_refused_before_launch(files, tiny_model_dir, tmp_path):
    rl = str(files / "rl.jsonl")
    out = tmp_path / "run"
    args = [
        "grpo",
        "--model",
        str(tiny_model_dir),
        "--device",
        "cpu",
        *SHORT,
        "--reward",
        "exact",
        "--max-steps",
        "1",
        "--data",
        rl,
    ]
    r = run_cli(*args, "--output-dir", str(out), env={**NO_GPU, "RLCTL_PROFILE": "3-6"}, cwd=tmp_path)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.stdout, r.stderr)
    assert "RLCTL_PROFILE='3-6' is not a step range: use START:END" in lines[0]
    assert not out.exists()


def test_the_memory_check_reads_the_verdict_and_the_advice_not_the_reasons():
    from rlctl.checks import IGNORE_MEMORY_FLAG, check_memory
    from rlctl.config import build_config
    from rlctl.plan import LocalEnv, resolve_plan
    from rlctl.presets import method_layers

    layer = {"model": {"name": "Qwen2.5-72B"}, "hardware": {"gpus": 1, "gpu": "A10G-24GB"}}
    plan = resolve_plan(build_config("sft", method_layers("sft", None) + [layer]), local=LocalEnv())
    assert not plan.fits and plan.advice
    check_memory(plan, ignore=True)  # --ignore-memory-check: no error
    plan.decisions = []  # the words of the decisions play no part
    with pytest.raises(UserError) as e:
        check_memory(plan, ignore=False)
    want = (
        f"the plan does not fit in memory: {'; '.join(plan.estimate.problems)}; "
        f"what would fit: {'; or '.join(plan.advice)}; pass {IGNORE_MEMORY_FLAG} to launch anyway"
    )
    assert str(e.value) == " ".join(want.split())
