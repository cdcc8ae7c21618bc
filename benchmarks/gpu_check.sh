#!/usr/bin/env bash
# Every CUDA path of rlctl, once, on one GPU, within a time budget, on a bare machine.
#
#   make gpu-kit                              # here, first: the wheels the GPU machine lacks, in .gpu-kit/
#   bash benchmarks/gpu_check.sh              # there: every step whose packages are present, 8 minutes at most
#   bash benchmarks/gpu_check.sh --budget 300 --only sft-lora,grpo-fsdp-hf   # --only runs in its own order
#   bash benchmarks/gpu_check.sh --dry        # on CPU: check this script's own commands (CI runs it)
#
# Nothing need be installed on the GPU machine but its image: the wheels in .gpu-kit/ (or --kit DIR) go into
# a private folder with `pip install --no-index --no-deps --target`, rlctl runs from this checkout as
# `python3 -m rlctl` (PYTHONPATH=checkout:folder). The versions of everything are printed first.
# Steps run in the order of what they teach per minute; each runs under its own `timeout` (its cap, or what
# is left of --budget, whichever is less); a step that does not fit is "skipped" with the reason.
#   1 grpo-fsdp-hf           GRPO, hf rollout, FSDP2 forced on 1 GPU: bf16 mixed precision, reference model,
#                            fast decode, weight sync, step-0 log-prob check, measured peak vs the estimate
#   2 sft-offload            SFT with parameter + optimizer offload (pinned host memory)
#   3 grpo-tools-hf          multi-turn tool GRPO, hf rollout on CUDA (KV cache kept between turns)
#   4 vl-sft-grpo            vision-language SFT then GRPO (a tiny Qwen2-VL built from its config)
#   5 sft-pure-bf16-savers   pure bf16 + selective checkpointing + activation offload
#   6 sft-lora               LoRA on FSDP2
#   7 dpo, rm                `rlctl dpo` (reference precomputed, then freed) and `rlctl rm` on FSDP2
#   8 grpo-distill(-full)    on-policy distillation, `rlctl grpo --teacher` (algo.distill sampled, then full)
#   9 eval-hf                `rlctl eval` on the hf engine (benchmarks/eval_gpu_check.py: its time, tokens/s, peaks)
#   then bench-rollout-hf, and flash-attn / Megatron / vLLM / SGLang steps where those packages import
#   (megatron-cli: megatron_gpu_check.py's CLI runs alone, without its engine checks, which passed on one GPU).
# Train steps are `rlctl bench train` runs (real jobs: planner, torchrun, recipe; the peak memory measured
# beside the plan's estimate, tokens/s, MFU, step times); 3 and 4 are the examples' --quick paths on CUDA.
#
# Output, in --out DIR (default: $OUT when set, as on the lent machine, else benchmarks/results/gpu_check):
# gpu_check.json (versions, GPU, per step: command, status ok | failed | timeout | skipped, seconds, the
# benchmark's JSON, the last lines of a failure), gpu_check.log (every step's whole output) and, for
# sft-megatron, torch's allocator history (sft-megatron.cuda_memory.pickle: G5 in docs/gpu.md).
#
# --dry (no GPU needed): bash -n on this file; every train step's exact options through
# `rlctl <method> --dry-run --json` on a CUDA plan (1 x H100-80GB); every other command's options must
# appear in its --help. Same JSON, statuses "dry-ok" / "dry-failed".
#
# Environment: PYTHON (default python3), GPU_CHECK_MODEL (Qwen2.5-0.5B), GPU_CHECK_STEPS (3).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="${GPU_CHECK_REPO:-$(dirname "$HERE")}"
PY="${PYTHON:-python3}"
MODEL="${GPU_CHECK_MODEL:-Qwen2.5-0.5B}"
STEPS="${GPU_CHECK_STEPS:-3}"
OUTDIR="${OUT:-$REPO/benchmarks/results/gpu_check}"
KIT="$REPO/.gpu-kit"
BUDGET=480
DRY=0
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) DRY=1 ;;
        --out) OUTDIR="$2"; shift ;;
        --only) ONLY="$2"; shift ;;
        --budget) BUDGET="$2"; shift ;;
        --kit) KIT="$2"; shift ;;
        -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown option $1 (use --dry, --out DIR, --only A,B, --budget SECONDS, --kit DIR)" >&2; exit 2 ;;
    esac
    shift
