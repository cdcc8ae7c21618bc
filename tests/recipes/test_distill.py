"""On-policy distillation (``rlctl grpo --teacher``): the advantage is the teacher-minus-student log-prob of
each sampled token, checked against plain transformers forwards of both models; a tiny student run under
torchrun lowers its reverse KL to the teacher on held-out prompts; a teacher with another vocabulary is
refused before launch."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.cli import run_cli
from tests.support.rl import arith_rows, error_line, failure, rl_args, train_records
from tests.support.sft import write_jsonl


def sharp_teacher(student_dir: Path, out: Path, *, seed: int = 1, steps: int = 40, **config) -> Path:
    """A tiny teacher with the student's tokenizer: another random init (``seed``) trained ``steps`` full-batch
    Adam steps (plain torch) to answer the arithmetic prompts "The answer is N.", so its next-token
    distribution is peaked where the random student's is near uniform. ``config``: the tiny config's overrides."""
    from transformers import AutoTokenizer

    from rlctl.testing import save_tiny_model

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    model = save_tiny_model(out, tok, seed=seed, **config)
    rows = arith_rows(32, seed=seed)
    chats = [
        [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": f"The answer is {r['answer']}."}]
        for r in rows
    ]
    batch = tok.apply_chat_template(chats, return_tensors="pt", padding=True, return_dict=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(seed)
    model.train()
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def plain_logp(model_dir: Path, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([prompt + response])).logits[0] / temperature
    sel = logits[len(prompt) - 1 : len(prompt) + len(response) - 1]
    return sel.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def tool_batch():
    """Two rows of a rollout batch; row 0's tokens 2-3 are a tool's (context, loss mask 0)."""
    from rlctl.recipes.rl.batch import RolloutBatch

    prompts, responses = [[5, 9, 33, 2], [7, 8, 100]], [[40, 41, 42, 43, 44], [50, 51, 52]]
    masks = [[1, 1, 0, 0, 1], [1, 1, 1]]
    zeros = [[0.0] * len(r) for r in responses]
    b = RolloutBatch.build(
        prompts, responses, zeros, [0, 1], n=1, batch_size=2, mini_batch_size=0, width=6, loss_masks=masks
    )
    return prompts, responses, masks, b


def three_rows():
    """Three rows of as many tokens and response tokens (4 + 5), each its own micro-batch at a 9-token budget, so
    teacher logits paired with another row's would have the right shape and the wrong values; row 0's tokens 2-3
    are a tool's (loss mask 0)."""
    from rlctl.recipes.rl.batch import RolloutBatch

    prompts, responses = [[5, 9, 33, 2], [7, 8, 100, 4], [11, 3, 60, 2]], [[40, 41, 42, 43, 44], [50, 51, 52, 6, 7]]
    responses.append([61, 62, 63, 64, 65])
    masks = [[1, 1, 0, 0, 1], [1] * 5, [1] * 5]
    zeros = [[0.0] * 5 for _ in responses]
    b = RolloutBatch.build(
        prompts, responses, zeros, [0, 1, 2], n=1, batch_size=3, mini_batch_size=0, width=6, loss_masks=masks
    )
    return prompts, responses, masks, b


