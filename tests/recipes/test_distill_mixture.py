"""GKD's two knobs on ``algo.distill=full`` (docs/distill.md): the divergence (``algo.distill_beta``, TRL's
generalized JSD) against a hand computation, TRL's own function and plain transformers forwards; and the
mixture (``--teacher-data``): which steps read the teacher's responses (worked by hand), how its rows are
tokenized (as an RL prompt and an sft response), which rows a step reads, and whole runs that alternate, resume
and refuse bad settings in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.recipes.test_distill import sharp_teacher
from tests.support.cli import run_cli
from tests.support.rl import arith_rows, error_line, failure, rl_args, train_records
from tests.support.sft import write_jsonl

BETAS = [0.0, 0.3, 0.5, 1.0]


def hand_jsd(student: list[float], teacher: list[float], beta: float, temperature: float) -> float:
    """One position's divergence, term by term over the vocabulary (float64 Python arithmetic)."""

    def softmax(z):
        e = [math.exp(x / temperature) for x in z]
        return [x / sum(e) for x in e]

    ps, pt = softmax(student), softmax(teacher)
    if beta == 1.0:
        return sum(s * math.log(s / t) for s, t in zip(ps, pt))
    if beta == 0.0:
        return sum(t * math.log(t / s) for s, t in zip(ps, pt))
    m = [(1 - beta) * s + beta * t for s, t in zip(ps, pt)]
    return beta * sum(t * math.log(t / x) for t, x in zip(pt, m)) + (1 - beta) * sum(
        s * math.log(s / x) for s, x in zip(ps, m)
    )


@pytest.mark.parametrize("beta", BETAS)
def test_generalized_jsd_equals_the_definition_worked_term_by_term(beta):
    """Per position against :func:`hand_jsd`; the teacher's padding columns beyond the student's vocabulary are
    dropped; the gradient reaches the student only, and equals ``p_s (g - sum p_s g) / T`` with
    ``g = dJSD/dp_s`` (``(1 - beta)(log p_s - log m)``; ``log p_s - log p_t`` at 1; ``-p_t / p_s`` at 0)."""
    from rlctl.algos.distill import generalized_jsd

    g = torch.Generator().manual_seed(1)
    student = (torch.randn(4, 6, generator=g, dtype=torch.float64) * 2).requires_grad_()
    teacher = (torch.randn(4, 8, generator=g, dtype=torch.float64) * 3).requires_grad_()
    t = 0.7
    got = generalized_jsd(student, teacher, t, beta)
    for i in range(4):
        want = hand_jsd(student[i].tolist(), teacher[i, :6].tolist(), beta, t)
        assert got[i].item() == pytest.approx(want, rel=1e-5, abs=1e-7), (beta, i)
    assert (got > 0).all()
    got.sum().backward()
    assert teacher.grad is None
    with torch.no_grad():
        log_s, log_t = (student / t).log_softmax(-1), (teacher[:, :6] / t).log_softmax(-1)
        p_s = log_s.exp()
        if beta == 0.0:
            gv = -log_t.exp() / p_s
        elif beta == 1.0:
            gv = log_s - log_t
        else:
            log_m = torch.logaddexp(log_s + math.log(1 - beta), log_t + math.log(beta))
            gv = (1 - beta) * (log_s - log_m)
        want_grad = p_s * (gv - (p_s * gv).sum(-1, keepdim=True)) / t
    assert torch.allclose(student.grad, want_grad, atol=1e-6), beta  # (the function computes in fp32)


@pytest.mark.parametrize("beta", BETAS)
def test_generalized_jsd_equals_trls_gkd_loss(beta):
    """Against TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` (the convention ``algo.distill_beta`` follows)."""
    pytest.importorskip("trl", reason="trl is not installed (pip install 'rlctl[bench]'): not compared to TRL")
    from trl.experimental.gkd import GKDTrainer

    from rlctl.algos.distill import generalized_jsd

    g = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(5, 9, generator=g) * 2, torch.randn(5, 9, generator=g) * 3
    ours = generalized_jsd(student, teacher, 0.8, beta).sum()
    trl = GKDTrainer.generalized_jsd_loss(student[None], teacher[None], beta=beta, temperature=0.8, reduction="sum")
    assert ours.item() == pytest.approx(trl.item(), rel=1e-5)