done
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: --budget takes whole seconds, not $BUDGET" >&2; exit 2; }

T_START=$(date +%s)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/rlctl-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
RECORDS="$WORK/records.jsonl"
: > "$RECORDS"
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
: > "$LOG"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# name | python modules that must import | cap (s) | kind | kind's fields
#   train: method | `rlctl bench train` options | --set options (space separated)
#   cmd:   a command run from the checkout (RLCTL = python -m rlctl, WORKDIR = a scratch folder)
STEP_TABLE=(
    "grpo-fsdp-hf|torch|150|train|grpo|--rollout hf|parallel.shard=true algo.kl_coef=0.001"
    "sft-offload|torch|100|train|sft||parallel.shard=true parallel.offload_params=true parallel.offload_optimizer=true"
    "grpo-tools-hf|torch|180|cmd|PY examples/calculator/run.py --quick --nproc 1 --device cuda --out WORKDIR"
    "vl-sft-grpo|torch|120|cmd|PY examples/vlm_colors/run.py --quick --nproc 1 --device cuda --out WORKDIR"
    "sft-pure-bf16-savers|torch|100|train|sft||parallel.shard=true train.precision=bf16 parallel.selective_checkpointing=true parallel.offload_activations=true"
    "sft-lora|peft|90|train|sft||parallel.shard=true lora.rank=16"
    # never run on a GPU before: preference pairs (8 pairs, two answers of at most 64 tokens each), on-policy
    # distillation (the teacher: the model itself, random weights written to disk), rlctl eval
    "dpo|torch|90|train|dpo||parallel.shard=true"
    "rm|torch|90|train|rm||parallel.shard=true"
    "grpo-distill|torch|120|train|grpo|--rollout hf --teacher $MODEL|parallel.shard=true"
    "grpo-distill-full|torch|120|train|grpo|--rollout hf --teacher $MODEL|parallel.shard=true algo.distill=full"
    "eval-hf|torch|60|cmd|PY benchmarks/eval_gpu_check.py --model $MODEL --device cuda --prompts 16 --n 4 --max-new-tokens 64 --out WORKDIR"
    "bench-rollout-hf|torch|90|cmd|RLCTL bench rollout --model $MODEL --random-init --engine hf --prompts 8 --n 4 --max-tokens 64 --reps 2 --device cuda --json"
    "sft-flash-attn|flash_attn|90|train|sft||parallel.shard=true model.attn=flash_attention_2"
    "sft-megatron|megatron.core|120|train|sft||parallel.backend=megatron"
    "megatron-gpu-check|megatron.core|240|cmd|PY benchmarks/megatron_gpu_check.py --gpus 1 --out WORKDIR"
    "megatron-cli|megatron.core|150|cmd|PY benchmarks/megatron_gpu_check.py --gpus 1 --cli-only --out WORKDIR"
    "grpo-vllm|vllm|150|train|grpo||rollout.engine=vllm"
    "ppo-vllm|vllm|150|train|ppo||rollout.engine=vllm"
    # sleep / wake under memory pressure: the planner gives the engine all the trainer leaves
    "grpo-vllm-pressure|vllm|150|train|grpo||rollout.engine=vllm train.batch_size=16 rollout.n=8"
    "grpo-sglang|sglang|150|train|grpo||rollout.engine=sglang"
    "grpo-sglang-pressure|sglang|150|train|grpo||rollout.engine=sglang train.batch_size=16 rollout.n=8"
    "bench-rollout|vllm|120|cmd|RLCTL bench rollout --model $MODEL --random-init --engine ENGINES --prompts 8 --n 4 --max-tokens 64 --reps 2 --device cuda --json"
)

# steps whose rank 0 records torch's allocator history and dumps it into --out as STEP.cuda_memory.pickle
# (RLCTL_CUDA_MEMORY_SNAPSHOT, rlctl/runtime/cuda_memory.py; open it in https://pytorch.org/memory_viz): G5
SNAPSHOT_STEPS=" sft-megatron "

have() {  # have MOD... : prints the modules that do not import; status 1 when any
    "$PY" - "$@" <<'EOF'
import importlib.util, sys
def found(m):
    try:
        return importlib.util.find_spec(m) is not None
    except (ImportError, ValueError):
        return False
missing = [m for m in sys.argv[1:] if not found(m)]
print(", ".join(missing))
sys.exit(1 if missing else 0)
EOF
}