def test_distill_advantage_is_teacher_minus_student_logp_of_plain_forwards(tiny_model_dir, tmp_path, process_group):
    """The trainer's path (the actor's log-probs, the teacher engine, the mix) against plain HF forwards of the
    two models; tokens with mask 0 (a tool turn in the middle of a row) get 0; weight 0.25 mixes in the task's;
    ``algo.teacher_baseline`` subtracts the mean gap over every sampled token of the batch."""
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.recipes.rl.passes import compute_logprobs
    from rlctl.recipes.rl.teacher import Teacher
    from tests.support.sft import cpu_spec

    teacher_dir = sharp_teacher(tiny_model_dir, tmp_path / "teacher")
    prompts, responses, masks, b = tool_batch()
    task = torch.randn(2, 6, generator=torch.Generator().manual_seed(0)) * b.mask
    for weight, baseline in ((1.0, False), (0.25, False), (1.0, True)):
        cfg = build_config(
            "grpo",
            [
                dotted_to_nested(
                    {
                        "model.name": str(tiny_model_dir),
                        "model.attn": "sdpa",
                        "model.dtype": "fp32",
                        "algo.teacher": str(teacher_dir),
                        "algo.teacher_weight": weight,
                        "algo.teacher_baseline": baseline,
                    }
                )
            ],
        )
        spec = cpu_spec(cfg)
        from transformers import AutoTokenizer

        teacher = Teacher.for_run(cfg, spec, AutoTokenizer.from_pretrained(str(tiny_model_dir)))
        student = FSDPEngine(spec, role="ref", trainable=False)
        b.old_logp, _ = compute_logprobs(student, b, temperature=0.7, budget=64, pad_id=0)
        b.advantages = task.clone()
        m = teacher.apply(b, 0.7, 64, 0, None)
        gaps = [
            plain_logp(teacher_dir, p, r, 0.7) - plain_logp(tiny_model_dir, p, r, 0.7)
            for p, r in zip(prompts, responses)
        ]
        mean = torch.cat([g[torch.tensor(k) > 0] for g, k in zip(gaps, masks)]).mean()
        for i, (gap, r) in enumerate(zip(gaps, responses)):
            mask = torch.tensor(masks[i], dtype=torch.float32)
            want = (weight * (gap - mean * baseline) + (1 - weight) * task[i, : len(r)]) * mask
            assert torch.allclose(b.advantages[i, : len(r)], want, atol=1e-5), (weight, baseline, i)
            assert b.advantages[i, len(r) :].abs().sum() == 0
        assert m["distill/reverse_kl"] == pytest.approx(-mean.item(), abs=1e-5)
        assert abs(m["distill/reverse_kl"]) > 0.1  # the two models do differ


def plain_full_kl_loss(
    student, teacher_dir: Path, prompts, responses, masks, temperature: float, beta: float = 1.0
) -> torch.Tensor:
    """The independent computation of ``algo.distill=full``: ``sum_v p_s(v) (log p_s(v) - log p_t(v))`` at each
    position that predicts a response token of mask 1, from plain transformers forwards (one row at a time, no
    packing), averaged over those tokens (token-mean). ``beta`` other than 1: ``generalized_jsd`` of the whole
    vocabulary's logits instead (itself checked term by term and against TRL in test_distill_mixture.py)."""
    from transformers import AutoModelForCausalLM

    from rlctl.algos.distill import generalized_jsd

    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32, attn_implementation="eager")
    total, count = torch.zeros(()), 0
    for p, r, k in zip(prompts, responses, masks):
        ids = torch.tensor([p + r])
        span = slice(len(p) - 1, len(p) + len(r) - 1)
        log_s = (student(input_ids=ids).logits[0, span] / temperature).log_softmax(-1)
        with torch.no_grad():
            log_t = (teacher.eval()(input_ids=ids).logits[0, span] / temperature).log_softmax(-1)
        kl = (log_s.exp() * (log_s - log_t)).sum(-1)
        if beta != 1.0:
            kl = generalized_jsd(log_s * temperature, log_t * temperature, temperature, beta)
        total, count = total + (kl * torch.tensor(k, dtype=torch.float32)).sum(), count + sum(k)
    return total / count


