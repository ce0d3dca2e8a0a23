#!/usr/bin/env bash
# GPU check in one call: kernel parity on the GPU (every backend, bf16 and fp16), the
# benchmark suite, and a short corpus sweep on --device cuda. Logs and JSON go to a folder;
# a short table is printed last. Installs nothing from the network.
#
#   scripts/gpu_check.sh [--out DIR] [--cpu] [--budget SECONDS] [--skip STEP ...]
#
#   --out DIR     where logs and JSON go (default: $OUT, else ./gpu-check-out)
#   --cpu         dry run of the same steps on this CPU: the parity tests under Triton's
#                 interpreter (TRITON_INTERPRET=1) on a tiny selection, a tiny benchmark grid,
#                 a float32 sweep (this is how the script is tested without a GPU)
#   --budget S    wall-clock budget for everything (default 450 s; each step is cut to fit)
#   --skip STEP   skip one of: tests, bench, cli, sweep (repeatable)
#
# Offline installation: the project is installed from this working tree with
# `pip install --no-deps --no-build-isolation -e .` (falling back to PYTHONPATH); test-only
# packages missing on the machine (pytest, pytest-benchmark, hypothesis, pytest-xdist and
# their pure-Python dependencies) are installed from ./wheels when that folder exists:
#   pip download --only-binary=:all: -d wheels pytest pytest-benchmark hypothesis pytest-xdist
# (run where there is network; all of them are py3-none-any wheels, ~5 MB).
#
# Exit status: 0 when every step that ran passed; 1 otherwise (the table says which).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

OUT_DIR="${OUT:-$ROOT/gpu-check-out}"
MODE=gpu
BUDGET=450
SKIP=" "
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT_DIR="$2"; shift 2 ;;
        --cpu | --dry-run) MODE=cpu; shift ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --skip) SKIP="$SKIP$2 "; shift 2 ;;
        -h | --help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"
STEPS="$OUT_DIR/steps.tsv"
: >"$STEPS"
START=$(date +%s)
PY="${PYTHON:-python}"

# glibc keeps large freed blocks mapped (steadier CPU timings); read only at process start.
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296
export PYTHONDONTWRITEBYTECODE=1 HYPOTHESIS_PROFILE=ci

say() { echo "gpu_check: $*" | tee -a "$LOG" >&2; }

remaining() { echo $((BUDGET - ($(date +%s) - START))); }

# run_step NAME MAX_SECONDS COMMAND...: run with a timeout that fits the remaining budget,
# output to $OUT_DIR/NAME.log, one line (name, status, seconds) to steps.tsv.
run_step() {
    local name="$1" max="$2"
    shift 2
    local left
    left=$(($(remaining) - 20))
    local limit=$((max < left ? max : left))
    if [ "$limit" -lt 10 ]; then
        say "$name: skipped, budget spent"
        printf '%s\tskipped (budget)\t0\n' "$name" >>"$STEPS"
        return 0
    fi
    say "$name: start (limit ${limit}s): $*"
    local t0 rc status
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="timeout (${limit}s)" ;;
        5) status="no tests collected" ;;
        *) status="failed (rc $rc)" ;;
    esac
    printf '%s\t%s\t%s\n' "$name" "$status" $(($(date +%s) - t0)) >>"$STEPS"
    say "$name: $status after $(($(date +%s) - t0))s (log: $OUT_DIR/$name.log)"
    tail -n 5 "$OUT_DIR/$name.log" >>"$LOG"
    return 0
}

skipped() { case "$SKIP" in *" $1 "*) return 0 ;; esac; return 1; }

# --- 1. versions ------------------------------------------------------------------------------
say "mode $MODE, output $OUT_DIR, budget ${BUDGET}s"
"$PY" - >"$OUT_DIR/versions.json" 2>>"$LOG" <<'EOF'
import importlib, json, platform, sys
info = {"python": platform.python_version()}
for name in ("torch", "triton", "transformers", "vllm", "pytest", "pytest_benchmark", "hypothesis", "xdist"):
    try:
        module = importlib.import_module(name)
        info[name] = getattr(module, "__version__", "present")
    except Exception as exc:  # report, do not fail: missing optional packages are expected
        info[name] = None