elapsed() { echo "$(( ($(date +%s%N) - $1) / 1000000 ))e-3"; }  # seconds since $1 (date +%s%N)
left() { echo $(( BUDGET - ($(date +%s) - T_START) )); }     # seconds of the budget left

ordered_steps() {  # the STEP_TABLE rows to run, one a line: the table's order, or --only's (an unknown name: exit 2)
    local name step found
    if [ -z "$ONLY" ]; then printf '%s\n' "${STEP_TABLE[@]}"; return; fi
    for name in ${ONLY//,/ }; do
        found=""
        for step in "${STEP_TABLE[@]}"; do [ "${step%%|*}" = "$name" ] && found="$step"; done
        [ -n "$found" ] || { echo "gpu_check.sh: no step $name in --only (the steps: $(printf '%s ' "${STEP_TABLE[@]%%|*}"))" >&2; return 2; }
        echo "$found"
    done
}

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
        row["output_tail"] = open(log_file, errors="replace").read().splitlines()[-25:]
    except OSError:
        pass
print(json.dumps(row))
EOF
}

append_log() {  # append_log NAME FILE...: the step's whole output into gpu_check.log
    local name="$1"; shift
    { echo "===== $name ====="; cat "$@" 2>/dev/null; echo; } >> "$LOG"
}

rank_errors() {  # rank_errors DIR: the tracebacks the ranks of every run under DIR recorded (RUN/errors/rank_N.json)
    find "$1" -path '*/errors/rank_*.json' 2>/dev/null | while read -r f; do
        "$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1]); print(d.get("traceback") or d)' "$f"
    done
}

reap() {  # ranks and engines a killed step left behind (torchrun runs in its own session): only this check's,
    # the processes whose command line names its work folder (every step's run directory is under it), never
    # another job's ranks on the same machine (a fixed string: nothing in the path is read as a pattern)
    [ -n "$WORK" ] || return 0
    local pid
    for pid in $(grep -lsF -- "$WORK/" /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3); do
        [ "$pid" = "$$" ] || kill -9 "$pid" 2>/dev/null
    done
    sleep 1
}

train_command() {  # train_command METHOD BENCH_OPTS SETS: the `rlctl bench train` command line
    local args="" s
    for s in $3; do args="$args --set $s"; done
    echo "$PY -m rlctl bench train --model $MODEL --random-init --method $1 --gpus 1 --steps $STEPS --json --output-dir WORKDIR $2$args"
}

expand() {  # expand NAME CMD: the placeholders of a cmd step
    local cmd="$2"
    cmd="${cmd//RLCTL/$PY -m rlctl}"
    cmd="${cmd//WORKDIR/$WORK/$1}"
    cmd="${cmd//ENGINES/$(engines)}"
    cmd="${cmd/#PY /$PY }"
    echo "$cmd"
}

engines() {  # the rollout engines installed here, for bench rollout
    local list=hf e
    for e in vllm sglang; do have "$e" > /dev/null 2>&1 && list="$list,$e"; done
    echo "$list"
}

run_step() {  # run_step NAME MODULES CAP COMMAND
    local name="$1" mods="$2" cap="$3" cmd="$4" missing t0 rc limit
    missing="$(have ${mods//,/ } 2>/dev/null)"
    if [ $? -ne 0 ]; then
        echo "[skip] $name: missing $missing"
        record "$name" skipped 0 "$cmd" /dev/null /dev/null "not installed: $missing"
        return
    fi
    limit=$(left)
    if [ "$limit" -lt 30 ]; then
        echo "[skip] $name: ${limit}s of the --budget left"
        record "$name" skipped 0 "$cmd" /dev/null /dev/null "budget: ${limit}s left of ${BUDGET}s"
        return
    fi
    [ "$limit" -gt "$cap" ] && limit=$cap
    [[ "$SNAPSHOT_STEPS" == *" $name "* ]] && cmd="RLCTL_CUDA_MEMORY_SNAPSHOT=$OUTDIR/$name.cuda_memory.pickle $cmd"
    echo "[run ] $name (at most ${limit}s): $cmd"
    t0=$(date +%s%N)
    (cd "$REPO" && timeout -k 15 "$limit" bash -c "$cmd") > "$WORK/$name.out" 2> "$WORK/$name.log"
    rc=$?
    reap
    local status=ok reason=""
    [ $rc -eq 0 ] || status=failed
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=timeout; reason="stopped after ${limit}s"; fi
    echo "[$status] $name (exit $rc, $(elapsed "$t0")s)"
    [ $status = ok ] || rank_errors "$WORK/$name" | tee -a "$WORK/$name.log" | tail -12
    record "$name" "$status" "$(elapsed "$t0")" "$cmd" "$WORK/$name.out" "$WORK/$name.log" "$reason"
    append_log "$name" "$WORK/$name.log" "$WORK/$name.out"
}

