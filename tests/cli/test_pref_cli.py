"""`rlctl dpo` and `rlctl rm` from the command line without running: --dry-run plans them (the recipe each
launches), `rlctl estimate memory --method dpo|rm` counts a per-step reference model and the reward model's
scalar head (checked against the parameter counts by hand), and bad input is one line before launch."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import one_line_error, rlctl_in_process
from tests.support.pref import format_pairs
from tests.support.sft import write_jsonl


@pytest.fixture()
def pairs(tmp_path):
    return write_jsonl(tmp_path / "pairs.jsonl", format_pairs(8))


@pytest.mark.parametrize("method", ["dpo", "rm"])
def test_dry_run_plans_the_method(method, pairs, monkeypatch, capsys):
    code, out = rlctl_in_process(
        monkeypatch, capsys, method, "--model", "Qwen2.5-7B", "--data", str(pairs), "--gpus", "8", "--dry-run", "--json"
    )
    assert code == 0, out
    doc = json.loads(out)
    assert doc["config"]["method"] == method and doc["plan"]["backend"] == "fsdp"
    assert doc["launch"][-4:-2] == ["-m", f"rlctl.recipes.{method}"]
    assert doc["estimate"]["settings"]["method"] == method


def _training(monkeypatch, capsys, *args: str) -> dict:
    code, out = rlctl_in_process(
        monkeypatch, capsys, "estimate", "memory", "--model", "Qwen2.5-7B", "--gpus", "8", "--micro-batch", "1",
        "--json", *args,
    )  # fmt: skip
    assert code == 0, out
    return json.loads(out)["phases"]["training"]["components"]


def test_estimate_counts_dpos_reference_and_the_reward_models_head(monkeypatch, capsys):
    from rlctl.catalog import count_params, resolve_model
    from rlctl.catalog.count import lm_head_params

    spec = resolve_model("Qwen2.5-7B")
    n = count_params(spec)
    cached = _training(monkeypatch, capsys, "--method", "dpo")
    per_step = _training(monkeypatch, capsys, "--method", "dpo", "--no-precompute-ref")
    lora = _training(monkeypatch, capsys, "--method", "dpo", "--no-precompute-ref", "--lora-rank", "16")
    assert cached["reference_model"] == 0 and lora["reference_model"] == 0  # freed before training / adapters off
    assert per_step["reference_model"] == pytest.approx(2 * n / 8, rel=1e-6)  # bf16, sharded over 8 GPUs
    rm = _training(monkeypatch, capsys, "--method", "rm")
    sft = _training(monkeypatch, capsys, "--method", "sft", "--max-len", "2048")
    assert rm["logits"] == 0 and sft["logits"] > 0  # a scalar head: no vocabulary-wide logits
    body = n - lm_head_params(spec) + spec.hidden_size + 1  # the critic-shaped model: no output head, one score
    assert rm["weights"] == pytest.approx(4 * body / 8, rel=1e-3)
    dpo_2048 = _training(monkeypatch, capsys, "--method", "dpo", "--max-len", "1024")
    assert dpo_2048["activations"] == sft["activations"]  # a pair of 1024-token sequences = one 2048-token one


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--loss", "sigmod"], "pref.loss='sigmod' is not valid (did you mean sigmoid"),
        (["--beta", "0"], "pref.beta=0.0 must be > 0"),
        (["--label-smoothing", "0.5"], "pref.label_smoothing=0.5 must be in [0, 0.5)"),
        (["--backend", "megatron"], "needs the Megatron engine, which does not run rlctl dpo yet"),
    ],
)
def test_bad_settings_are_one_line(args, problem, pairs, monkeypatch, capsys):
    code, out = rlctl_in_process(
        monkeypatch, capsys, "dpo", "--model", "Qwen2.5-7B", "--data", str(pairs), "--gpus", "8", "--dry-run", *args
    )
    assert problem in one_line_error(code, out)


def test_rows_without_pairs_are_one_line_before_launch(tiny_model_dir, tmp_path, monkeypatch, capsys):
    sft_rows = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Q", "response": "A"}] * 4)
    code, out = rlctl_in_process(
        monkeypatch, capsys, "dpo", "--model", str(tiny_model_dir), "--data", str(sft_rows), "--device", "cpu",
        "-o", str(tmp_path / "run"),
    )  # fmt: skip
    line = one_line_error(code, out)
    assert "no row of the first 4 is a preference row (no 'chosen' and 'rejected' fields)" in line
    assert "the rows have prompt, response" in line and not (tmp_path / "run").exists()


def test_a_plugin_registers_a_preference_loss(pairs, tmp_path, monkeypatch, capsys):
    plugin = tmp_path / "my_pref.py"
    plugin.write_text(
        "from rlctl.algos.preference import register_pref_loss\n\n"
        "@register_pref_loss('my_sigmoid_test', needs_ref=True, beta=0.2)\n"
        "def my_loss(b, *, beta, label_smoothing=0.0, gamma=0.0):\n"
        "    raise NotImplementedError\n"
    )
    args = ["dpo", "--model", "Qwen2.5-7B", "--data", str(pairs), "--gpus", "8", "--dry-run", "--json"]
    code, out = rlctl_in_process(monkeypatch, capsys, *args, "--loss", "my_sigmoid_test", "--plugin", str(plugin))
    assert code == 0, out
    assert json.loads(out)["config"]["pref"]["loss"] == "my_sigmoid_test"


def test_rm_of_a_model_that_is_not_a_causal_lm_is_one_line_before_launch(
    tiny_model_dir, pairs, tmp_path, monkeypatch, capsys
):
    import shutil

    model = tmp_path / "encoder"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2Model"]}))
    args = ["rm", "--model", str(model), "--data", str(pairs), "--device", "cpu", "-o", str(tmp_path / "run")]
    line = one_line_error(*rlctl_in_process(monkeypatch, capsys, *args))
    assert "rlctl rm builds a reward model from a causal LM" in line and "is Qwen2Model" in line
