"""CPU seconds of one multi-turn rollout batch on the hf engine: continuing each turn from the kept keys and
values (a session, the default in rlctl.agents.loop) vs prefilling the whole trajectory again each turn.

    python benchmarks/agent_continuation.py [--repeats 7] [--prompts 4] [--n 8]

The model is the agent tests' tiny Qwen2 (hidden 128, 2 layers) trained to call an ``add`` tool and then
answer (tests/agents/conftest.py), so every trajectory takes two turns with a tool turn between them. One
process, one thread; the two ways are timed interleaved (kept, full, kept, ...) on the same seeds, so they
sample the same tokens, and the medians of ``process_time`` are reported with the prompt tokens each
computed. Writes JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer  # noqa: E402

from rlctl.rollout import RolloutSpec, SamplingParams, make_rollout_engine  # noqa: E402
from rlctl.testing import build_tiny_model  # noqa: E402
from tests.agents.conftest import _memorize  # noqa: E402
from tests.agents.test_loop import AddSpec, _loop, _prompt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    model = build_tiny_model(Path(tempfile.mkdtemp()) / "model", tools=True)
    _memorize(model)
    tok = AutoTokenizer.from_pretrained(model)
    spec = RolloutSpec(engine="hf", model_path=str(model), device="cpu", dtype="fp32", max_model_len=400)
    engine = make_rollout_engine(spec)
    loop = _loop(tok, AddSpec(), max_turns=3, max_response_len=200)
    prompts = [_prompt(tok)] * args.prompts
    kept_session = engine.start_session
    results: dict[str, list[tuple[float, int, int]]] = {"kept": [], "full": []}
    for r in range(args.repeats + 1):  # the first round warms up
        for way in ("kept", "full"):
            engine.start_session = kept_session if way == "kept" else (lambda: None)
            before, began = engine.prefilled_tokens, time.process_time()
            trajs = loop.run(engine, prompts, args.n, SamplingParams(max_tokens=200, seed=r))
            if r:
                turns = sum(t.turns for t in trajs)
                results[way].append((time.process_time() - began, engine.prefilled_tokens - before, turns))
    out = {
        way: {
            "median_s": statistics.median(x[0] for x in rows),
            "prefilled_tokens": statistics.median(x[1] for x in rows),
            "turns": statistics.median(x[2] for x in rows),
        }
        for way, rows in results.items()
    }
    out["speedup"] = out["full"]["median_s"] / out["kept"]["median_s"]
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
