#!/usr/bin/env bash
# GPU validation of batch-invariant mode (issue 11) in < 3 minutes on an H200; everything on stdout.
#   bash benchmarks/invariant_validate.sh   (from the repository root; also writes $OUT/inv_validate.json when OUT is set)
# 1. Throughput, compiled + CUDA graphs (Qwen2.5-VL-7B tower, random weights, bf16): default vs invariant, vs
#    invariant with one tile size for every linear (inv-uniform: no 8192-row tiles for the narrow linears), and
#    vs invariant with TRITON_ATTN's invariant path for the full layers too (inv-triton-all:
#    mm_encoder_attn_backend="TRITON_ATTN"). Target: invariant >= 0.85x default on both workloads.
# 2. Bitwise invariance, GPU tests: the tower (eager / compiled / graphs) and the tile GEMM rows with the
#    tower's tile sizes; then TRITON_ATTN's invariant path and the opt-in Triton GEMM's rows.
# 3. Every registered family (eager, full size) in the time left. Each step is time-boxed; tests print as they run.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
tests() {  # seconds, then pytest arguments: one line per test as it finishes
    timeout "$1" "$PY" -m pytest -m gpu -p no:cacheprovider -v --tb=line "${@:2}" 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error|Error" | sed 's/^tests\///' | cut -c1-240
}
echo "== 1. compiled + CUDA graphs: default vs invariant ($(date -u +%T))"
timeout 80 "$PY" benchmarks/invariant_cost.py --variants "" --no-ops --warmup 2 --iters 7 \
    --compiled default,invariant,inv-uniform,inv-triton-all --json "${OUT:-/tmp}/inv_validate.json" 2>&1 \
    | grep -v -e "WARNING" -e "^INFO" -e "^  .*built+timed"
echo "== 2a. tower and tile GEMM invariance ($(date -u +%T))"
tests 55 tests/test_batch_invariance.py -k "(gpu_tower_is_batch_invariant and not triton_gemm) or tile_gemm_row"
echo "== 2b. TRITON_ATTN invariant path, Triton GEMM rows ($(date -u +%T))"
tests 25 tests/test_triton_attn.py tests/test_batch_invariance.py -k "gpu_invariant_segment or triton_gemm_rows"
echo "== 3. every family, eager ($(date -u +%T))"
tests 20 tests/test_batch_invariance.py -k "every_family_is_batch_invariant_eager"
echo "== done ($(date -u +%T))"
