"""Rich tables for the bench commands' results (the same numbers as their ``--json``)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def fmt(x: float | None, spec: str = ",.1f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _header(console: Console, doc: dict) -> None:
    m = doc["machine"]
    gpus = f", {len(m['gpus'])} x {m['gpus'][0]}" if m.get("gpus") else ""
    console.print(f"[dim]{doc['command']}\n{m['cpu']}, {m['cores']} cores{gpus}; {doc['date']}[/dim]")


def render_rollout(console: Console, doc: dict) -> None:
    s = doc["settings"]
    t = Table(
        title=f"rollout: {s['prompts']} prompts x n={s['n']}, prompt {s['prompt_len']} tokens, "
        f"up to {s['max_tokens']} new tokens, {s['device']} {s['dtype']}, median of {s['reps']}"
    )
    # short headers, whole numbers, no wrapping: the row still reads at 80 columns (tokens/s first)
    for col in (
        "engine",
        "tokens/s",
        "n=1\ntok/s",
        "shared\nprefix",
        "load\ns",
        "TTFT\nms",
        "decode\ntok/s",
        "peak\nmemory",
    ):
        t.add_column(col, justify="left" if col == "engine" else "right", no_wrap=True)
    for r in doc["results"]:
        if r.get("error"):
            t.add_row(r["engine"], "[red]failed[/red]", *["-"] * 6)
            continue
        t.add_row(
            r["engine"],
            fmt(r["tokens_per_s"]),
            fmt(r["tokens_per_s_distinct"], ",.0f"),
            fmt_ratio(r["shared_prefix_speedup"]),
            fmt(r["load_s"], ".1f"),
            fmt(r["ttft_s"] * 1000, ",.1f"),
            fmt(r["decode_tokens_per_s"], ",.0f"),
            fmt_bytes(r["peak_memory_bytes"]),
        )
    console.print(t)
    for r in doc["results"]:
        if r.get("error"):
            console.print(f"[red]{r['engine']}:[/red] {r['error']}", markup=True, highlight=False)
    console.print(
        "[dim]n=1 tok/s: the same number of samples from distinct prompts (nothing shared); prefix: the "
        "speed-up of n samples sharing a prompt; "
        "TTFT: the whole batch's first token (max_tokens=1); peak memory: "
        + (doc["results"][0].get("memory", {}).get("source", "") if doc["results"] else "")
        + "[/dim]"
    )


def render_train(console: Console, doc: dict) -> None:
    for r in doc["results"]:
        t = Table(
            title=f"train {r['method']}: {r['model']} ({r['params']:,} params), {r['world_size']} x {r['device']}"
            + (f", rollout {r['rollout']}" if r.get("rollout") else ""),
            show_header=False,
        )
        t.add_column("metric")
        t.add_column("value", justify="right")
        t.add_row("tokens/s", fmt(r["tokens_per_s"]))
        t.add_row("tokens per step", fmt(r["tokens_per_step"], ",.0f"))
        for key, value in r["time_s"].items():
            t.add_row(f"time {key}" + (" (median)" if key == "step" else ""), fmt(value * 1000, ",.1f", " ms"))
        t.add_row("MFU", fmt_pct(r["mfu"]))
        if "mfu_update" in r:
            t.add_row("MFU of the update", fmt_pct(r["mfu_update"]))
        t.add_row("peak FLOP/s", f"{r['peak_flops']['flops'] / 1e12:.3g} TFLOP/s ({r['peak_flops']['source']})")
        m = r["memory"]
        t.add_row(
            "peak memory, measured",
            fmt_bytes(m["measured_bytes"])
            + (
                f" ({fmt_bytes(m['rank_peak_bytes'])} - {fmt_bytes(m['baseline_bytes'])} import baseline)"
                if m["baseline_bytes"]
                else ""
            ),
        )
        t.add_row("peak memory, estimated", f"{fmt_bytes(m['estimated_bytes'])} ({m['estimated_phase']} phase)")
        t.add_row("relative error", fmt_pct(m["relative_error"]) + " of measured")
        console.print(t)
        console.print(f"[dim]memory: {m['source']}; steps after the first; {r.get('run_dir') or ''}[/dim]")


def render_convert(console: Console, doc: dict) -> None:
    for r in doc["results"]:
        t = Table(
            title=f"fsdp-to-hf: {r['format']}, {fmt_bytes(r['checkpoint_bytes'])} in {r['files']} files, "
            f"model tensors {fmt_bytes(r['model_bytes'])} (largest {fmt_bytes(r['tensors_largest_bytes'])})"
        )
        for col in ("step", "seconds", "GB/s", "peak RSS", "RSS - baseline"):
            t.add_column(col, justify="left" if col == "step" else "right")
        t.add_row("plain copy (copyfile)", fmt(r["copy_s"], ".3f"), fmt(r["copy_gbps"], ".2f"), "", "")
        t.add_row("plain copy (read+write)", fmt(r["user_copy_s"], ".3f"), fmt(r["user_copy_gbps"], ".2f"), "", "")
        t.add_row("import baseline", fmt(r["baseline_s"], ".2f"), "", fmt_bytes(r["baseline_rss"]), "")
        for label, name in (("convert", "fsdp-to-hf"), ("verify", "fsdp-to-hf --verify")):
            if f"{label}_s" in r:
                t.add_row(
                    name,
                    fmt(r[f"{label}_s"], ".3f"),
                    fmt(r[f"{label}_gbps"], ".2f"),
                    fmt_bytes(r[f"{label}_peak_rss"]),
                    fmt_bytes(r[f"{label}_rss_over_baseline"]),
                )
        console.print(t)
        console.print(
            "[dim]copies: GB/s over the weight files' bytes; conversions: over the model tensors' bytes[/dim]"
        )


def render_compare(console: Console, doc: dict) -> None:
    peer = doc["settings"]["peer"]
    t = Table(
        title=f"rlctl vs {peer} ({doc['results'][0].get('peer_version', '') if doc['results'] else ''}): same work, "
        f"interleaved; ratio = rlctl / {peer}"
    )
    cols = ("work", "rlctl tokens/s", f"{peer} tokens/s", "ratio", "ratio per CPU-s", "rlctl step / TTFT")
    for col in (*cols, f"{peer} step / TTFT"):
        t.add_column(col, justify="left" if col == "work" else "right")
    for r in doc["results"]:
        a, b = r["rlctl"], r[peer]
        if r["work"] == "rollout":
            t.add_row(
                f"rollout ({a['engine']} engine)",
                fmt(a["tokens_per_s"]),
                fmt(b["tokens_per_s"]),
                fmt_ratio(r["ratio_tokens_per_s"]),
                "-",
                fmt(a["ttft_s"] * 1000, ",.1f", " ms"),
                fmt(b["ttft_s"] * 1000, ",.1f", " ms"),
            )
            continue
        sides = [(r["work"], b, "")]  # the peer's run, and its run with packing when there is one
        if r.get(f"{peer}_packing"):
            batch = doc["settings"].get("batch_size", "")
            sides.append((f"{r['work']} ({peer} with packing, batch {batch})", r[f"{peer}_packing"], "_packing"))
        for label, other, suffix in sides:
            t.add_row(
                label,
                fmt(a["tokens_per_s"]),
                fmt(other["tokens_per_s"]),
                fmt_ratio(r[f"ratio_tokens_per_s{suffix}"]),
                fmt_ratio(r.get(f"ratio_tokens_per_cpu_s{suffix}")),
                fmt(a["step_s"] * 1000, ",.1f", " ms"),
                fmt(other["step_s"] * 1000, ",.1f", " ms"),
            )
    console.print(t)


RENDERERS = {"rollout": render_rollout, "train": render_train, "convert": render_convert, "compare": render_compare}


def render(doc: dict, console: Console | None = None) -> None:
    """Print a bench result (any kind) as tables."""
    console = console or Console()
    _header(console, doc)
    RENDERERS[doc["kind"]](console, doc)