dry_train_step() {  # dry_train_step NAME METHOD BENCH_OPTS SETS
    local name="$1" method="$2" bench_opts="$3" sets="$4" data="$WORK/rl.jsonl" args=() s t0 rc
    case "$method" in sft) data="$WORK/sft.jsonl" ;; dpo|rm) data="$WORK/pairs.jsonl" ;; esac
    # --teacher NAME: the directory bench train resolves it to (config and tokenizer; the weights are written
    # only when the job runs), checked in the plan as algo.teacher
    if [[ " $bench_opts " =~ \ --teacher\ ([^ ]+) ]]; then
        sets="$sets algo.teacher=$("$PY" -c 'import sys; from rlctl.bench.models import resolve_bench_model as r
print(r(sys.argv[1], random_init=True, need_weights=False).path)' "${BASH_REMATCH[1]}")"
    fi
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
    # the benchmark's own options must exist
    [ $rc -eq 0 ] && ! check_options "$name" "$PY -m rlctl bench train --help" "$bench_opts" && rc=1
    local status=dry-ok
    [ $rc -eq 0 ] || status=dry-failed
    echo "[$status] $name"
    record "$name" "$status" "$(elapsed "$t0")" "$cmd" "$WORK/$name.out" "$WORK/$name.log"
    [ $rc -eq 0 ]
}

check_options() {  # check_options NAME HELP_COMMAND OPTIONS: every --option of OPTIONS is in HELP_COMMAND's output
    local name="$1" help_cmd="$2" opts="$3" opt rc=0
    (cd "$REPO" && eval "$help_cmd") > "$WORK/$name.help" 2>&1 || { echo "$name: $help_cmd failed" >> "$WORK/$name.log"; return 1; }
    for opt in $(echo "$opts" | grep -oE -- '--[a-z][a-z-]*' | sort -u); do
        grep -q -- "$opt" "$WORK/$name.help" || { echo "$name: $opt is not an option of: $help_cmd" >> "$WORK/$name.log"; rc=1; }
    done
    return $rc
}

dry_cmd_step() {  # dry_cmd_step NAME COMMAND: every --option of COMMAND appears in its --help
    local name="$1" cmd="$2" rc=0
    check_options "$name" "$(echo "$cmd" | sed -E 's/ --.*$//') --help" "$cmd" || rc=1
    local status=dry-ok
    [ $rc -eq 0 ] || status=dry-failed
    echo "[$status] $name"
    record "$name" "$status" 0 "$cmd" /dev/null "$WORK/$name.log"
    [ $rc -eq 0 ]
}

