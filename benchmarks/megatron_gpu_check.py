"""GPU checks of the Megatron engine (rlctl/engines/megatron/) that cannot run on CPU.

    python benchmarks/megatron_gpu_check.py [--gpus N] [--out DIR]

Needs CUDA GPUs and megatron-core (Transformer Engine is used when installed). It builds a tiny Qwen2
(QKV bias, GQA, head_dim 64, tied embeddings) and, under ``torchrun --nproc-per-node N`` with
CUDA_DEVICE_MAX_CONNECTIONS=1, runs every layout that N GPUs allow, one after another in the same
processes: tp1 x pp1 (dp=N), then tp2 x pp1 and tp1 x pp2 with N >= 2, tp2 x pp2 with N >= 4.
For each layout:

1. logits: a frozen engine's logits on packed rows (``forward_backward(forward_only=True)``, and
   ``forward`` when pp=1) against HF's per document on the same weights: fp32 within 5e-3 (TF32 GEMMs
   may be on); bf16 no further from HF fp32 than HF's own bf16 model (x 2, + 0.02);
2. gradients: one fp32 training step's global grad norm (every DP rank takes 1/dp of one loss, so the
   SUMMED gradient is the full loss's) equals HF's grad norm of the same loss within 1% (relative);
3. sft: 8 bf16 steps on a fixed batch: the loss falls below 70% of the first (plus one step through
   ``forward``/``backward`` when pp=1);
4. checkpoint: ``save_checkpoint`` -> ``rlctl.convert.megatron_io.load_megatron_to_hf`` equals
   ``iter_full_params``; the NEXT layout loads this checkpoint (another tp/pp) into a fresh engine and
   gets the same full weights;
5. grpo: the hf rollout engine samples 4 responses to 2 prompts, a GRPO-style loss (group-normalised
   rewards x log-probs) updates the actor, ``rollout.update_weights(engine.iter_full_params(bf16))``
   syncs it, and the rollout model's weights then equal the actor's (and changed).

Then (alone with ``--cli-only``) the recipes end to end through the CLI (:func:`cli_checks`): ``rlctl sft``
and ``rlctl grpo --rollout hf`` with ``--set parallel.backend=megatron --set parallel.tp=2`` (tp=1 on one
GPU), each beside the same command on FSDP, 6 steps in bf16.

Prints one line per check and a JSON summary; exit status 1 when a check fails. On one H200
(2026-11-28, docs/gpu.md) the tp1 x pp1 checks and the first CLI run passed; the other CLI runs and every
layout with more than one GPU have not run yet.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DOCS = [[5, 9, 17, 33, 2, 41, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [60, 61, 62, 63, 64]]


def child_env() -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH, keeping what is already there (on the lent
    machine, gpu_check.sh's folder of kit wheels: megatron-core, omegaconf, datasets)."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def packed_batch():
    """Row 0 packs documents 0 and 2 (positions restart); row 1 is document 1. Labels: next token per doc."""
    import torch

    rows = [DOCS[0] + DOCS[2], DOCS[1]]
    width = max(map(len, rows))
    ids = torch.zeros(2, width, dtype=torch.long)
    pos = torch.zeros(2, width, dtype=torch.long)
    labels = torch.full((2, width), -100, dtype=torch.long)
    for r, docs in enumerate([[DOCS[0], DOCS[2]], [DOCS[1]]]):
        at = 0
        for doc in docs:
            n = len(doc)
            ids[r, at : at + n] = torch.tensor(doc)
            pos[r, at : at + n] = torch.arange(n)
            labels[r, at : at + n - 1] = torch.tensor(doc[1:])
            at += n
    spans = [(0, 0, len(DOCS[0])), (0, len(DOCS[0]), len(DOCS[0]) + len(DOCS[2])), (1, 0, len(DOCS[1]))]
    return SimpleNamespace(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels), spans


def sft_loss(logits, mb, share: float = 1.0):
    import torch.nn.functional as F

    labels = mb.labels.to(logits.device)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss / (labels != -100).sum() * share


def step_loss(loss):
    """A loss_fn result for ``engine.forward_backward``: the loss to back-propagate, and it back."""
    return loss, loss


def make_engine(
    hf_dir: str, tp: int, pp: int, *, dtype: str, trainable: bool, lr: float = 1e-3, random_init: bool = False
):
    from rlctl.engines import build_engine
    from rlctl.engines.spec import EngineSpec, OptimizerSpec

    spec = EngineSpec(
        backend="megatron",
        device="cuda",
        dtype=dtype,
        tp=tp,
        pp=pp,
        sequence_parallel=tp > 1,
        model=hf_dir,
        random_init=random_init,
        max_seq_len=128,
        optimizer=OptimizerSpec(lr=lr, warmup_ratio=0.0, min_lr_ratio=1.0, grad_clip=1e9),
    )
    return build_engine(spec, role="actor", trainable=trainable, total_steps=100)


class Checks:
    def __init__(self, rank: int):
        self.rank, self.results = rank, []

    def record(self, name: str, ok: bool, detail: str) -> None:
        self.results.append({"check": name, "ok": bool(ok), "detail": detail})
        if self.rank == 0:
            print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


def hf_logits(hf_dir: str, mb, spans, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).cuda().eval()
    out = []
    with torch.no_grad():
        for row, a, b in spans:
            out.append(model(mb.input_ids[row : row + 1, a:b].cuda()).logits[0].float())
    return out


def check_layout(c: Checks, hf_dir: str, tp: int, pp: int, prev_ckpt: Path | None, out: Path) -> Path:
    import torch
    import torch.distributed as dist

    from rlctl.convert.megatron_io import load_megatron_to_hf

    tag = f"tp{tp}pp{pp}"
    mb, spans = packed_batch()
    ref32, ref16 = hf_logits(hf_dir, mb, spans, torch.float32), hf_logits(hf_dir, mb, spans, torch.bfloat16)

    # 1. logits
    for dtype in ("fp32", "bf16"):
        engine = make_engine(hf_dir, tp, pp, dtype=dtype, trainable=False)
        got = {"schedule": engine.forward_backward([mb], lambda lg, m: (None, lg), forward_only=True)[0]}
        if pp == 1:
            with torch.no_grad():
                got["forward"] = engine.forward(mb.input_ids, mb.position_ids).float()
        for kind, logits in got.items():
            err = max((logits[r, a:b].float() - want).abs().max().item() for (r, a, b), want in zip(spans, ref32))
            hf16 = max((x - y).abs().max().item() for x, y in zip(ref16, ref32))
            limit = 5e-3 if dtype == "fp32" else 2 * hf16 + 0.02
            c.record(
                f"{tag} logits {dtype} {kind}", err <= limit, f"max |megatron - hf fp32| {err:.3g} (limit {limit:.3g})"
            )
        del engine

    # 2. gradient sum over DP against HF's gradient of the same loss
    engine = make_engine(hf_dir, tp, pp, dtype="fp32", trainable=True, lr=0.0)
    dp = engine.dp_size
    engine.forward_backward([mb], lambda lg, m: step_loss(sft_loss(lg, m, 1.0 / dp)))
    norm = engine.step()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).cuda()
    logits = torch.cat([hf(mb.input_ids[r : r + 1, a:b].cuda()).logits for r, a, b in spans], dim=1)
    labels = torch.cat([mb.labels[r : r + 1, a:b] for r, a, b in spans], dim=1)
    sft_loss(logits, SimpleNamespace(labels=labels)).backward()
    want = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in hf.parameters() if p.grad is not None)).item()
    c.record(
        f"{tag} grad norm (summed over dp={dp})",
        abs(norm - want) <= 1e-2 * want,
        f"megatron {norm:.6g} vs hf {want:.6g}",
    )
    del engine, hf

    # 3. sft steps in bf16
    engine = make_engine(hf_dir, tp, pp, dtype="bf16", trainable=True, lr=2e-3)
    losses = []
    for _ in range(8):
        (loss,) = engine.forward_backward([mb], lambda lg, m: step_loss(sft_loss(lg, m, 1.0 / dp)))
        engine.step()
        losses.append(float(loss) * dp)
    c.record(f"{tag} sft loss falls", losses[-1] < 0.7 * losses[0], " ".join(f"{x:.3f}" for x in losses))
    if pp == 1:
        loss = sft_loss(engine.forward(mb.input_ids, mb.position_ids), mb, 1.0 / dp)
        engine.backward(loss)
        engine.step()
        after = sft_loss(engine.forward(mb.input_ids, mb.position_ids), mb).item()
        c.record(f"{tag} forward/backward step", after < losses[-1], f"{losses[-1]:.4f} -> {after:.4f}")

    # 4. checkpoint: to HF, and into the next layout
    ckpt = out / f"ckpt_{tag}"
    engine.save_checkpoint(ckpt)
    full = {n: t.float().cpu() for n, t in engine.iter_full_params()}
    if dist.get_rank() == 0:
        converted = dict(load_megatron_to_hf(ckpt, hf_dir))
        same = sorted(converted) == sorted(full) and all(torch.equal(converted[n].float(), full[n]) for n in full)
        c.record(f"{tag} dist checkpoint -> hf == iter_full_params", same, f"{len(full)} tensors")
    if prev_ckpt is not None:
        fresh = make_engine(hf_dir, tp, pp, dtype="bf16", trainable=True, random_init=True)
        fresh.load_checkpoint(prev_ckpt)
        prev = torch.load(prev_ckpt.parent / f"{prev_ckpt.name}.full.pt")
        mine = {n: t.float().cpu() for n, t in fresh.iter_full_params()}
        same = sorted(mine) == sorted(prev["full"]) and all(torch.equal(mine[n], prev["full"][n]) for n in mine)
        c.record(
            f"{tag} loads {prev_ckpt.name} (resharded)",
            same and fresh.global_step == prev["step"],
            f"weights equal: {same}, step {fresh.global_step} (saved {prev['step']})",
        )
        del fresh
    if dist.get_rank() == 0:
        torch.save({"full": full, "step": engine.global_step}, out / f"ckpt_{tag}.full.pt")
    dist.barrier()
    del engine

    # 5. a GRPO-style step and the weight sync to the hf rollout engine
    from rlctl.rollout import RolloutSpec, SamplingParams, make_rollout_engine

    engine = make_engine(hf_dir, tp, pp, dtype="bf16", trainable=True, lr=1e-3)
    rollout = make_rollout_engine(
        RolloutSpec(engine="hf", model_path=hf_dir, device="cuda", dtype="bf16", max_model_len=64, seed=0)
    )
    prompts = [DOCS[0][:4], DOCS[1][:5]]
    # rank 0's samples for everyone: the TP/PP ranks of a replica must see the same batch
    samples = [rollout.generate(prompts, 4, SamplingParams(temperature=1.0, max_tokens=6, seed=0))]
    dist.broadcast_object_list(samples, src=0)
    samples = samples[0]
    rewards = torch.tensor([float(sum(s.token_ids) % 7) for s in samples]).view(2, 4)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
    ids, pos, rows = [], [], []
    for s, a in zip(samples, adv.tolist()):
        seq = prompts[s.prompt_index] + s.token_ids
        rows.append((len(ids), len(prompts[s.prompt_index]), len(s.token_ids), a))
        ids += seq
        pos += range(len(seq))
    batch = SimpleNamespace(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), attention_mask=None)
    n_tok = sum(r[2] for r in rows)

    def grpo_loss(logits, m):
        logp = torch.log_softmax(logits[0].float(), -1)
        ids = m.input_ids[0].to(logits.device)
        total = logits.new_zeros((), dtype=torch.float32)
        for start, plen, rlen, a in rows:
            at = torch.arange(start + plen - 1, start + plen + rlen - 1, device=logits.device)
            tok = ids[at + 1]
            total = total - a * logp[at, tok].sum()
        return total / n_tok / dp

    before = {n: t.float().cpu() for n, t in engine.iter_full_params()}
    engine.forward_backward([batch], lambda lg, m: step_loss(grpo_loss(lg, m)))
    engine.step()
    rollout.update_weights(engine.iter_full_params(torch.bfloat16))
    synced = {n: t.float().cpu() for n, t in rollout.model.state_dict().items()}
    after = {n: t.float().cpu() for n, t in engine.iter_full_params(torch.bfloat16)}
    same = all(torch.equal(synced[n], after[n]) for n in after)
    changed = any(not torch.equal(before[n].bfloat16().float(), after[n]) for n in after)
    c.record(
        f"{tag} grpo step + weight sync to hf rollout",
        same and changed,
        f"{len(after)} tensors synced, weights changed: {changed}",
    )
    rollout.close()
    del engine
    return ckpt


def rank_main(args) -> int:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world = dist.get_world_size()
    c = Checks(dist.get_rank())
    layouts = [(1, 1)] + ([(2, 1), (1, 2)] if world >= 2 else []) + ([(2, 2)] if world >= 4 else [])
    prev = None
    out = Path(args.out)
    for tp, pp in layouts:
        torch.manual_seed(0)
        t0 = time.time()
        prev = check_layout(c, args.hf_dir, tp, pp, prev, out)
        if c.rank == 0:
            print(f"      tp{tp}pp{pp} took {time.time() - t0:.1f}s", flush=True)
        parallel_state.destroy_model_parallel()
    if c.rank == 0:
        (out / "summary.json").write_text(json.dumps(c.results, indent=2))
        print(json.dumps({"passed": sum(r["ok"] for r in c.results), "failed": sum(not r["ok"] for r in c.results)}))
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in c.results) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=0, help="processes (default: every visible GPU, at most 4)")
    ap.add_argument("--out", default="", help="where checkpoints and summary.json go (default: a temp dir)")
    ap.add_argument(
        "--cli-only",
        action="store_true",
        help="only the CLI runs (rlctl sft / grpo on FSDP and Megatron), not the engine checks per layout",
    )
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)

    import torch

    from rlctl.runtime.net import free_port
    from rlctl.testing import build_tiny_model

    if not torch.cuda.is_available():
        print("no GPU visible: this check needs CUDA", file=sys.stderr)
        return 2
    gpus = args.gpus or min(torch.cuda.device_count(), 4)
    out = Path(args.out or tempfile.mkdtemp(prefix="megatron_gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    hf_dir = build_tiny_model(
        out / "hf",
        seed=0,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(gpus),
        "--master-port",
        str(free_port()),
        __file__,
        "--rank-main",
        "--hf-dir",
        str(hf_dir),
        "--out",
        str(out),
    ]
    env = {**child_env(), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    print(f"running on {gpus} GPU(s); outputs in {out}", flush=True)
    engine_rc = 0 if args.cli_only else subprocess.run(cmd, env=env, check=False).returncode
    cli_rc = cli_checks(hf_dir, out / "cli", gpus)
    return engine_rc or cli_rc


# ---------------------------------------------------------------------------------------------
# The recipes end to end through the CLI


def rlctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlctl", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
        env=child_env(),
    )


def train_records(run: Path) -> list[dict]:
    from rlctl.metrics import read_metrics

    return [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") != "eval"]


def cli_tp(gpus: int) -> int:
    """The tp of the CLI's Megatron runs: 2 with 2+ GPUs, else 1."""
    return 2 if gpus >= 2 else 1


