#!/usr/bin/env bash
# Issue 27 on one H200: the gpu-marked tests of the fused kernels and FP8, the kernel checks
# (benchmarks/kernels_check.py: FP8 vs bf16 GEMMs, fused row kernels vs torch/Inductor, FP8 accuracy on the
# full Qwen2.5-VL-7B tower), then `mmenc bench --profile` on 8x1036px and 32x448px, compiled + CUDA graphs:
# reference (with transformers eager) vs --fused-kernels vs --fused-kernels --quantization fp8, the FP8
# accuracy table, then (budget allowing) the reference with transformers eager + compiled, unfused fp8, and
# fp8-all, and one summary table last. Not run by CI.
#   bash benchmarks/kernels_gpu.sh OUTDIR            # from the repository root: the first 7 steps, ~6 min
#   ONLY="hf_compiled fp8_unfused fused_fp8_all" BUDGET_S=470 bash benchmarks/kernels_gpu.sh OUTDIR2   # the rest
# (run kernels-1: tests 31 s, gemm 5, rows 23, reference 124 (1 warm-up + 4 calls), fused 30, fused_fp8 33,
# accuracy 45; transformers under torch.compile compiles once per workload)
# Env: PY (python, default python3), BUDGET_S (whole-script budget, default 460 s; a step is skipped when
# under 2/3 of its limit is left), WARMUP/ITERS (bench, default 2/6), ONLY (space-separated step names),
# TARBALL (a path: every log and JSON of OUTDIR packed there at the end).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/kernels_gpu.sh OUTDIR}
py=${PY:-python3}
budget=${BUDGET_S:-460}
warmup=${WARMUP:-2}
iters=${ITERS:-6}
mkdir -p "$out"
: > "$out/steps.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$SECONDS
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
  'transformers', transformers.__version__, 'gpu', torch.cuda.get_device_name())" | tee "$out/env.txt"

step() {
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local left=$((budget - (SECONDS - start)))
  if [ $((3 * left)) -lt $((2 * limit)) ] || [ "$left" -lt 20 ]; then
    echo "$name: skipped (budget: ${left} s left, its limit ${limit} s)" | tee -a "$out/steps.txt"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$out/steps.txt"
  [ "$rc" -ne 0 ] && tail -n 6 "$out/$name.log"
}
bench() {  # bench NAME LIMIT FLAGS...
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" $py -m mmenc.cli.main bench --model Qwen/Qwen2.5-VL-7B-Instruct --load-format dummy --dtype bfloat16 \
    --compile --cuda-graphs --workload 8x1036px --workload 32x448px --warmup "$warmup" --iters "$iters" \
    --profile --quiet --json "$out/$name.json" "$@"
}

step tests 120 $py -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_rows.py tests/test_fused_layers.py \
  tests/test_fp8.py
step gemm 40 $py benchmarks/kernels_check.py gemm
step rows 60 $py benchmarks/kernels_check.py rows
bench reference 170
bench fused 100 --no-hf --fused-kernels
bench fused_fp8 100 --no-hf --fused-kernels --quantization fp8
step accuracy 120 $py benchmarks/kernels_check.py accuracy
# the rest, by value; with the default budget they are left for a second call (ONLY=...)
bench hf_compiled 300 --hf-compile
bench fp8_unfused 100 --no-hf --quantization fp8
bench fused_fp8_all 100 --no-hf --fused-kernels --quantization fp8-all

echo; echo "== summary ($(cat "$out/env.txt"))"
cat "$out/steps.txt"
for s in gemm rows accuracy; do [ -f "$out/$s.log" ] && { echo "-- $s"; grep -v '^report:\|INFO\|WARNING' "$out/$s.log" | tail -n 12; }; done
for s in reference fused fused_fp8 hf_compiled fp8_unfused fused_fp8_all; do
  [ -f "$out/$s.log" ] && { echo "-- bench $s"; grep -A 40 '^workload ' "$out/$s.log" | grep -v '^  \|^$' | head -n 20; }
done
[ -n "${TARBALL:-}" ] && tar czf "$TARBALL" -C "$out" .
exit 0