install_kit() {  # the kit's wheels into a private folder, on PYTHONPATH after the checkout
    local wheels=("$KIT"/*.whl) site="$WORK/site" w
    [ -e "${wheels[0]}" ] || { echo "[kit ] no wheels in $KIT (run \`make gpu-kit\` on a machine with pip access)"; return; }
    echo "[kit ] installing ${#wheels[@]} wheels from $KIT"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" >> "$LOG" 2>&1; then
        for w in "${wheels[@]}"; do  # one by one: a wheel this Python refuses costs only its own steps
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$w" >> "$LOG" 2>&1 \
                || echo "[kit ] could not install $(basename "$w") (see gpu_check.log)"
        done
    fi
    export PYTHONPATH="$REPO:$site${PYTHONPATH#"$REPO"}"
}

versions() {  # what is here, as JSON on stdout; a readable copy on stderr
    "$PY" - "$KIT" <<'EOF'
import json, platform, shutil, subprocess, sys
from importlib import metadata
from pathlib import Path
doc = {"python": platform.python_version(), "host": platform.node(), "gpus": []}
if shutil.which("nvidia-smi"):
    q = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    doc["gpus"] = subprocess.run(q, capture_output=True, text=True).stdout.strip().splitlines()
try:
    import torch
    doc["torch"], doc["cuda"] = torch.__version__, torch.version.cuda
    doc["cuda_available"] = torch.cuda.is_available()
except Exception as e:
    doc["torch"] = f"not importable: {e}"
names = ["transformers", "peft", "accelerate", "tokenizers", "safetensors", "pyarrow", "pandas", "huggingface-hub",
         "fsspec", "datasets", "dill", "multiprocess", "omegaconf", "math-verify", "megatron-core", "vllm", "sglang",
         "flash-attn", "transformer-engine", "triton", "typer", "rich", "numpy"]
doc["packages"] = {}
for n in names:
    try:
        doc["packages"][n] = metadata.version(n)
    except metadata.PackageNotFoundError:
        doc["packages"][n] = None
problems = []  # the kit's requirements that this machine's versions do not meet (pip --no-deps checks none)
kit = Path(sys.argv[1]) / "kit.json"
if kit.exists():
    from packaging.requirements import Requirement
    for dist in json.loads(kit.read_text())["distributions"]:
        for text in metadata.requires(dist) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{dist} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist} needs {req}: {have} is here")
doc["kit_requirement_problems"] = problems
print(json.dumps(doc))
print("versions: " + json.dumps(doc, indent=1), file=sys.stderr)
EOF
}

failed=0
STEPS_TO_RUN="$(ordered_steps)" || exit 2
if [ $DRY -eq 1 ]; then
    bash -n "$0" || { echo "gpu_check.sh: syntax error" >&2; exit 1; }
    printf '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n%.0s' 1 2 3 4 5 6 7 8 > "$WORK/sft.jsonl"
    printf '{"prompt": "What is 1 + 1?", "answer": "2"}\n%.0s' 1 2 3 4 5 6 7 8 > "$WORK/rl.jsonl"
    printf '{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}\n%.0s' 1 2 3 4 5 6 7 8 > "$WORK/pairs.jsonl"
    echo '{"dry": true}' > "$WORK/versions.json"
    while IFS= read -r step <&3; do  # fd 3: no step's command can read the list
        IFS='|' read -r name mods cap kind a b c <<< "$step"
        if [ "$kind" = train ]; then
            dry_train_step "$name" "$a" "$b" "$c" || failed=1
        else
            dry_cmd_step "$name" "$(expand "$name" "$a")" || failed=1
        fi
    done 3<<< "$STEPS_TO_RUN"
else
    install_kit
    versions > "$WORK/versions.json"
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "gpu_check.sh: no CUDA GPU visible (use --dry on a machine without one)" >&2; exit 2; }
    while IFS= read -r step <&3; do  # fd 3: no step's command can read the list
        IFS='|' read -r name mods cap kind a b c <<< "$step"
        if [ "$kind" = train ]; then cmd="$(train_command "$a" "$b" "$c")"; else cmd="$a"; fi
        cmd="$(expand "$name" "$cmd")"
        run_step "$name" "$mods" "$cap" "$cmd"
        case "$(tail -1 "$RECORDS" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["status"])')" in
            failed|timeout) failed=1 ;;
        esac
    done 3<<< "$STEPS_TO_RUN"
fi

"$PY" - "$RECORDS" "$OUTDIR/gpu_check.json" "$DRY" "$MODEL" "$BUDGET" "$WORK/versions.json" <<'EOF'
import json, sys, time
records, out, dry, model, budget, versions = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4], int(sys.argv[5]), sys.argv[6]
steps = [json.loads(line) for line in open(records) if line.strip()]
doc = {
    "what": "benchmarks/gpu_check.sh" + (" --dry (commands checked on CPU, nothing ran on a GPU)" if dry else ""),
    "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    "model": model,
    "budget_s": budget,
    "versions": json.load(open(versions)),
    "steps": steps,
    "summary": {s: sum(1 for r in steps if r["status"] == s) for s in sorted({r["status"] for r in steps})},
}
json.dump(doc, open(out, "w"), indent=1)
print(f"wrote {out}: {doc['summary']}")
for r in steps:
    res = r.get("result") or {}
    extra = ""
    if isinstance(res, dict) and "memory" in res:
        m = res["memory"]
        extra = f" measured {m.get('measured_bytes')} est {m.get('estimated_bytes')}"
    print(f"  {r['step']:24s} {r['status']:8s} {r['seconds']:7.1f}s{extra} {r.get('reason', '')}")
EOF
echo "total: $(( $(date +%s) - T_START ))s of a ${BUDGET}s budget"
exit $failed