def cli_jobs(hf_dir: Path, out: Path, gpus: int) -> dict[str, dict[str, list[str]]]:
    """``{method: {backend: rlctl argv}}`` for :func:`cli_checks` (writes their data files into ``out``):
    ``rlctl sft`` and ``rlctl grpo --rollout hf`` on FSDP and with ``--set parallel.backend=megatron
    --set parallel.tp=T`` (T: :func:`cli_tp`), 6 steps each, outputs in ``out/METHOD-BACKEND``."""
    from tests.support.rl import REWARDS, arith_rows
    from tests.support.sft import chat_rows, write_jsonl

    out.mkdir(parents=True, exist_ok=True)
    tp = cli_tp(gpus)
    chat = write_jsonl(out / "chat.jsonl", chat_rows(64))
    prompts = write_jsonl(out / "prompts.jsonl", arith_rows(32))
    common = ["--model", str(hf_dir), "--device", "cuda", "--gpus", str(gpus), "--max-steps", "6"]
    methods = {
        "sft": ["sft", *common, "--data", str(chat), "--batch-size", "16", "--max-len", "128", "--lr", "2e-3"],
        "grpo": [
            "grpo",
            *common,
            "--data",
            str(prompts),
            "--rollout",
            "hf",
            "--batch-size",
            "8",
            "--n",
            "4",
            "--max-prompt-len",
            "48",
            "--max-response-len",
            "16",
            "--lr",
            "2e-3",
            "--reward",
            f"{REWARDS}:digits",
            "--kl-coef",
            "0.001",
        ],
    }
    megatron = ["--set", "parallel.backend=megatron", "--set", f"parallel.tp={tp}"]
    return {
        method: {
            backend: [
                *args,
                "--output-dir",
                str(out / f"{method}-{backend}"),
                *(megatron if backend == "megatron" else []),
            ]
            for backend in ("fsdp", "megatron")
        }
        for method, args in methods.items()
    }


