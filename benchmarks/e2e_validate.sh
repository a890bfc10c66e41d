#!/usr/bin/env bash
# GPU validation of the end-to-end work (issue 11) on one CUDA GPU, from the repository root:
#   bash benchmarks/e2e_validate.sh [OUT]          (OUT defaults to e2e_validate/)
# 1. the GPU tests of the preprocessing pipeline, the Encoder and the e2e bench (pytest -m gpu);
# 2. benchmarks/e2e_profile.py: per-stage preprocessing times (no tower), OUT/profile.txt;
# 3. `mmenc bench --e2e --compile --cuda-graphs`: encode(files) vs tower only vs transformers, eager
#    rows too, the stream's GPU busy fraction, OUT/e2e.txt and OUT/e2e.json.
# Each step's exit status is in OUT/status.txt; the script goes on after a failing step.
set -u
OUT=${1:-e2e_validate}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
: > "$OUT/status.txt"
step() {  # step NAME COMMAND...: run, keep its output in OUT/NAME.txt, record its exit status
    local name=$1
    shift
    local start=$SECONDS
    "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$OUT/status.txt"
}
step pytest_gpu python -m pytest -q -p no:cacheprovider -m gpu tests/test_preprocess_pipeline.py \
    tests/test_e2e_bench.py tests/test_encoder.py
step profile python benchmarks/e2e_profile.py --reps 5 --json "$OUT/profile.json"
step e2e python -m mmenc bench --e2e --compile --cuda-graphs --json "$OUT/e2e.json"
tail -n 40 "$OUT/e2e.txt"