def test_full_distill_loss_and_gradient_equal_plain_reverse_kl_over_the_vocabulary(
    tiny_model_dir, tmp_path, process_group
):
    """``algo.distill=full``: the actor update's loss and its gradient (packed micro-batches of the FSDP engine,
    the teacher engine forwarded per micro-batch) equal the token-mean exact reverse KL at the sampled positions
    of plain transformers forwards, tokens with mask 0 (a tool turn) excluded (fp32, 1e-5)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlctl.config import build_config, dotted_to_nested
    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.recipes.rl.batch import micro_batches
    from rlctl.recipes.rl.spec import AlgoSpec
    from rlctl.recipes.rl.teacher import Teacher
    from rlctl.recipes.rl.update import policy_loss_fn
    from tests.support.sft import cpu_spec

    teacher_dir = sharp_teacher(tiny_model_dir, tmp_path / "teacher")
    prompts, responses, masks, b = tool_batch()
    settings = {
        "model.name": str(tiny_model_dir),
        "model.attn": "sdpa",
        "model.dtype": "fp32",
        "algo.teacher": str(teacher_dir),
        "algo.distill": "full",
        "rollout.temperature": 0.7,
    }
    cfg = build_config("grpo", [dotted_to_nested(settings)])
    spec = cpu_spec(cfg)
    teacher = Teacher.for_run(cfg, spec, AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    student = FSDPEngine(spec, role="actor", trainable=True)
    b.advantages = torch.randn(2, 6) * b.mask
    assert teacher.apply(b, 0.7, 64, 0, None) == {} and b.advantages.abs().sum() == 0  # weight 1: no task share
    algo = AlgoSpec.from_config(cfg)
    b.old_logp, b.rollout_logp = torch.zeros_like(b.mask), torch.zeros_like(b.mask)
    tokens = float(b.mask.sum())
    loss_fn = policy_loss_fn(
        b, algo, {"global_tokens": tokens, "global_seqs": 2.0, "norm_len": algo.norm_len}, 0.0, teacher.in_loss
    )
    micro = micro_batches(b, [0, 1], budget=64, pad_id=0, device=b.mask.device)
    (out,) = student.forward_backward(micro, loss_fn)
    got = {n: p.grad.full_tensor().clone() for n, p in student.model.named_parameters()}

    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="eager")
    want_loss = plain_full_kl_loss(plain, teacher_dir, prompts, responses, masks, 0.7)
    want_loss.backward()
    assert out["distill/reverse_kl"].item() / tokens == pytest.approx(want_loss.item(), abs=1e-5)
    assert want_loss.item() > 0.1  # the two models do differ
    want = dict(plain.named_parameters())
    for name, g in got.items():
        key = name if name in want else name.replace("_orig_mod.", "")
        assert torch.allclose(g, want[key].grad, atol=1e-5), name
    assert sum(g.abs().sum() for g in got.values()) > 0


#: the worker's log-prob pass: loss ``sum (W_LOGP * log p(y) + W_ENTROPY * H) / tokens`` over the tokens of mask 1
W_LOGP, W_ENTROPY, TEMPERATURE = 1.0, -0.3, 0.7
PARALLEL_WORKER = Path(__file__).resolve().parents[1] / "support" / "scripts" / "distill_full_parallel.py"
#: 700 tokens, so that both tp ranks' vocabulary columns (512 each after the padding to 1024) hold real tokens;
#: 4 heads and 2 KV heads, which sp 2 and tp 2 split
SPLIT_MODEL = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2)


@pytest.fixture(scope="module")
def split_models(tmp_path_factory) -> tuple[Path, Path]:
    from rlctl.testing import build_tiny_model

    root = tmp_path_factory.mktemp("distill_split")
    student = build_tiny_model(root / "student", vocab_size=700, **SPLIT_MODEL)
    return student, sharp_teacher(student, root / "teacher", **SPLIT_MODEL)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "beta"), [("sp", 1.0), ("tp", 1.0), ("tp", 0.5)])
def test_full_distill_under_ulysses_sp2_and_megatron_tp2_equals_plain_reverse_kl(split_models, tmp_path, mode, beta):
    """``algo.distill=full`` on 2 ranks that split one student and one teacher: Ulysses sp 2 (FSDP; each rank
    the same sequence shard of both models' logits) and Megatron tp 2 (each rank its vocabulary columns of both,
    the softmaxes' max and sum and the KL all-reduced, the teacher's logits never gathered). The update's
    summed reverse KL and the student's full gradients equal the single-process full-vocabulary computation
    from plain transformers (fp32, 1e-5); at tp 2 also the vocab-parallel KL of random logits whose two slices
    have different maxima, and its gradient, against ``full_reverse_kl`` of the whole tensor. ``beta`` 0.5
    (``algo.distill_beta``, the JSD): the update calls the vocab-parallel JSD, against ``generalized_jsd``."""
    if mode == "tp" and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core not installed (pip install --no-deps megatron-core)")
    student, teacher = split_models
    r = _parallel_worker(mode, student, teacher, tmp_path, beta)
    # sp: the sequence shards; tp: the vocabulary columns (never gathered), in both passes
    assert r["seen"] == (["ShardedLogits"] * 2 if mode == "sp" else ["VocabParallelLogits"] * 2)
    if mode == "tp":
        assert r["tp"] == 2 and r["shard"] == (0, 512)  # rank 0's columns of the padded 1024: 512 of the 700
        rnd = r["random"]
        assert torch.allclose(rnd["split"], rnd["full"], atol=1e-5) and torch.allclose(
            rnd["grad"], rnd["want_grad"], atol=1e-6
        )
    else:
        assert r["sp"] == 2
    prompts, responses, masks, _ = tool_batch()
    _check_update(r, student, teacher, prompts, responses, masks, beta)
    _check_logp_pass(r, student, prompts, responses, masks)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "beta"), [("pp", 1.0), ("pp", 0.5), ("tppp", 1.0)])
def test_full_distill_on_megatron_pp2_reads_each_micro_batchs_teacher_logits(split_models, tmp_path, mode, beta):
    """Megatron pp 2 (one layer per stage): the teacher's forward-only pipeline runs before the student's pass
    (``StagedTeacher.fill``) and the last stage's loss reads each micro-batch's kept logits. Three micro-batches of
    the same shape (``three_rows``: logits paired with another row's would fit and be wrong): the update's reverse
    KL (at ``beta`` 0.5 the JSD) and the student's full gradients (gathered over the stages) equal the plain
    computation (fp32, 1e-5). ``tppp``: tp 2 x pp 2 on 4 processes, each last-stage rank keeping its vocabulary
    columns of the teacher's logits."""
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core not installed (pip install --no-deps megatron-core)")
    student, teacher = split_models
    r = _parallel_worker(mode, student, teacher, tmp_path, beta, nproc=4 if mode == "tppp" else 2)
    assert r["pp"] == 2 and r["micro"] == 3 and r["left"] == 0  # each kept tensor read once
    # the loss ran on the last stage, once per micro-batch (at tp 2 on this rank's vocabulary columns)
    assert r["seen"] == ["VocabParallelLogits" if mode == "tppp" else "Tensor"] * 3
    prompts, responses, masks, _ = three_rows()
    _check_update(r, student, teacher, prompts, responses, masks, beta)


def _parallel_worker(
    mode: str, student: Path, teacher: Path, tmp_path: Path, beta: float = 1.0, nproc: int = 2
) -> dict:
    """What ``distill_full_parallel.py MODE ... BETA`` saved on ``nproc`` processes under torchrun."""
    import subprocess

    from tests.support.cli import REPO, torchrun

    out = tmp_path / "out.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        torchrun(nproc, PARALLEL_WORKER, mode, student, teacher, out, str(beta)),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return torch.load(out, weights_only=False)


def _check_update(r: dict, student: Path, teacher: Path, prompts, responses, masks, beta: float = 1.0) -> None:
    """The worker's update (its summed divergence and full gradients) against :func:`plain_full_kl_loss` (1e-5)."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(student), dtype=torch.float32, attn_implementation="eager")
    want_loss = plain_full_kl_loss(plain, teacher, prompts, responses, masks, 0.7, beta)
    want_loss.backward()
    assert float(r["kl_sum"]) / r["tokens"] == pytest.approx(want_loss.item(), abs=1e-5)
    assert want_loss.item() > 0.05
    want = dict(plain.named_parameters())
    assert r["grads"].keys() == want.keys()
    for name, g in r["grads"].items():
        assert torch.allclose(g, want[name].grad, atol=1e-5), name
    assert sum(g.abs().sum() for g in r["grads"].values()) > 0


def _check_logp_pass(r: dict, student: Path, prompts, responses, masks) -> None:
    """The worker's second pass (the sampled tokens' log-probs and entropies at temperature 0.7 in a loss,
    ``logp_entropy_pass``) against plain transformers with the whole vocabulary: values and full gradients (fp32,
    1e-5). At tp 2 a rank whose max or sum over its columns were not all-reduced would differ."""
    from transformers import AutoModelForCausalLM

    from rlctl.algos import entropy_from_logits, logprobs_from_logits

    plain = AutoModelForCausalLM.from_pretrained(str(student), dtype=torch.float32, attn_implementation="eager")
    loss, tokens = torch.zeros(()), sum(sum(k) for k in masks)
    got = r["logp_pass"]
    assert got["rows"].tolist() == [0, 1]
    for i, (p, resp, k) in enumerate(zip(prompts, responses, masks)):
        logits = plain(input_ids=torch.tensor([p + resp])).logits[0, len(p) - 1 : len(p) + len(resp) - 1]
        logp = logprobs_from_logits(logits, torch.tensor(resp), TEMPERATURE)
        ent = entropy_from_logits(logits / TEMPERATURE)
        m = torch.tensor(k, dtype=torch.float32)
        assert torch.allclose(got["logp"][i, : len(resp)], logp.detach() * m, atol=1e-5)
        assert torch.allclose(got["entropy"][i, : len(resp)], ent.detach() * m, atol=1e-5)
        loss = loss + ((W_LOGP * logp + W_ENTROPY * ent) * m).sum() / tokens
    loss.backward()
    want = dict(plain.named_parameters())
    for name, g in r["logp_grads"].items():
        assert torch.allclose(g, want[name].grad, atol=1e-5), name
    assert sum(g.abs().sum() for g in r["logp_grads"].values()) > 0


@pytest.mark.slow
def test_full_distill_on_megatron_tp2_refuses_a_teacher_split_at_other_columns(split_models, tmp_path):
    """A teacher with the student's tokenizer but 1100 embedding rows (padded to 2048 against the student's 1024)
    splits the vocabulary over the tp ranks at other columns: refused on the ranks when the teacher is built."""
    import subprocess

    from transformers import AutoModelForCausalLM

    from tests.support.cli import REPO, torchrun

    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core not installed (pip install --no-deps megatron-core)")
    student, teacher = split_models
    wide = AutoModelForCausalLM.from_pretrained(str(teacher))
    wide.resize_token_embeddings(1100)
    wide.save_pretrained(str(tmp_path / "wide"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (teacher / name).is_file():
            shutil.copy(teacher / name, tmp_path / "wide" / name)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = torchrun(2, PARALLEL_WORKER, "tp", student, tmp_path / "wide", tmp_path / "out.pt")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode != 0 and not (tmp_path / "out.pt").exists()
    want = "algo.distill=full at tp=2: the teacher's vocabulary (1100 rows, padded to 2048) is split over the TP"
    assert want in res.stderr, res.stderr[-3000:]


def reverse_kl(student_dir: Path, teacher_dir: Path, prompts: list[str], *, samples: int = 4) -> float:
    """Mean per-token KL(student || teacher) over the whole vocabulary, along responses the student samples
    (temperature 1, 12 tokens) to ``prompts`` (plain transformers; the same seed before and after)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    s = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32).eval()
    t = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    torch.manual_seed(0)
    total, count = 0.0, 0
    for text in prompts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            out = s.generate(
                ids.repeat(samples, 1),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=12,
                pad_token_id=tok.pad_token_id,
            )
            n = ids.shape[1]
            ls = s(out).logits[:, n - 1 : -1].log_softmax(-1)
            lt = t(out).logits[:, n - 1 : -1].log_softmax(-1)
        kl = (ls.exp() * (ls - lt)).sum(-1)  # [samples, 12]
        sampled = out[:, n:] != tok.pad_token_id
        total += float((kl * sampled).sum())
        count += int(sampled.sum())
    return total / count


