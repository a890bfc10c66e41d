#!/usr/bin/env bash
# GPU validation of the end-to-end work (issue 11) on one CUDA GPU, from the repository root, < 5 min:
#   bash benchmarks/e2e_validate.sh [OUT]          (OUT defaults to e2e_validate/)
# 1. the GPU tests of the preprocessing pipeline, the Encoder and the e2e bench (pytest -m gpu, 60 s cap);
# 2. `mmenc bench --e2e --compile --cuda-graphs` (fewer iterations, a 600-image stream; 230 s cap):
#    encode(files) (and without the small first chunk) vs preprocess only vs tower only vs transformers,
#    eager rows, the stream's GPU busy fraction. Each workload's rows go to stderr as soon as measured,
#    so a cut run still shows them.
# 3. only with E2E_PROFILE=1: benchmarks/e2e_profile.py --reps 3 (per-stage preprocessing, ~45 s).
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
step pytest_gpu 60 python -m pytest -q -p no:cacheprovider -rfE -s -m gpu tests/test_preprocess_pipeline.py \
    tests/test_e2e_bench.py tests/test_encoder.py
grep -E "FAILED|ERROR|Error|passed|failed|vs PIL|levels" "$OUT/pytest_gpu.txt" | tail -n 30
step e2e 230 python -m mmenc bench --e2e --compile --cuda-graphs --warmup 2 --iters 5 --stream-images 600 \
    --json "$OUT/e2e.json"
grep -E "^(workload|[0-9a-z]+x[0-9]+px|-{10}|model=|stream:|invariance|.*preprocessing share)" "$OUT/e2e.txt" | tail -n 60
if [ "${E2E_PROFILE:-0}" = 1 ]; then
    step profile 75 python benchmarks/e2e_profile.py --reps 3 --json "$OUT/profile.json"
    grep -E "Preprocessor.run|decode_jpeg|host ms|_to_device|one Preprocessor.run" "$OUT/profile.txt" | tail -n 40
fi
tar czf "$OUT.tar.gz" "$OUT"
echo "all outputs: $OUT/ and $OUT.tar.gz"
