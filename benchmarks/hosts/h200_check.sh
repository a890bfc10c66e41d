#!/usr/bin/env bash
# One H200 call that checks a merged main: the gpu-marked tests of the engine, towers and kernels, video
# files to embeddings (`mmenc bench --video`, issue 26) and CLIP ViT-L/14-336 against its peers (issue 31).
# The kernel bench of issue 27 is benchmarks/kernels_gpu.sh (a call of its own). Wheels missing on the host (av, open_clip_torch, ftfy, wcwidth) come from .whl (carried).
#   bash benchmarks/hosts/h200_check.sh OUTDIR        # ~9 minutes; a short table of each part at the end
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bash benchmarks/hosts/h200_check.sh OUTDIR}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_graphs.py tests/test_batch_invariance.py \
  tests/test_fused_rows.py tests/test_fused_layers.py tests/test_fp8.py tests/test_serve_overlap.py tests/test_inflight.py tests/test_video.py \
  "tests/test_gpu_tower_parity.py" -k "not (test_bf16_parity_with_transformers and not auto)" > "$out/gpu_tests.log" 2>&1
echo "gpu tests: exit $? $(tail -n 1 "$out/gpu_tests.log")"
timeout 200 python3 -m mmenc bench --video --model Qwen/Qwen2.5-VL-7B-Instruct --load-format dummy --dtype bfloat16 \
  --compile --cuda-graphs --json "$out/video.json" > "$out/video.log" 2>&1
echo "video: exit $?"
timeout 90 python3 benchmarks/clip_peers.py --batches 32,256 --json "$out/clip_peers.json" > "$out/clip_peers.log" 2>&1
echo "clip_peers: exit $?"
echo "== failures"; grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -n 20
echo "== video"; grep -v "INFO\|WARNING" "$out/video.log" | tail -n 30
echo "== clip peers"; tail -n 15 "$out/clip_peers.log"
