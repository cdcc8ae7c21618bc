#!/usr/bin/env bash
# Every CUDA path of rlctl, once, on one GPU: about 10 minutes on an H100 (Qwen2.5-0.5B, random weights).
#
#   benchmarks/gpu_check.sh                 # run every step whose packages are installed
#   benchmarks/gpu_check.sh --only grpo-vllm,sft-lora
#   benchmarks/gpu_check.sh --dry           # on CPU: check this script's own commands (CI runs it)
#
# Each step is one `rlctl bench train` run (a real job through the planner, torchrun and the recipe, 3
# optimizer steps; it records the peak memory beside the plan's estimate: nvidia-smi's per-GPU figure and
# torch's allocated / reserved peaks, which the recipe logs on CUDA), or `rlctl bench rollout`, or
# benchmarks/megatron_gpu_check.py. A step whose Python packages are missing is skipped and says which.
# Everything lands in ONE JSON file, benchmarks/results/gpu_check.json (--out FILE to change it): per step
# its command, status (ok | failed | skipped), seconds, the last lines of its output when it failed, and
# the benchmark's own JSON (memory: measured_bytes, torch_allocated_peak_bytes, torch_reserved_peak_bytes
# beside estimated_bytes, estimated_allocated_bytes, estimated_reserved_bytes).
#
# --dry (no GPU needed): bash -n on this file; for every train step `rlctl <method> --dry-run --json` with
# the step's exact --set options on a CUDA plan (device cuda, 1 x H100-80GB), so every key and value is
# resolved and planned as the real run would; for the other commands every option they use must appear in
# their --help. Writes the same JSON with status "dry-ok" / "dry-failed" and the plan's estimate.
#
# Environment: PYTHON (default: python), GPU_CHECK_MODEL (default: Qwen2.5-0.5B), GPU_CHECK_STEPS (3).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="${GPU_CHECK_REPO:-$(dirname "$HERE")}"
PY="${PYTHON:-python}"
MODEL="${GPU_CHECK_MODEL:-Qwen2.5-0.5B}"
STEPS="${GPU_CHECK_STEPS:-3}"
OUT="$REPO/benchmarks/results/gpu_check.json"
DRY=0
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) DRY=1 ;;
        --out) OUT="$2"; shift ;;
        --only) ONLY="$2"; shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown option $1 (use --dry, --out FILE, --only A,B)" >&2; exit 2 ;;
    esac
    shift
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rlctl-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
RECORDS="$WORK/records.jsonl"
: > "$RECORDS"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# name | python modules that must import | method | --set options (space separated)
TRAIN_STEPS=(
    "sft-fsdp-bf16|torch|sft|model.attn=sdpa"
    "sft-flash-attn|flash_attn|sft|model.attn=flash_attention_2"
    "sft-offload|torch|sft|parallel.offload_params=true parallel.offload_optimizer=true"
    "sft-pure-bf16-savers|torch|sft|train.precision=bf16 parallel.selective_checkpointing=true parallel.offload_activations=true"
    "sft-lora|peft|sft|lora.rank=16"
    "sft-megatron|megatron.core|sft|parallel.backend=megatron"
    "grpo-hf|torch|grpo|rollout.engine=hf"
    "grpo-vllm|vllm|grpo|rollout.engine=vllm"
    "grpo-sglang|sglang|grpo|rollout.engine=sglang"
    "ppo-vllm|vllm|ppo|rollout.engine=vllm"
    # sleep / wake under memory pressure: the planner gives the engine all the trainer leaves (auto fraction)
    # and every step sleeps the engine, trains, empties the cache and wakes it beside the optimizer states
    "grpo-vllm-pressure|vllm|grpo|rollout.engine=vllm train.batch_size=16 rollout.n=8"
    "grpo-sglang-pressure|sglang|grpo|rollout.engine=sglang train.batch_size=16 rollout.n=8"
)
# name | python modules | command (run from the repository root)
OTHER_STEPS=(
    "bench-rollout|vllm|rlctl bench rollout --model $MODEL --random-init --engine ENGINES --prompts 8 --n 4 --max-tokens 64 --reps 2 --device cuda --json"
    "megatron-gpu-check|megatron.core|$PY benchmarks/megatron_gpu_check.py --gpus 1 --out OUTDIR"
)