def cli_checks(hf_dir: Path, out: Path, gpus: int) -> int:
    """The jobs of :func:`cli_jobs`, each Megatron run beside the same command on FSDP: the Megatron run
    ends with status 0 and a checkpoint its engine wrote, its metrics follow the FSDP run's (bf16:
    first-step loss within 2%, same rewards while both sample from the same weights), the sft loss
    falls, the grpo rollout engine's log-probs match the trainer's (weight sync)."""
    jobs = cli_jobs(hf_dir, out, gpus)
    tp = cli_tp(gpus)
    c = Checks(0)
    for method, argvs in jobs.items():
        runs = {}
        for backend, argv in argvs.items():
            run = out / f"{method}-{backend}"
            t0 = time.time()
            res = rlctl(*argv)
            ok = res.returncode == 0
            c.record(
                f"rlctl {method} on {backend}{f' tp{tp}' if backend == 'megatron' else ''}",
                ok,
                f"exit {res.returncode} in {time.time() - t0:.0f}s" + ("" if ok else f": {res.stderr[-1500:]}"),
            )
            runs[backend] = train_records(run) if ok else []
        mg, fs = runs["megatron"], runs["fsdp"]
        if not mg or not fs:
            continue
        step6 = out / f"{method}-megatron" / "checkpoints" / "step_000006"
        state = json.loads((step6 / "trainer_state.json").read_text())
        written = state.get("backend") == "megatron" and (step6 / "metadata.json").is_file()
        c.record(f"{method} megatron checkpoint", written, f"trainer_state backend: {state.get('backend')}")
        if method == "sft":
            first = abs(mg[0]["loss"] - fs[0]["loss"]) / fs[0]["loss"]
            c.record(
                "sft megatron follows fsdp",
                first < 0.02 and mg[-1]["loss"] < mg[0]["loss"],
                f"losses megatron {[round(r['loss'], 3) for r in mg]} fsdp {[round(r['loss'], 3) for r in fs]}",
            )
        else:
            diff = max(r["rollout/logprob_diff"] for r in mg)
            c.record(
                "grpo megatron follows fsdp",
                mg[0]["reward/mean"] == fs[0]["reward/mean"] and diff < 0.05,
                f"rewards megatron {[round(r['reward/mean'], 3) for r in mg]} fsdp "
                f"{[round(r['reward/mean'], 3) for r in fs]}; max rollout/logprob_diff {diff:.3g}",
            )
    (out / "summary.json").write_text(json.dumps(c.results, indent=2))
    return 0 if c.results and all(r["ok"] for r in c.results) else 1


if __name__ == "__main__":
    sys.exit(main())