@pytest.mark.parametrize(
    ("fraction", "warmup", "want"),
    [
        (0.5, 0, [None, 0, None, 1, None, 2, None, 3]),  # every other step, the student's first
        (0.25, 2, [0, 1, None, None, None, 2, None, None, None, 3]),  # 2 warm-up steps, then 1 in 4
        (1.0, 0, [0, 1, 2, 3]),  # every step on the teacher's rows (supervised KD)
        (0.0, 3, [0, 1, 2, None, None, None]),  # a warm-up, then on-policy only
        (1 / 3, 0, [None, None, 0, None, None, 1, None, None, 2]),
    ],
)
def test_which_steps_read_the_teacher_data_is_worked_by_hand(fraction, warmup, want):
    from rlctl.algos.distill import teacher_data_index

    assert [teacher_data_index(s, fraction, warmup) for s in range(len(want))] == want


def test_a_tenth_of_a_thousand_steps_read_the_teacher_data():
    """Evenly spread: ``fraction`` of any run's steps, to the step (no float drift)."""
    from rlctl.algos.distill import teacher_data_index

    for fraction in (0.1, 0.3, 0.7):
        on = [s for s in range(1000) if teacher_data_index(s, fraction, 0) is not None]
        assert len(on) == round(1000 * fraction)
        assert [teacher_data_index(s, fraction, 0) for s in on] == list(range(len(on)))


def _cfg(model_dir: Path, **settings):
    from rlctl.config import build_config, dotted_to_nested

    sets = {"model.name": str(model_dir), "rollout.max_prompt_len": 48, "rollout.max_response_len": 12, **settings}
    return build_config("grpo", [dotted_to_nested(sets)])


def test_teacher_rows_are_rl_prompts_and_sft_responses(tiny_model_dir, tmp_path):
    """A pairs row's prompt is the RL prompt of the same text (the chat template's generation prompt included),
    its response the sft tokens after it (the end of turn included), all in the loss; a chat row's second user
    turn is context (mask 0); a prompt over rollout.max_prompt_len is skipped and counted; a response over
    rollout.max_response_len is cut there and marked truncated."""
    from transformers import AutoTokenizer

    from rlctl.data.responses import read_responses
    from rlctl.data.rl import render_prompt

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    chat = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6"},
    ]
    rows = [
        {"prompt": "What is 12 + 7?", "response": "19"},
        {"prompt": "What is " + "9 + " * 30 + "1?", "response": "1"},  # too long a prompt
        {"prompt": "What is 1 + 1?", "response": "The answer is two, of course it is."},  # cut at 12 tokens
    ]
    cfg = _cfg(tiny_model_dir, **{"data.max_bad_fraction": 0.5})
    got, report = read_responses(str(write_jsonl(tmp_path / "t.jsonl", rows)), tok, cfg)
    assert report.total == 3 and dict(report.bad) == {"prompt longer than rollout.max_prompt_len": 1}
    pair, cut = got
    assert pair.prompt == render_prompt("What is 12 + 7?", tok, "prompt")
    assert tok.decode(pair.response).startswith("19") and pair.mask == [1] * len(pair.response)
    assert not pair.truncated and len(pair.response) <= 12
    long = _cfg(tiny_model_dir, **{"rollout.max_response_len": 200})
    (multi,), _ = read_responses(str(write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])), tok, long)
    assert multi.prompt == render_prompt([chat[0]], tok, "prompt")
    assert 0 in multi.mask and multi.mask[0] == 1 and multi.mask[-1] == 1  # "4", then the user's turn, then "6"
    context = tok.decode([t for t, m in zip(multi.response, multi.mask) if not m])
    assert "And 3 + 3?" in context
    assert cut.truncated and len(cut.response) == 12 and cut.mask == [1] * 12