have() {  # have MOD... : every module imports
    "$PY" - "$@" <<'EOF'
import importlib.util, sys
missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m.split(".")[0]) is None or importlib.util.find_spec(m) is None]
print(", ".join(missing))
sys.exit(1 if missing else 0)
EOF
}

elapsed() { echo "$(( ($(date +%s%N) - $1) / 1000000 ))e-3"; }  # seconds since $1 (date +%s%N)

wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

record() {  # record NAME STATUS SECONDS COMMAND RESULT_FILE LOG_FILE [REASON]
    "$PY" - "$@" >> "$RECORDS" <<'EOF'
import json, sys
name, status, seconds, command, result_file, log_file = sys.argv[1:7]
reason = sys.argv[7] if len(sys.argv) > 7 else ""
row = {"step": name, "status": status, "seconds": round(float(seconds), 1), "command": command}
if reason:
    row["reason"] = reason
try:
    text = open(result_file).read().strip()
    start = text.find("{")
    row["result"] = json.loads(text[start:]) if start >= 0 else None
except (OSError, ValueError):
    row["result"] = None
if status not in ("ok", "dry-ok", "skipped"):
    try:
        row["output_tail"] = open(log_file).read().splitlines()[-15:]
    except OSError:
        pass
print(json.dumps(row))
EOF
}

run_step() {  # run_step NAME MODULES COMMAND
    local name="$1" mods="$2" cmd="$3" missing t0 rc
    missing="$(have ${mods//,/ } 2>/dev/null)"
    if [ $? -ne 0 ]; then
        echo "[skip] $name: missing $missing"
        record "$name" skipped 0 "$cmd" /dev/null /dev/null "not installed: $missing"
        return
    fi
    echo "[run ] $name: $cmd"
    t0=$(date +%s%N)
    (cd "$REPO" && eval "$cmd") > "$WORK/$name.out" 2> "$WORK/$name.log"
    rc=$?
    local status=ok
    [ $rc -eq 0 ] || status=failed
    echo "[$status] $name (exit $rc)"
    record "$name" "$status" "$(elapsed "$t0")" "$cmd" "$WORK/$name.out" "$WORK/$name.log"
}

dry_train_step() {  # dry_train_step NAME METHOD SETS
    local name="$1" method="$2" sets="$3" data="$WORK/sft.jsonl" args=() s t0 rc
    [ "$method" = sft ] || data="$WORK/rl.jsonl"
    for s in $sets; do args+=(--set "$s"); done
    local cmd="rlctl $method --model $MODEL --data $data --device cuda --gpus 1 --gpu H100-80GB --dry-run --json --set model.random_init=true ${args[*]}"
    t0=$(date +%s%N)
    (cd "$REPO" && "$PY" -m rlctl "$method" --model "$MODEL" --data "$data" --device cuda --gpus 1 --gpu H100-80GB \
        --dry-run --json --set model.random_init=true "${args[@]}") > "$WORK/$name.out" 2> "$WORK/$name.log"
    rc=$?
    # the plan must carry every --set value the step asked for (nothing silently dropped)
    if [ $rc -eq 0 ] && ! "$PY" - "$WORK/$name.out" $sets <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
cfg = doc.get("config") or doc.get("resolved_config") or {}
def get(d, key):
    for part in key.split("."):
        d = d[part]
    return d
bad = []
for kv in sys.argv[2:]:
    key, value = kv.split("=", 1)
    try:
        got = get(cfg, key)
    except (KeyError, TypeError):
        bad.append(f"{key} not in the resolved config")
        continue
    if str(got).lower() != value.lower():
        bad.append(f"{key}={got!r}, asked {value}")
if not doc.get("plan", {}).get("estimate"):
    bad.append("no estimate in the plan")
if bad:
    print("; ".join(bad), file=sys.stderr)
    sys.exit(1)
EOF
    then
        rc=1
    fi
    local status=dry-ok
    [ $rc -eq 0 ] || status=dry-failed
    echo "[$status] $name"
    record "$name" "$status" "$(elapsed "$t0")" "$cmd" "$WORK/$name.out" "$WORK/$name.log"
    [ $rc -eq 0 ]
}