@pytest.mark.slow
def test_distill_run_lowers_reverse_kl_to_the_teacher_on_held_out_prompts(tmp_path):
    """A random student (a 128-token vocabulary, so that its samples reach the teacher's likely tokens within a
    few steps) distills a teacher trained to answer the prompts; 2 processes under torchrun."""
    from rlctl.testing import build_tiny_model

    student = build_tiny_model(tmp_path / "student", vocab_size=128)
    teacher = sharp_teacher(student, tmp_path / "teacher")
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(16))
    run = tmp_path / "run"
    args = rl_args(student, data, run, "--rollout", "hf", "--max-steps", "16", "--teacher", str(teacher))
    args[args.index("--lr") + 1] = "3e-3"
    res = run_cli("grpo", *args, "--set", "train.seed=3")
    assert res.returncode == 0, failure(res, run)
    records = train_records(run)
    held_out = [r["prompt"] for r in arith_rows(6, seed=7)]
    before = reverse_kl(student, teacher, held_out)
    after = reverse_kl(run / "hf", teacher, held_out)
    kls = [round(r["distill/reverse_kl"], 3) for r in records]
    print(f"reverse KL to the teacher on held-out prompts: before {before:.3f}, after {after:.3f}; per step {kls}")
    assert after < 0.8 * before, (before, after, kls)
    assert kls[-1] < kls[0]


