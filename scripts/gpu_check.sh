#!/usr/bin/env bash
# On a machine with CUDA: the tests, every notebook with DEVICE=cuda in float32 and bfloat16, and the
# benchmark; a report under build/gpu/. CI never runs this; run it whenever a CUDA machine is available.
#
#   bash scripts/gpu_check.sh            # full sizes
#   SMOKE=1 bash scripts/gpu_check.sh    # small sizes (minutes)
#
# Exit status: non-zero if any step failed (every step runs regardless; the report says which).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-.venv/bin/python}"
SMOKE="${SMOKE:-0}"
OUT="build/gpu"
mkdir -p "$OUT"
REPORT="$OUT/report.md"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to $PY (torch.cuda.is_available() is False): nothing to check" >&2
    exit 2
fi

declare -A STATUS
run_step() {  # name, log file, command...
    local name="$1" log="$2"
    shift 2
    local t0=$SECONDS
    echo "== $name"
    "$@" >"$log" 2>&1
    local rc=$?
    STATUS["$name"]="rc=$rc, $((SECONDS - t0)) s, log: $log"
    tail -n 5 "$log"
    return $rc
}

failed=0
# 1. tests (they pick CUDA up where a test asks for "auto"; the engine tests pin the CPU reference)
run_step "pytest" "$OUT/pytest.log" "$PY" -m pytest -q || failed=1

# 2. every notebook on CUDA, float32 and bfloat16 (papermill parameters; executed copies kept per dtype)
for dtype in float32 bfloat16; do
    run_step "notebooks $dtype" "$OUT/notebooks_$dtype.log" \
        "$PY" - "$dtype" "$SMOKE" "$OUT/notebooks_$dtype" <<'EOF' || failed=1
import glob, os, subprocess, sys, time
import papermill as pm
dtype, smoke, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
os.makedirs(out, exist_ok=True)
bad = 0
for nb in sorted(glob.glob("notebooks/[0-9][0-9]*_*.ipynb")):
    t0 = time.time()
    try:
        pm.execute_notebook(nb, os.path.join(out, os.path.basename(nb)), cwd="notebooks", kernel_name="python3",
                            parameters={"DEVICE": "cuda", "DTYPE": dtype, "SMOKE": smoke, "SEED": 0},
                            progress_bar=False, request_save_on_cell_execute=False)
        print(f"ok     {os.path.basename(nb):45s} {time.time() - t0:7.1f} s", flush=True)
    except Exception as e:
        bad += 1
        print(f"FAILED {os.path.basename(nb):45s} {time.time() - t0:7.1f} s  {type(e).__name__}: {str(e)[:300]}", flush=True)
sys.exit(1 if bad else 0)
EOF
done

# 3. the benchmark on CUDA, float32 and bfloat16 (all 24 layers)
bench_flags=()
[ "$SMOKE" = "1" ] && bench_flags+=(--smoke)
for dtype in float32 bfloat16; do
    run_step "bench $dtype" "$OUT/bench_$dtype.log" \
        "$PY" scripts/bench.py --device cuda --dtype "$dtype" --out "$OUT/bench_$dtype.json" "${bench_flags[@]}" || failed=1
done

{
    echo "# kvlab GPU check"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- gpu: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"
    echo "- torch: $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"
    echo "- SMOKE: $SMOKE"
    echo
    echo "| step | result |"
    echo "|---|---|"
    for name in "pytest" "notebooks float32" "notebooks bfloat16" "bench float32" "bench bfloat16"; do
        echo "| $name | ${STATUS[$name]:-not run} |"
    done
    for dtype in float32 bfloat16; do
        echo
        echo "## notebooks, $dtype"
        echo '```'
        grep -E "^(ok|FAILED)" "$OUT/notebooks_$dtype.log" || true
        echo '```'
        echo
        echo "## benchmark, $dtype"
        echo '```'
        sed -n '/^ *goal/,$p' "$OUT/bench_$dtype.log" || true
        echo '```'
    done
} >"$REPORT"
echo "report: $REPORT"
exit $failed