dry_other_step() {  # dry_other_step NAME COMMAND: every --option of COMMAND appears in its --help
    local name="$1" cmd="$2" help_cmd rc=0 opt
    help_cmd="$(echo "$cmd" | sed -E 's/ --.*$//') --help"
    (cd "$REPO" && eval "${help_cmd/#rlctl /$PY -m rlctl }") > "$WORK/$name.help" 2>&1 || rc=1
    for opt in $(echo "$cmd" | grep -oE -- '--[a-z][a-z-]*' | sort -u); do
        grep -q -- "$opt" "$WORK/$name.help" || { echo "$name: $opt is not an option of: $help_cmd" > "$WORK/$name.log"; rc=1; }
    done
    local status=dry-ok
    [ $rc -eq 0 ] || status=dry-failed
    echo "[$status] $name"
    record "$name" "$status" 0 "$cmd" /dev/null "$WORK/$name.log"
    [ $rc -eq 0 ]
}

engines() {  # the rollout engines installed here, for bench rollout
    local list=hf e
    for e in vllm sglang; do have "$e" > /dev/null 2>&1 && list="$list,$e"; done
    echo "$list"
}

failed=0
if [ $DRY -eq 1 ]; then
    bash -n "$0" || { echo "gpu_check.sh: syntax error" >&2; exit 1; }
    printf '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n%.0s' 1 2 3 4 5 6 7 8 > "$WORK/sft.jsonl"
    printf '{"prompt": "What is 1 + 1?", "answer": "2"}\n%.0s' 1 2 3 4 5 6 7 8 > "$WORK/rl.jsonl"
    for step in "${TRAIN_STEPS[@]}"; do
        IFS='|' read -r name mods method sets <<< "$step"
        wanted "$name" || continue
        dry_train_step "$name" "$method" "$sets" || failed=1
    done
    for step in "${OTHER_STEPS[@]}"; do
        IFS='|' read -r name mods cmd <<< "$step"
        wanted "$name" || continue
        dry_other_step "$name" "$cmd" || failed=1
    done
else
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "gpu_check.sh: no CUDA GPU visible (use --dry on a machine without one)" >&2; exit 2; }
    for step in "${TRAIN_STEPS[@]}"; do
        IFS='|' read -r name mods method sets <<< "$step"
        wanted "$name" || continue
        args=""
        for s in $sets; do args="$args --set $s"; done
        run_step "$name" "$mods" "rlctl bench train --model $MODEL --random-init --method $method --gpus 1 --steps $STEPS --json$args"
        [ "$(tail -1 "$RECORDS" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["status"])')" != failed ] || failed=1
    done
    for step in "${OTHER_STEPS[@]}"; do
        IFS='|' read -r name mods cmd <<< "$step"
        wanted "$name" || continue
        cmd="${cmd/ENGINES/$(engines)}"
        cmd="${cmd/OUTDIR/$WORK/$name}"
        run_step "$name" "${mods}" "${cmd/#rlctl /$PY -m rlctl }"
        [ "$(tail -1 "$RECORDS" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["status"])')" != failed ] || failed=1
    done
fi

mkdir -p "$(dirname "$OUT")"
"$PY" - "$RECORDS" "$OUT" "$DRY" "$MODEL" <<'EOF'
import json, platform, shutil, subprocess, sys, time
records, out, dry, model = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
gpus = []
if shutil.which("nvidia-smi"):
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines()
try:
    import torch
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
except ImportError:
    versions = {}
for name in ("vllm", "sglang", "megatron.core", "transformers", "flash_attn", "transformer_engine"):
    try:
        mod = __import__(name, fromlist=["__version__"])
        versions[name] = getattr(mod, "__version__", "?")
    except Exception:
        pass
steps = [json.loads(line) for line in open(records) if line.strip()]
doc = {
    "what": "benchmarks/gpu_check.sh" + (" --dry (commands checked on CPU, nothing ran on a GPU)" if dry else ""),
    "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    "host": platform.node(),
    "gpus": gpus,
    "model": model,
    "versions": versions,
    "steps": steps,
    "summary": {s: sum(1 for r in steps if r["status"] == s) for s in sorted({r["status"] for r in steps})},
}
json.dump(doc, open(out, "w"), indent=1)
print(f"wrote {out}: {doc['summary']}")
EOF
exit $failed