def test_a_step_reads_the_next_rows_of_a_shuffled_pass_split_over_the_ranks():
    """Each step on the teacher's rows reads batch_size x n rows, the two ranks' shares disjoint and together
    the whole block; two passes over the file read every row once each, in different orders."""
    from rlctl.data.responses import ResponseRow
    from rlctl.recipes.rl.teacher import TeacherData

    rows = [ResponseRow([1, 2], [10 + i, 3], [1, 1], False) for i in range(16)]
    data = TeacherData(rows, 0.5, 0, seed=3)
    read = []
    for k in range(4):  # 4 steps x 2 prompts x 4 samples = 32 rows = two passes of 16
        parts = [data.batch(k, n=4, batch_size=2, mini=2, rank=r, world=2, width=4, device="cpu") for r in (0, 1)]
        uids = sorted(int(u) for p in parts for u in p.uid)
        assert uids == list(range(8))  # position * n + j: each rank one prompt's group of 4
        read.append([p.responses[i][0] - 10 for p in parts for i in range(len(p))])
        assert all(p.mask.sum() == 8 for p in parts)
    first, second = read[0] + read[1], read[2] + read[3]
    assert sorted(first) == sorted(second) == list(range(16)) and first != second


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_an_update_on_teacher_rows_equals_the_divergence_of_plain_forwards(
    tiny_model_dir, tmp_path, process_group, beta
):
    """The step on the teacher's rows through the trainer's parts (the rows' batch, the FSDP engine's packed
    micro-batch, the teacher forwarded per micro-batch): the loss and every gradient equal the token-mean
    divergence at the rows' response positions from plain transformers forwards (fp32, 1e-5); the policy term is
    0 (advantages 0), so only the divergence trains."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlctl.algos.distill import divergence_metric, generalized_jsd
    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.recipes.rl.batch import micro_batches
    from rlctl.recipes.rl.spec import AlgoSpec
    from rlctl.recipes.rl.teacher import Teacher
    from rlctl.recipes.rl.update import policy_loss_fn
    from tests.support.sft import cpu_spec

    teacher_dir = sharp_teacher(tiny_model_dir, tmp_path / "teacher")
    rows = [{"prompt": r["prompt"], "response": f"The answer is {r['answer']}."} for r in arith_rows(4, seed=5)]
    data = write_jsonl(tmp_path / "teacher.jsonl", rows)
    settings = {
        "model.attn": "sdpa",
        "model.dtype": "fp32",
        "algo.teacher": str(teacher_dir),
        "algo.distill": "full",
        "algo.distill_beta": beta,
        "algo.teacher_data": str(data),
        "rollout.temperature": 0.7,
    }
    cfg = _cfg(tiny_model_dir, **settings)
    spec = cpu_spec(cfg)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    teacher = Teacher.for_run(cfg, spec, tok)
    b = teacher.data.batch(0, n=2, batch_size=2, mini=2, rank=0, world=1, width=12, device="cpu")
    b.advantages = torch.zeros_like(b.mask)
    b.old_logp = b.rollout_logp = torch.zeros_like(b.mask)
    student = FSDPEngine(spec, role="actor", trainable=True)
    algo = AlgoSpec.from_config(cfg)
    tokens = float(b.mask.sum())
    loss_fn = policy_loss_fn(
        b, algo, {"global_tokens": tokens, "global_seqs": 4.0, "norm_len": algo.norm_len}, 0.0, teacher.in_loss
    )
    outs = student.forward_backward(micro_batches(b, [0, 1, 2, 3], budget=96, pad_id=0, device="cpu"), loss_fn)
    assert len(outs) > 1  # packed micro-batches, the teacher forwarded per micro-batch
    got = {n: p.grad.full_tensor().clone() for n, p in student.model.named_parameters()}

    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="eager")
    t_model = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32, attn_implementation="eager")
    total = torch.zeros(())
    for p, r in zip(b.prompts, b.responses):  # every row's response tokens are in the loss (pairs rows)
        ids, span = torch.tensor([p + r]), slice(len(p) - 1, len(p) + len(r) - 1)
        with torch.no_grad():
            t_logits = t_model.eval()(input_ids=ids).logits[0, span]
        total = total + generalized_jsd(plain(input_ids=ids).logits[0, span], t_logits, 0.7, beta).sum()
    want = total / tokens
    want.backward()
    got_loss = sum(o[divergence_metric(beta)].item() for o in outs) / tokens
    assert got_loss == pytest.approx(want.item(), abs=1e-5)
    assert want.item() > 0.05
    params = dict(plain.named_parameters())
    for name, grad in got.items():
        assert torch.allclose(grad, params[name.replace("_orig_mod.", "")].grad, atol=1e-5), name


@pytest.mark.slow
def test_a_run_alternates_student_and_teacher_steps_and_resumes_to_the_same_metrics(tmp_path):
    """``--teacher-data`` with a warm-up of 1 and fraction 0.5 on 2 processes: steps 1, 3, 5 train on the
    teacher's rows (no reward, ``distill/teacher_data``), 2 and 4 on samples; stopped after step 3 and resumed,
    the run logs the same divergence and grad norm at every step as one that ran through (the rows a step reads
    are a function of the step)."""
    from rlctl.testing import build_tiny_model

    student = build_tiny_model(tmp_path / "student", vocab_size=128)
    teacher = sharp_teacher(student, tmp_path / "teacher", steps=10)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", arith_rows(8))
    answers = [{"prompt": r["prompt"], "response": f"The answer is {r['answer']}."} for r in arith_rows(8)]
    data = write_jsonl(tmp_path / "answers.jsonl", answers)
    extra = ["--rollout", "hf", "--teacher", str(teacher), "--teacher-data", str(data), "--set", "algo.distill=full"]
    extra += ["--set", "algo.teacher_data_warmup=1", "--set", "algo.distill_beta=0.5", "--batch-size", "2"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    res = run_cli("grpo", *rl_args(student, prompts, whole, *extra, "--max-steps", "5", "--samples-every", "1"))
    assert res.returncode == 0, failure(res, whole)
    res = run_cli(
        "grpo", *rl_args(student, prompts, parts, *extra, "--max-steps", "5"), env={"RLCTL_STOP_AFTER_STEP": "3"}
    )
    assert res.returncode == 130, failure(res, parts)
    res = run_cli("grpo", *rl_args(student, prompts, parts, *extra, "--max-steps", "5", "--resume", "auto"))
    assert res.returncode == 0, failure(res, parts)
    a, b = train_records(whole), train_records(parts)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert [("reward" in r, r.get("distill/teacher_data")) for r in a] == [
        (False, 1.0), (True, None), (False, 1.0), (True, None), (False, 1.0)
    ]  # fmt: skip
    for x, y in zip(a, b):
        assert x["distill/jsd"] == pytest.approx(y["distill/jsd"], rel=1e-5), x["step"]
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5), x["step"]
        assert x["tokens"] > 0
    assert all(r["distill/jsd"] > 0 for r in a)
    samples = [json.loads(line)["step"] for line in (whole / "samples.jsonl").read_text().splitlines()]
    assert sorted(set(samples)) == [2, 4]  # a step on the teacher's rows writes no samples


FULL = {"algo.teacher": "t", "algo.distill": "full"}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"algo.teacher_data": "x.jsonl"}, "--teacher-data is set without a teacher"),
        ({"algo.teacher_data": "x.jsonl", "algo.teacher": "t"}, "add --set algo.distill=full"),
        ({"algo.teacher_data_warmup": 2}, "set without --teacher-data FILE"),
        ({**FULL, "algo.teacher_data": "x", "algo.teacher_data_fraction": 2}, r"fraction=2.0 must be in \[0, 1\]"),
        ({**FULL, "algo.distill_beta": 1.5}, r"algo.distill_beta=1.5 must be in \[0, 1\]"),
        ({"algo.teacher": "t", "algo.distill_beta": 0.5}, "picks algo.distill=full's divergence"),
        (
            {**FULL, "algo.teacher_data": "x", "rollout.procs": 1},
            "--teacher-data with --rollout-procs 1",
        ),
    ],
)  # fmt: skip
def test_mixture_settings_are_refused_in_one_line(settings, message):
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.config.algorithm import check_algorithm
    from rlctl.errors import UserError

    with pytest.raises(UserError, match=message) as err:
        check_algorithm(build_config("grpo", [dotted_to_nested({"model.name": "Qwen2.5-0.5B", **settings})]))
    assert "\n" not in str(err.value)


def test_a_missing_teacher_data_file_is_refused_before_launch(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(4))
    run = tmp_path / "run"
    args = [
        "--teacher",
        str(tiny_model_dir),
        "--teacher-data",
        str(tmp_path / "none.jsonl"),
        "--set",
        "algo.distill=full",
    ]
    for extra in ([], ["--dry-run"]):
        res = run_cli("grpo", *rl_args(tiny_model_dir, data, run, *args, *extra))
        assert res.returncode != 0 and error_line(res).startswith("error: --teacher-data: data not found"), res.stderr
        assert "Traceback" not in res.stderr and not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_estimate_counts_the_tensors_the_divergence_saves_for_its_backward(beta):
    """The estimator's bytes per teacher logit beside the compute dtype equal what ``generalized_jsd`` saves for
    its backward, counted here with saved-tensor hooks on bf16 logits (the fp32 tensors of [N, V] values)."""
    from rlctl.algos.distill import generalized_jsd
    from rlctl.estimate.training import divergence_bytes

    n, v = 16, 300
    student, teacher = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True), torch.randn(n, v).bfloat16()
    saved: dict = {}

    def pack(x):
        if x.numel() == n * v and x.dtype == torch.float32:
            saved[x.data_ptr()] = x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        generalized_jsd(student, teacher, 0.7, beta)
    assert sum(saved.values()) == divergence_bytes(beta)