def test_teacher_with_another_vocabulary_is_refused_before_launch(tiny_model_dir, tmp_path):
    """A teacher whose tokenizer has other tokens: one line naming both models, before torchrun starts."""
    from rlctl.testing import build_tiny_model

    other = build_tiny_model(tmp_path / "other", vocab_size=300)
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(4))
    run = tmp_path / "run"
    res = run_cli("grpo", *rl_args(tiny_model_dir, data, run, "--teacher", str(other)))
    assert res.returncode != 0
    line = error_line(res)
    assert f"--teacher {other} has a different vocabulary from --model {tiny_model_dir}" in line, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not (run / "metrics.jsonl").exists()
    dry = run_cli("grpo", *rl_args(tiny_model_dir, data, run, "--teacher", str(other), "--dry-run"))
    assert dry.returncode != 0 and "has a different vocabulary from --model" in error_line(dry), dry.stderr[-2000:]


def test_teacher_weight_out_of_range_is_refused(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(4))
    same = tmp_path / "same"
    shutil.copytree(tiny_model_dir, same)
    res = run_cli(
        "grpo", *rl_args(tiny_model_dir, data, tmp_path / "run", "--teacher", str(same), "--teacher-weight", "1.5")
    )
    assert res.returncode != 0 and "algo.teacher_weight=1.5 must be in [0, 1]" in error_line(res), res.stderr[-2000:]