try:
    import torch
    info["cuda"] = torch.version.cuda
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
except Exception:
    pass
print(json.dumps(info, indent=1))
EOF
cat "$OUT_DIR/versions.json" | tee -a "$LOG"
if ! "$PY" -c "import torch, transformers" 2>/dev/null; then
    say "$PY cannot import torch and transformers: activate the environment or set PYTHON="
    exit 1
fi
if [ "$MODE" = gpu ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "no CUDA device visible: run with --cpu for the dry run"
    exit 1
fi

# --- 2. offline installation ------------------------------------------------------------------
if [ -d "$ROOT/wheels" ]; then
    missing=$("$PY" - <<'EOF'
import importlib.util
need = {"pytest": "pytest", "pytest_benchmark": "pytest-benchmark", "hypothesis": "hypothesis", "xdist": "pytest-xdist"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
    if [ -n "$missing" ]; then
        say "installing from wheels/: $missing"
        # shellcheck disable=SC2086
        "$PY" -m pip install --no-index --find-links "$ROOT/wheels" $missing >>"$LOG" 2>&1 \
            || say "wheel install failed (see log); continuing with what is installed"
    fi
fi
if "$PY" -m pip install --no-deps --no-build-isolation -e "$ROOT" >>"$LOG" 2>&1; then
    say "installed this working tree (editable, no deps)"
else
    say "editable install failed; using PYTHONPATH=$ROOT"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
HAS_PYTEST=$("$PY" -c "import pytest, pytest_benchmark, hypothesis; print(1)" 2>/dev/null || echo 0)
XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi

if [ "$MODE" = cpu ]; then
    DEVICE=cpu DTYPE=float32
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
    TEST_SELECT=(-k "1x7 or 3x5x74 or T5-E4 or special or outside or edges or strided_weights or supports or fresh_process")
    XDIST=()
    export FUSION_BENCH_DEVICE=cpu FUSION_BENCH_BUDGET=0.1 FUSION_BENCH_THREADS=1
    export FUSION_BENCH_TOKENS=16 FUSION_BENCH_KERNELS=rmsnorm_llama,rmsnorm_gemma,act_and_mul,qkv,model_llama
    CLI_ARGS=(--device cpu --kernel rmsnorm_llama --kernel act_and_mul --tokens 16 --budget 0.1 --threads 1)
    SWEEP_ARCHS=(--arch llama --arch qwen3)
    JOBS=2
else
    DEVICE=cuda DTYPE=bfloat16
    unset TRITON_INTERPRET
    # every test on the GPU but the Hypothesis one (each new shape is a compile; the
    # interpreter runs it in CI)
    TEST_SELECT=(-k "not property")
    export FUSION_BENCH_DEVICE=cuda FUSION_BENCH_BUDGET=0.2 FUSION_BENCH_FULL=1
    CLI_ARGS=(--device cuda --kernel rmsnorm_llama --kernel rmsnorm_gemma --kernel act_and_mul --tokens 4096 --budget 0.2)
    SWEEP_ARCHS=(--arch llama --arch qwen3 --arch qwen3_moe --arch gemma --arch mixtral)
    JOBS=4
fi

# --- 3. kernel parity (every backend; bf16 and fp16 on the GPU) -------------------------------
if skipped tests; then
    printf 'tests\tskipped (--skip)\t0\n' >>"$STEPS"
elif [ "$HAS_PYTEST" != 1 ]; then
    say "tests: pytest/pytest-benchmark/hypothesis missing and no usable wheels/: skipped"
    printf 'tests\tskipped (no pytest)\t0\n' >>"$STEPS"
else
    run_step tests 200 "$PY" -m pytest tests/fusion/kernels -q -p no:cacheprovider -rs \
        "${XDIST[@]}" "${TEST_SELECT[@]}" --junitxml "$OUT_DIR/tests.xml"
fi

# --- 4. benchmark suite (pytest-benchmark; speedup rows as JSON) -------------------------------
if skipped bench; then
    printf 'bench\tskipped (--skip)\t0\n' >>"$STEPS"
elif [ "$HAS_PYTEST" != 1 ]; then
    printf 'bench\tskipped (no pytest)\t0\n' >>"$STEPS"
else
    export FUSION_BENCH_JSON="$OUT_DIR/bench-speedups.json"
    run_step bench 200 "$PY" -m pytest tests/bench/test_bench_kernels.py \
        tests/bench/test_bench_models.py -q -p no:cacheprovider -p no:xdist \
        --benchmark-json "$OUT_DIR/bench-pytest.json" --benchmark-columns=median,iqr,rounds
    unset FUSION_BENCH_JSON
fi

# --- 5. `fusion-harness bench` (speedup table with % of copy bandwidth on the GPU) -------------
if skipped cli; then
    printf 'cli\tskipped (--skip)\t0\n' >>"$STEPS"
else
    run_step cli 60 "$PY" -m harness.bench "${CLI_ARGS[@]}" \
        --json "$OUT_DIR/bench-cli.json"
fi

# --- 6. short corpus sweep ---------------------------------------------------------------------
if skipped sweep; then
    printf 'sweep\tskipped (--skip)\t0\n' >>"$STEPS"
else
    run_step sweep 120 "$PY" -m harness run --device "$DEVICE" --dtype "$DTYPE" \
        "${SWEEP_ARCHS[@]}" -j "$JOBS" --timeout 90 --results "$OUT_DIR/sweep.jsonl" \
        --json "$OUT_DIR/sweep.json" --repro-dir "$OUT_DIR/repro"
fi

# --- 7. the short table, last ------------------------------------------------------------------
"$PY" - "$OUT_DIR" "$(($(date +%s) - START))" <<'EOF' | tee "$OUT_DIR/summary.txt"
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, wall = Path(sys.argv[1]), int(sys.argv[2])
steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines() if line]
detail = {}
try:
    suite = ET.parse(out / "tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    detail["tests"] = "{} tests, {} failed, {} errors, {} skipped".format(
        suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped"))
except Exception:
    pass
rows = []
for step, name in (("bench", "bench-speedups.json"), ("cli", "bench-cli.json")):
    try:
        found = json.loads((out / name).read_text())["rows"]
    except Exception:
        continue
    rows += found
    speedups = [r["speedup"] for r in found if r.get("speedup")]
    detail[step] = f"{len(found)} fused rows" + (
        f", speedup {min(speedups):.2f}x..{max(speedups):.2f}x" if speedups else "")
try:
    sweep = json.loads((out / "sweep.json").read_text())
    t = sweep["totals"]
    detail["sweep"] = f"{t['architectures']} archs, {t['green']} pass, statuses {t['statuses']}"
except Exception:
    pass
versions = json.loads((out / "versions.json").read_text())
print()
print("gpu_check summary  ({}; torch {}, triton {}, transformers {}; {} s)".format(
    versions.get("gpu") or "cpu dry run", versions.get("torch"), versions.get("triton"),
    versions.get("transformers"), wall))
width = max(len(s[0]) for s in steps) if steps else 5
for name, status, seconds in steps:
    print(f"  {name:<{width}}  {status:<20} {seconds:>4}s  {detail.get(name, '')}")
best = {}
for r in rows:
    key = (r["kernel"], r["variant"])
    if key not in best or r.get("tokens", 0) > best[key].get("tokens", 0):
        best[key] = r
if best:
    print("  largest token count per kernel and variant (speedup = unfused / fused):")
    for (kernel, variant), r in sorted(best.items()):
        bw = f"  {100 * r['copy_fraction']:.0f}% of copy BW" if r.get("copy_fraction") else ""
        ratio = f"{r['speedup']:.2f}x" if r.get("speedup") else (r.get("note") or "-")[:50]
        print(f"    {kernel:<16} {variant:<16} T={r['tokens']:<5} {ratio}{bw}")
EOF
if grep -qv $'\tok\t\|\tskipped' "$STEPS"; then
    exit 1
fi
exit 0
