"""``--plot FILE.png``: throughput and memory bars of a bench result (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from rlctl.errors import UserError

GIB = 2**30


def bars(doc: dict) -> tuple[str, dict[str, float], dict[str, float]]:
    """(throughput unit, {label: throughput}, {label: memory in bytes}) of a result."""
    kind, rows = doc["kind"], doc["results"]
    speed: dict[str, float] = {}
    memory: dict[str, float] = {}
    if kind == "rollout":
        for r in rows:
            if not r.get("error"):
                speed[f"{r['engine']} n={doc['settings']['n']}"] = r["tokens_per_s"]
                if r.get("tokens_per_s_distinct"):
                    speed[f"{r['engine']} n=1"] = r["tokens_per_s_distinct"]
                memory[r["engine"]] = r["peak_memory_bytes"]
        return "generated tokens/s", speed, memory
    if kind == "train":
        for r in rows:
            speed[r["method"]] = r["tokens_per_s"]
            memory[f"{r['method']} measured"] = r["memory"]["measured_bytes"]
            memory[f"{r['method']} estimated"] = r["memory"]["estimated_bytes"]
        return "tokens/s", speed, memory
    if kind == "convert":
        for r in rows:
            speed.update(
                {"copyfile": r["copy_gbps"], "read+write": r["user_copy_gbps"], "fsdp-to-hf": r["convert_gbps"]}
            )
            memory.update({"import baseline": r["baseline_rss"], "fsdp-to-hf": r["convert_peak_rss"]})
            if "verify_gbps" in r:
                speed["--verify"] = r["verify_gbps"]
                memory["--verify"] = r["verify_peak_rss"]
        return "GB/s", speed, memory
    if kind == "compare":
        peer = doc["settings"]["peer"]
        for r in rows:
            for side in ("rlctl", peer, f"{peer}_packing"):
                if side not in r:
                    continue
                speed[f"{r['work']} {side}"] = r[side]["tokens_per_s"]
                mem = r[side].get("peak_memory_bytes", r[side].get("peak_rss_bytes"))
                if mem:
                    memory[f"{r['work']} {side}"] = mem
        return "tokens/s", speed, memory
    raise ValueError(f"unknown result kind {kind!r}")


def _number(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def plot(doc: dict, path: str | Path) -> Path:
    """Draw the result's throughput and memory bars into ``path`` (PNG, SVG, PDF: by its suffix)."""
    try:
        import matplotlib
    except ImportError:
        raise UserError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib (or pip install 'rlctl[plot]')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, speed, memory = bars(doc)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, values, label, scale in ((left, speed, unit, 1.0), (right, memory, "peak memory (GiB)", GIB)):
        names = list(values)
        ax.barh(names, [values[n] / scale for n in names], color="#4c72b0")
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.margins(x=0.18)
        for i, n in enumerate(names):
            ax.text(values[n] / scale, i, " " + _number(values[n] / scale), va="center", fontsize=8)
    fig.suptitle(f"rlctl bench {doc['kind']}  ({doc['machine']['cpu']}, {doc['date'][:10]})", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