def test_estimate_counts_the_teacher_like_a_reference_in_the_models_dtype():
    from rlctl.catalog import count_params, resolve_model

    def teacher_bytes(*extra: str) -> dict:
        res = run_cli(
            "estimate",
            "memory",
            "--model",
            "Qwen2.5-0.5B",
            "--method",
            "grpo",
            "--gpus",
            "8",
            "--gpu",
            "H100",
            "--json",
            *extra,
        )
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads(res.stdout)

    base, distill = teacher_bytes(), teacher_bytes("--teacher", "Qwen2.5-7B")
    parts = distill["phases"]["training"]["components"]
    want = 2 * count_params(resolve_model("Qwen2.5-7B")) // 8  # bf16, sharded over 8 GPUs like the reference
    assert abs(parts["teacher_model"] - want) <= 8
    assert base["phases"]["training"]["components"].get("teacher_model", 0) == 0


def test_estimate_counts_the_full_distill_teachers_logits_of_one_micro_batch():
    """``algo.distill=full``: the training phase's logits grow by the teacher's logits of one micro batch's
    response positions: tokens x vocabulary x (2 bytes bf16 + 12 fp32)."""
    from rlctl.catalog import resolve_gpu, resolve_model
    from rlctl.estimate.memory import estimate_memory
    from rlctl.estimate.settings import MemorySettings
    from rlctl.estimate.training import logit_tokens

    kw = dict(method="grpo", gpus=8, dtype="bf16", response_len=2048, teacher_params=7_000_000_000)
    model, gpu = resolve_model("Qwen2.5-0.5B"), resolve_gpu("H100")
    sampled, full = MemorySettings(**kw), MemorySettings(**kw, teacher_logits=True)
    grow = (
        estimate_memory(model, gpu, full).phases["training"].components["logits"]
        - estimate_memory(model, gpu, sampled).phases["training"].components["logits"]
    )
    assert grow == logit_tokens(full) * model.vocab_size * (2 + 12) and grow > 0
    assert MemorySettings(**{**kw, "teacher_params": 0}, teacher_logits=True).teacher_bytes == 0


@pytest.mark.parametrize(("layout", "vocab_split"), [({"backend": "megatron", "tp": 2}, 2), ({"sp": 2}, 1)])
def test_estimate_counts_the_teachers_logits_of_this_gpus_shard(layout, vocab_split):
    """Megatron tp 2: each GPU holds the teacher's logits of its half of the vocabulary (never gathered), at
    every position (Megatron's output layer runs on all); Ulysses sp 2: the response positions of its sequence
    shard, whole vocabulary. Both below the unsplit run's."""
    from rlctl.catalog import resolve_model
    from rlctl.estimate.settings import MemorySettings
    from rlctl.estimate.training import logit_tokens, teacher_logits_bytes

    kw = dict(method="grpo", gpus=8, dtype="bf16", response_len=2048, teacher_params=7_000_000_000)
    model = resolve_model("Qwen2.5-0.5B")
    split = MemorySettings(**kw, **layout, teacher_logits=True)
    extra = 0 if vocab_split > 1 else 12  # vocab-parallel: fp32 values in row chunks, counted with the student's
    want = logit_tokens(split) * math.ceil(model.vocab_size / vocab_split) * (2 + extra)
    assert teacher_logits_bytes(model, split) == want > 0
    whole = MemorySettings(**kw, backend=layout.get("backend", "fsdp"), teacher_logits=True)
    assert teacher_logits_bytes(model, split) < teacher_logits_bytes(model, whole)


