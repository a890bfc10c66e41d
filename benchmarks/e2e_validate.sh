#!/usr/bin/env bash
# GPU validation of the end-to-end work (issue 11) on one CUDA GPU, from the repository root, < 5 min:
#   bash benchmarks/e2e_validate.sh [OUT]          (OUT defaults to e2e_validate/)
# 1. the GPU tests of the preprocessing pipeline (threads and worker processes), the Encoder and the stream window
#    (pytest -m gpu, 90 s cap);
# 2. `mmenc bench --e2e --compile --cuda-graphs` (fewer iterations, a 600-image stream; 230 s cap):
#    encode(files) with the growing chunk schedule, "1 call", "first+rest" (the schedule before: first chunk,
#    then max_batch_patches) vs preprocess only vs tower only vs transformers, eager rows; per workload one
#    traced encode ("<workload> encode trace": lead-in, tower calls, gaps between them, host ms); the stream's
#    GPU busy fraction, its trace and "tower alone over the same packings". Each workload's rows and trace go
#    to stderr as soon as measured, so a cut run still shows them.
# 3. only with E2E_AB=1: the same bench again with E2E_AB_ARGS (default: the chunk schedule and capture rule
#    of before, "--chunk-growth inf --graph-recent-calls 0"), into OUT/e2e_ab.*; a 200 s cap.
# 4. only with E2E_PROFILE=1: benchmarks/e2e_profile.py --reps 3 (per-stage preprocessing, ~45 s).
# Knobs (environment): E2E_WORKLOADS (default "8x1036px 32x448px", the two; "all": every GPU workload),
# E2E_STREAM (stream images, default 600), E2E_ARGS (more bench flags, e.g. "--chunk-growth 4
# --first-chunk-patches 1024 --graph-recent-calls 8 --preprocess-workers 16"; threads vs worker processes:
# E2E_ARGS="--preprocess-worker-kind thread" E2E_AB=1 E2E_AB_ARGS="--preprocess-worker-kind process").
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
WORKLOAD_ARGS=()
if [ "${E2E_WORKLOADS:-8x1036px 32x448px}" != all ]; then
    for w in ${E2E_WORKLOADS:-8x1036px 32x448px}; do WORKLOAD_ARGS+=(--workload "$w"); done
fi
summary() {  # summary FILE: the table, the traces, the stream
    grep -E "^(workload|[0-9a-z]+x[0-9]+px|-{10}|model=|stream|invariance|.*preprocessing share|.*encode trace)" "$1" \
        | tail -n 60
}
step pytest_gpu 90 python -m pytest -q -p no:cacheprovider -rfE -s -m gpu tests/test_preprocess_pipeline.py \
    tests/test_preprocess_procs.py \
    tests/test_e2e_bench.py tests/test_encoder.py tests/test_inflight.py
grep -E "FAILED|ERROR|Error|passed|failed|vs PIL|levels" "$OUT/pytest_gpu.txt" | tail -n 30
# shellcheck disable=SC2086  # E2E_ARGS is a list of flags
step e2e 230 python -m mmenc bench --e2e --compile --cuda-graphs --warmup 2 --iters 5 \
    --stream-images "${E2E_STREAM:-600}" ${WORKLOAD_ARGS[@]+"${WORKLOAD_ARGS[@]}"} ${E2E_ARGS:-} --json "$OUT/e2e.json"
summary "$OUT/e2e.txt"
if [ "${E2E_AB:-0}" = 1 ]; then
    # shellcheck disable=SC2086
    step e2e_ab 200 python -m mmenc bench --e2e --compile --cuda-graphs --warmup 2 --iters 5 \
        --stream-images "${E2E_STREAM:-600}" ${WORKLOAD_ARGS[@]+"${WORKLOAD_ARGS[@]}"} ${E2E_AB_ARGS:---chunk-growth inf --graph-recent-calls 0} \
        --json "$OUT/e2e_ab.json"
    summary "$OUT/e2e_ab.txt"
fi
if [ "${E2E_PROFILE:-0}" = 1 ]; then
    step profile 75 python benchmarks/e2e_profile.py --reps 3 --json "$OUT/profile.json"
    grep -E "Preprocessor.run|decode_jpeg|host ms|_to_device|one Preprocessor.run" "$OUT/profile.txt" | tail -n 40
fi
tar czf "$OUT.tar.gz" "$OUT"
echo "all outputs: $OUT/ and $OUT.tar.gz"
