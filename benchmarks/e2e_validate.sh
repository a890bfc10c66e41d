#!/usr/bin/env bash
# GPU validation of the end-to-end work (issue 11) on one CUDA GPU, from the repository root, ~4-5 min:
#   bash benchmarks/e2e_validate.sh [OUT]          (OUT defaults to e2e_validate/)
# 1. the GPU tests of the preprocessing pipeline, the Encoder and the e2e bench (pytest -m gpu, 120 s cap);
# 2. benchmarks/e2e_profile.py --reps 3: per-stage preprocessing times, no tower (90 s cap);
# 3. `mmenc bench --e2e --compile --cuda-graphs` (fewer iterations, a 1000-image stream; 270 s cap):
#    encode(files) vs tower only vs transformers, eager rows, the stream's GPU busy fraction. Each
#    workload's rows go to stderr as soon as measured, so a cut run still shows them.
# Everything lands in OUT/ and OUT.tar.gz; the summary lines are printed to stdout.
set -u
OUT=${1:-e2e_validate}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
: > "$OUT/status.txt"
step() {  # step NAME SECONDS COMMAND...: run with a time cap, output in OUT/NAME.txt, exit status recorded
    local name=$1 cap=$2
    shift 2
    local start=$SECONDS
    timeout -k 5 "$cap" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - start))$([ $rc = 124 ] && echo ' (cut by the time cap)')" | tee -a "$OUT/status.txt"
}
step pytest_gpu 120 python -m pytest -q -p no:cacheprovider -rfE -s -m gpu tests/test_preprocess_pipeline.py \
    tests/test_e2e_bench.py tests/test_encoder.py
grep -E "FAILED|ERROR|passed|failed|vs PIL|levels" "$OUT/pytest_gpu.txt" | tail -n 30
step profile 90 python benchmarks/e2e_profile.py --reps 3 --json "$OUT/profile.json"
grep -E "Preprocessor.run|decode_jpeg|host ms|_to_device|one Preprocessor.run" "$OUT/profile.txt" | tail -n 40
step e2e 270 python -m mmenc bench --e2e --compile --cuda-graphs --warmup 2 --iters 5 --stream-images 1000 \
    --json "$OUT/e2e.json"
grep -vE "^\s*$" "$OUT/e2e.txt" | grep -vE "Warning|warn\(|^\s+" | tail -n 45
tar czf "$OUT.tar.gz" "$OUT"
echo "all outputs: $OUT/ and $OUT.tar.gz"
