#!/usr/bin/env bash
# GPU validation of batch-invariant mode (issue 11) in < 3 minutes on an H200; everything on stdout.
#   bash benchmarks/invariant_validate.sh   (from the repository root; also writes $OUT/inv_validate.json when OUT is set)
# 1. Throughput, compiled + CUDA graphs (Qwen2.5-VL-7B tower, random weights, bf16): default vs invariant, and
#    invariant with one tile size for every linear (inv-uniform) or 16384-row tiles for the narrow linears
#    (inv-narrow-16384), and with TRITON_ATTN's invariant path for the full layers too (inv-triton-all:
#    mm_encoder_attn_backend="TRITON_ATTN"). Target: invariant >= 0.85x default.
# 2. Bitwise invariance, GPU tests: TRITON_ATTN's invariant path, the tower (eager / compiled / graphs), the
#    tile GEMM rows with the tower's tile sizes, the opt-in Triton GEMM's rows.
# 3. Every registered family (eager, full size) in the time left. Each step is time-boxed; tests print as they run.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
echo "== 1. compiled + CUDA graphs: default vs invariant ($(date -u +%T))"
timeout 95 "$PY" benchmarks/invariant_cost.py --variants "" --no-ops --warmup 2 --iters 7 \
    --compiled default,invariant,inv-uniform,inv-narrow-16384,inv-triton-all --json "${OUT:-/tmp}/inv_validate.json" 2>&1 \
    | grep -v -e "WARNING" -e "^INFO" -e "^  .*built+timed"
echo "== 2. GPU invariance tests ($(date -u +%T))"
timeout 55 "$PY" -m pytest -m gpu -p no:cacheprovider -v --tb=line tests/test_triton_attn.py tests/test_batch_invariance.py \
    -k "gpu_invariant_segment or (gpu_tower_is_batch_invariant and not triton_gemm) or tile_gemm_row or triton_gemm_rows" \
    2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error|Error" | sed 's/^tests\///' | cut -c1-240
echo "== 3. every family, eager ($(date -u +%T))"
timeout 30 "$PY" -m pytest -m gpu -p no:cacheprovider -v --tb=line tests/test_batch_invariance.py \
    -k "every_family_is_batch_invariant_eager" 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error|Error" | sed 's/^tests\///' | cut -c1-240
echo "== done ($(date -u +%T))"