def test_estimate_counts_the_staged_teachers_logits_of_the_whole_update_pass_on_megatron_pp():
    """Megatron pp 2: the last stage keeps the teacher's logits at the response positions of every micro batch of
    an update pass (a mini-batch: 8 prompts x 8 samples over dp 4 = 16 sequences of 2048 response tokens; the
    whole step's 32 prompts by default), in bf16, plus one micro batch's 12 fp32 bytes per value for the divergence.
    Far above pp 1's one micro batch."""
    from rlctl.catalog import resolve_model
    from rlctl.estimate.settings import MemorySettings
    from rlctl.estimate.training import logit_tokens, teacher_logits_bytes

    kw = dict(method="grpo", gpus=8, dtype="bf16", response_len=2048, teacher_params=7_000_000_000)
    kw |= dict(backend="megatron", pp=2, rollout_batch=32, rollout_n=8, teacher_logits=True)
    model = resolve_model("Qwen2.5-0.5B")
    mini = MemorySettings(**kw, mini_batch_prompts=8)
    one_micro = logit_tokens(mini) * model.vocab_size * 12
    assert mini.dp == 4 and teacher_logits_bytes(model, mini) == 16 * 2048 * model.vocab_size * 2 + one_micro
    whole = MemorySettings(**kw)  # algo.mini_batch_size 0: the whole step
    assert teacher_logits_bytes(model, whole) == 64 * 2048 * model.vocab_size * 2 + one_micro
    pp1 = MemorySettings(**{**kw, "pp": 1}, mini_batch_prompts=8)
    assert teacher_logits_bytes(model, pp1) == logit_tokens(pp1) * model.vocab_size * (2 + 12)
    assert teacher_logits_bytes(model, mini) > teacher_logits_bytes(model, pp1)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"algo.distill": "full"}, "algo.distill=full is set without a teacher"),
        ({"algo.distill": "full", "algo.teacher": "t", "algo.teacher_baseline": True}, "algo.teacher_baseline is for"),
        (
            {"algo.distill": "full", "algo.teacher": "t", "parallel.backend": "megatron", "parallel.cp": 2},
            "algo.distill=full does not run on Megatron with parallel.cp=2 yet",
        ),
        ({"algo.distill": "vocab"}, "algo.distill"),
    ],
)
def test_full_distill_settings_are_checked_in_one_line(settings, message):
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.config.algorithm import check_algorithm
    from rlctl.errors import UserError

    with pytest.raises(UserError, match=message) as err:
        check_algorithm(build_config("grpo", [dotted_to_nested({"model.name": "Qwen2.5-0.5B", **settings})]))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "settings",
    [
        {"parallel.backend": "megatron", "parallel.tp": 2},
        {"parallel.backend": "megatron", "parallel.pp": 2},
        {"parallel.backend": "megatron", "parallel.tp": 2, "parallel.pp": 2},
        {"parallel.sp": 2},
        {"parallel.backend": "fsdp"},
    ],
)
def test_full_distill_runs_under_megatron_tp_pp_and_ulysses_sp(settings):
    """What the rule no longer refuses: Megatron's TP (vocabulary columns) and pipeline stages (the teacher's
    logits computed before the update: StagedTeacher), Ulysses sp (sequence shards)."""
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.config.algorithm import check_algorithm

    sets = {"model.name": "Qwen2.5-0.5B", "algo.distill": "full", "algo.teacher": "t", **settings}
    check_algorithm(build_config("grpo", [dotted_to_nested(sets)]))


def test_full_reverse_kl_equals_trls_gkd_loss_at_beta_1():
    """``full_reverse_kl`` against TRL's ``GKDTrainer.generalized_jsd_loss`` at ``beta=1`` (its reverse KL),
    summed over the same positions, with a temperature; the teacher's padding rows beyond the student's vocabulary
    are dropped first (TRL reads equal vocabularies)."""
    pytest.importorskip("trl", reason="trl is not installed (pip install 'rlctl[bench]'): not compared to TRL")
    from trl.experimental.gkd import GKDTrainer

    from rlctl.algos.distill import full_reverse_kl

    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(7, 11, generator=g, dtype=torch.float64), torch.randn(7, 13, generator=g) * 3
    ours = full_reverse_kl(student, teacher, 0.7).sum()
    trl = GKDTrainer.generalized_jsd_loss(
        student[None].float(), teacher[None, :, :11], beta=1.0, temperature=0.7, reduction="sum"
    )
    assert ours.item() == pytest.approx(trl.item(), rel=1e-5)
