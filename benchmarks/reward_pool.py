"""Rule rewards in a process pool against the serial path (a few seconds).

    python benchmarks/reward_pool.py [--samples 256] [--work-ms 5] [--workers 2]

The reward is the built-in ``math`` (math-verify on every sample whose answer is not a plain match)
plus a CPU-bound synthetic function that spends ``--work-ms`` per call, like a slow grader.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlctl.rewards import RewardBatch, RewardManager  # noqa: E402

SLOW = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    end = time.perf_counter() + {work}
    while time.perf_counter() < end:
        pass
    return float(solution_str.strip().endswith(str(ground_truth)))
"""


def batch(n: int) -> RewardBatch:
    responses = [f"so \\boxed{{\\frac{{{i}}}{{2}}}}" for i in range(n)]
    truths = [str(i / 2) for i in range(n)]
    return RewardBatch([""] * n, responses, [[1]] * n, [[1]] * n, ["math"] * n, truths, [None] * n)


def timed(manager: RewardManager, b: RewardBatch) -> tuple[float, list[float]]:
    manager.score(RewardBatch(*(f[:2] for f in vars(b).values())))  # warm up (workers, imports)
    t0 = time.perf_counter()
    scores = manager.score(b).scores
    return time.perf_counter() - t0, scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--work-ms", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        slow = Path(tmp) / "slow.py"
        slow.write_text(SLOW.format(work=args.work_ms / 1000))
        b = batch(args.samples)
        for fns in (["math"], [str(slow)]):
            results = {}
            for workers in (0, args.workers):
                cfg = SimpleNamespace(fn="auto", fns=fns, timeout=30.0, workers=workers, model="")
                manager = RewardManager(cfg)
                try:
                    results[workers] = timed(manager, b)
                finally:
                    manager.close()
            (serial, s_scores), (pooled, p_scores) = results[0], results[args.workers]
            assert s_scores == p_scores, "the pool and the serial path disagree"
            name = "math" if fns == ["math"] else f"slow ({args.work_ms:g} ms/call)"
            print(
                f"{name:>22}: {args.samples} samples  serial {serial:6.2f} s  "
                f"pool x{args.workers} {pooled:6.2f} s  speed-up {serial / pooled:4.2f}x"
            )


if __name__ == "__main__":
    main()
