"""`rlctl bench rollout`: generated tokens/s, time to first token, the shared-prefix effect and peak
memory of each rollout engine, from one run.

Every engine lives in its own worker process (spawned), built through
:func:`rlctl.rollout.make_rollout_engine` exactly as the RL recipes build it, so each has its own
memory accounting and none disturbs another's process-wide state. The parent sends the same
prompts to every worker and interleaves the repetitions (engine order rotated each repetition), so
load drift on the machine hits every engine alike.

Three cases per repetition, with random prompts of ``prompt_len`` tokens:

* ``shared``: ``prompts`` prompts x ``n`` samples (a group shares its prompt's prefill / prefix cache);
* ``distinct``: ``prompts * n`` different prompts x 1 sample: the same number of samples and tokens
  with nothing shared, so ``shared / distinct`` is what sharing the prefix buys;
* ``first_token``: the ``shared`` batch with ``max_tokens = 1``: the time until every sample has its
  first token (prefill plus one sampling step), reported as ``ttft_s``.

Memory per engine. CPU: the worker's peak RSS (the kernel's ``ru_maxrss``) minus its RSS after
importing the engine's libraries and before building the engine. GPU:
``torch.cuda.max_memory_allocated()`` in the worker, with the device memory in use
(``mem_get_info``) as a cross-check; SGLang's model and KV pool live in its scheduler's child
processes, outside the worker's allocator, so its peak is the device memory in use (after each
generate call) less what was in use before the engine.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from rlctl.bench.common import median
from rlctl.errors import UserError

CASES = ("shared", "distinct", "first_token")
PEER_ENGINES = {"trl": "rlctl.bench.compare:TrlGenerate"}  # not rlctl engines: the peers `bench compare` runs
READY_TIMEOUT_S = 900.0
CALL_TIMEOUT_S = 3600.0


@dataclass
class RolloutSettings:
    prompts: int = 8
    n: int = 4
    prompt_len: int = 64
    max_tokens: int = 32
    reps: int = 3
    device: str = "cpu"  # cpu | cuda
    dtype: str = "fp32"
    mem_fraction: float = 0.4  # per vLLM/SGLang engine (they all live on the GPU at once)
    temperature: float = 1.0
    seed: int = 0

    def check(self) -> None:
        for key in ("prompts", "n", "prompt_len", "max_tokens", "reps"):
            if getattr(self, key) < 1:
                raise UserError(f"--{key.replace('_', '-')} must be at least 1, got {getattr(self, key)}")


# ---------------------------------------------------------------------------------------------
# The worker process


def _build(kind: str, model_path: str, s: RolloutSettings):
    """The engine (or peer) ``kind``, built the way its users build it."""
    import importlib

    if kind in PEER_ENGINES:
        module, name = PEER_ENGINES[kind].split(":")
        return getattr(importlib.import_module(module), name)(model_path, device=s.device, dtype=s.dtype, seed=s.seed)
    from rlctl.rollout import RolloutSpec, make_rollout_engine

    return make_rollout_engine(
        RolloutSpec(
            engine=kind,
            model_path=model_path,
            device=s.device,
            dtype=s.dtype,
            mem_fraction=s.mem_fraction,
            max_model_len=s.prompt_len + s.max_tokens,
            seed=s.seed,
        )
    )


def _preload(kind: str) -> None:
    """Import the engine's libraries before the memory baseline (their code is not the engine's memory).

    Every engine and peer uses transformers (the hf engine's module imports it); vLLM and SGLang
    add their own. A missing library is left for :func:`_build` to report.
    """
    import importlib

    import transformers

    transformers.utils.logging.disable_progress_bar()
    for name in ["rlctl.rollout.hf"] + ([f"rlctl.rollout.{kind}"] if kind in ("vllm", "sglang") else []):
        try:
            importlib.import_module(name)
        except UserError:
            return


class _Memory:
    """Peak memory of this worker since its baseline (see the module docstring)."""

    def __init__(self, device: str, kind: str):
        import psutil

        self.cuda = device.startswith("cuda")
        self.in_process = kind != "sglang"  # SGLang's memory is its child processes'
        if self.cuda:
            import torch

            torch.cuda.init()
            self.baseline = torch.cuda.memory_allocated()
            free, total = torch.cuda.mem_get_info()
            self.device_baseline = total - free
            self.device_used = self.device_baseline
        else:
            self.baseline = psutil.Process().memory_info().rss

    def observe(self) -> None:
        if self.cuda:
            import torch

            free, total = torch.cuda.mem_get_info()
            self.device_used = max(self.device_used, total - free)

    def report(self) -> dict:
        if self.cuda:
            import torch

            device_peak = self.device_used - self.device_baseline
            if not self.in_process:
                return {
                    "source": "mem_get_info: device memory in use - before the engine",
                    "peak_bytes": device_peak,
                    "device_used_bytes": self.device_used,
                }
            return {
                "source": "torch.cuda.max_memory_allocated",
                "peak_bytes": torch.cuda.max_memory_allocated() - self.baseline,
                "device_used_bytes": self.device_used,
            }
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "source": "ru_maxrss - rss before the engine",
            "peak_bytes": peak - self.baseline,
            "process_peak_bytes": peak,
            "baseline_bytes": self.baseline,
        }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _one_line(e: BaseException) -> str:
    """A UserError's message, or ``Type: first line`` of any other error."""
    first = (str(e).strip().splitlines() or [""])[0]
    return first if isinstance(e, UserError) and first else f"{type(e).__name__}: {first}"


def worker_main(conn: Connection, kind: str, model_path: str, s: RolloutSettings) -> None:
    """Build one engine, then answer ``generate`` / ``memory`` / ``close`` requests from the parent."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the parent prints the progress
    try:
        import torch

        from rlctl.rollout import SamplingParams

        _preload(kind)
        memory = _Memory(s.device, kind)
        start = time.perf_counter()
        engine = _build(kind, model_path, s)
        conn.send(
            {"ok": True, "load_s": time.perf_counter() - start, "threads": torch.get_num_threads(), "pid": os.getpid()}
        )
    except BaseException as e:  # noqa: BLE001 - reported to the parent as this engine's error
        conn.send({"ok": False, "error": _one_line(e)})
        return
    while True:
        msg = conn.recv()
        try:
            if msg["op"] == "generate":
                sampling = SamplingParams(**msg["sampling"])
                _sync(s.device)
                t = time.perf_counter()
                samples = engine.generate(msg["prompts"], msg["n"], sampling)
                _sync(s.device)
                seconds = time.perf_counter() - t
                memory.observe()
                conn.send(
                    {
                        "ok": True,
                        "seconds": seconds,
                        "samples": len(samples),
                        "tokens": sum(len(x.token_ids) for x in samples),
                    }
                )
            elif msg["op"] == "memory":
                conn.send({"ok": True, "memory": memory.report()})
            elif msg["op"] == "close":
                engine.close()
                conn.send({"ok": True})
                return
        except BaseException as e:  # noqa: BLE001
            conn.send({"ok": False, "error": _one_line(e)})
            if msg.get("op") == "close":
                return


# ---------------------------------------------------------------------------------------------
# The parent side


class EngineWorker:
    """A spawned worker process holding one engine; :meth:`call` sends a request and waits."""

    def __init__(self, kind: str, model_path: str, s: RolloutSettings):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.kind = kind
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, kind, model_path, s), name=f"bench-{kind}")
        self.proc.start()
        child.close()
        self.info = self._receive(READY_TIMEOUT_S)
        self.error = None if self.info.get("ok") else self.info.get("error", "failed to start")

    def _receive(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                return {"ok": False, "error": f"the {self.kind} worker exited with code {self.proc.exitcode}"}
            if time.monotonic() > deadline:
                return {"ok": False, "error": f"the {self.kind} worker did not answer in {timeout:.0f} s"}
        try:
            return self.conn.recv()
        except EOFError:
            return {"ok": False, "error": f"the {self.kind} worker exited with code {self.proc.exitcode}"}

    def call(self, op: str, **kw) -> dict:
        self.conn.send({"op": op, **kw})
        reply = self._receive(CALL_TIMEOUT_S)
        if not reply.get("ok"):
            raise UserError(f"the {self.kind} engine failed: {reply.get('error')}")
        return reply

    def close(self) -> None:
        if self.proc.is_alive() and self.error is None:
            try:
                self.call("close")
            except (UserError, OSError, EOFError):
                pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def random_prompts(count: int, length: int, allowed: list[int], rng: random.Random) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids drawn from ``allowed``."""
    return [[rng.choice(allowed) for _ in range(length)] for _ in range(count)]


def make_prompts(model_path, s: RolloutSettings) -> dict[str, tuple[list[list[int]], int, int]]:
    """The three cases' (prompts, n, max_tokens); the same for every engine."""
    from rlctl.bench.models import token_space

    allowed, _ = token_space(model_path)
    rng = random.Random(s.seed)
    shared = random_prompts(s.prompts, s.prompt_len, allowed, rng)
    cases = {"shared": (shared, s.n, s.max_tokens), "first_token": (shared, s.n, 1)}
    if s.n > 1:
        cases["distinct"] = (random_prompts(s.prompts * s.n, s.prompt_len, allowed, rng), 1, s.max_tokens)
    return cases


def _rotated(items: list, k: int) -> list:
    k %= max(1, len(items))
    return items[k:] + items[:k]


def run_interleaved(workers: list[EngineWorker], cases: dict, s: RolloutSettings, *, log=lambda msg: None) -> dict:
    """Warm every engine up on every case, then ``s.reps`` interleaved repetitions.

    Returns ``{engine: {case: [{"seconds", "tokens", "samples"}, ...]}}``.
    """
    runs: dict[str, dict[str, list[dict]]] = {w.kind: {c: [] for c in cases} for w in workers}

    def sampling(max_tokens: int, rep: int) -> dict:
        return {"temperature": s.temperature, "max_tokens": max_tokens, "seed": s.seed + rep}

    for prompts, n, max_tokens in cases.values():
        for w in workers:
            w.call("generate", prompts=prompts, n=n, sampling=sampling(max_tokens, -1))
    for rep in range(s.reps):
        log(f"repetition {rep + 1}/{s.reps}")
        for case, (prompts, n, max_tokens) in cases.items():
            for w in _rotated(workers, rep):
                r = w.call("generate", prompts=prompts, n=n, sampling=sampling(max_tokens, rep))
                runs[w.kind][case].append({k: r[k] for k in ("seconds", "tokens", "samples")})
    return runs


def summarize(kind: str, info: dict, runs: dict[str, list[dict]], memory: dict) -> dict:
    """One engine's row: medians over the repetitions, the raw runs, memory."""

    def rate(case: str) -> float | None:
        return median(r["tokens"] / r["seconds"] for r in runs.get(case, []))

    shared, distinct = rate("shared"), rate("distinct")
    ttft = median(r["seconds"] for r in runs["first_token"])
    decode = median(
        (a["tokens"] - a["samples"]) / (a["seconds"] - b["seconds"])
        for a, b in zip(runs["shared"], runs["first_token"])
        if a["seconds"] > b["seconds"] and a["tokens"] > a["samples"]
    )
    return {
        "engine": kind,
        "error": None,
        "load_s": info["load_s"],
        "threads": info["threads"],
        "samples": runs["shared"][0]["samples"],
        "generated_tokens": median(r["tokens"] for r in runs["shared"]),
        "tokens_per_s": shared,
        "tokens_per_s_distinct": distinct,
        "shared_prefix_speedup": shared / distinct if shared and distinct else None,
        "ttft_s": ttft,
        "decode_tokens_per_s": decode,
        "peak_memory_bytes": memory["peak_bytes"],
        "memory": memory,
        "runs": runs,
    }


def bench_rollout(model_path, engines: list[str], s: RolloutSettings, *, log=lambda msg: None) -> list[dict]:
    """Run the rollout benchmark; one row per engine (``error`` set for an engine that did not start)."""
    s.check()
    if not engines:
        raise UserError("no engine given: pass --engine hf,vllm")
    if len(set(engines)) != len(engines):
        raise UserError(f"--engine names an engine twice: {','.join(engines)}")
    cases = make_prompts(model_path, s)
    workers: list[EngineWorker] = []
    rows: dict[str, dict] = {}
    try:
        for kind in engines:  # one after the other: a GPU engine sizes itself after the others
            log(f"starting the {kind} engine")
            w = EngineWorker(kind, str(model_path), s)
            if w.error:
                log(f"{kind}: {w.error}")
                rows[kind] = {"engine": kind, "error": w.error}
                w.close()
            else:
                workers.append(w)
        if workers:
            runs = run_interleaved(workers, cases, s, log=log)
            for w in workers:
                rows[w.kind] = summarize(w.kind, w.info, runs[w.kind], w.call("memory")["memory"])
    finally:
        for w in workers:
            w.close()
    return [rows[k] for k in engines]
