#!/usr/bin/env bash
# H200 calls that check a merged main, in parts, each part's output in OUTDIR/<part>.log (and .json):
#   setup    wheels missing on the host (av, open_clip_torch, ftfy, wcwidth, timm) from .whl (carried) into
#            .gpu/site; the video bench's clips (60 s and 15 s of 1280x720 H.264) written into .gpu/clips in the
#            background (about 160 s on the host; the clip parts wait for them)
#   tests    every gpu-marked test (the files of tests/ that mark one; TESTS=files, TESTS_LIMIT=seconds for fewer)
#   firstcall  a compiled tower's speed after a small first call (benchmarks/compile_first_call.py)
#   workers  one clip's preprocessing by worker count (benchmarks/video_workers.py, no GPU)
#   video    `mmenc bench --video` (issue 26): one and 16 clips end to end, peaks by clip length
#   llava    LLaVA-NeXT JPEG files to features against its tower (`mmenc bench --e2e`, issue 31)
#   qwen     the Qwen2.5-VL-7B tower, compiled + CUDA graphs, --profile, 8x1036px and 32x448px (issue 29's after)
#   clip     CLIP ViT-L/14-336 against its peers (benchmarks/clip_peers.py, issue 31)
# .gpu/ and OUTDIR's files stay on the host while it is warm, so parts can go over calls made back to back:
#   bash benchmarks/hosts/h200_check.sh OUTDIR setup tests workers llava     # one call
#   bash benchmarks/hosts/h200_check.sh OUTDIR video                         # the next
# The kernel bench of issue 27 is benchmarks/kernels_gpu.sh (a call of its own). A short table of each part last.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bash benchmarks/hosts/h200_check.sh OUTDIR PART...}
shift
mkdir -p "$out" .gpu/clips
export PYTHONPATH="$PWD:$PWD/.gpu/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
model=Qwen/Qwen2.5-VL-7B-Instruct
clips=.gpu/clips

wait_clips() {  # the background writers of part setup (or the clips of an earlier call)
  for _ in $(seq 300); do
    [ -e "$clips/done" ] && return 0
    sleep 1
  done
  echo "clips: not written after 300 s (see $clips/write.log)"; return 1
}

part() {  # part NAME TIMEOUT COMMAND...: the command's output to OUTDIR/NAME.log, its exit and wall time
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - start)) s" | tee -a "$out/parts.txt"
}

for p in "$@"; do
  case $p in
    setup)
      if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu/site .whl/*.whl
      fi
      if [ ! -e "$clips/done" ]; then
        (python3 -c "
import pathlib, concurrent.futures as cf
from mmenc.bench.video import write_bench_clip
with cf.ProcessPoolExecutor(2) as pool:
    list(pool.map(write_bench_clip, [pathlib.Path('$clips/bench-60s-1280x720.mp4'), pathlib.Path('$clips/bench-15s-1280x720.mp4')], [60, 15], [(720, 1280)] * 2))
" > "$clips/write.log" 2>&1 && touch "$clips/done") &
      fi ;;
    tests)
      part tests "${TESTS_LIMIT:-270}" python3 -m pytest -q -p no:cacheprovider -m gpu --durations=12 \
        --continue-on-collection-errors ${TESTS:-$(grep -l "mark.gpu" tests/*.py)} \
        -k "not (test_bf16_parity_with_transformers and not auto)" ;;
    firstcall)
      part firstcall 250 python3 benchmarks/compile_first_call.py --warmup 2 --iters 6 ;;
    workers)
      wait_clips && part workers 120 python3 benchmarks/video_workers.py "$clips/bench-60s-1280x720.mp4" \
        --workers ${WORKERS:-1 4 8 16} --reps 1 ;;
    video)
      wait_clips && part video 590 python3 -m mmenc bench --video --model $model --load-format dummy \
        --dtype bfloat16 --compile --cuda-graphs --warmup 1 --iters 2 --video-lengths 15,60 --video-dir $clips \
        --json "$out/video.json" ;;
    llava)
      part llava 200 python3 -m mmenc bench --model llava-hf/llava-v1.6-mistral-7b-hf --load-format dummy \
        --e2e --workload 32x448px --compile --cuda-graphs --json "$out/llava.json" ;;
    qwen)
      for w in 8x1036px 32x448px; do
        part "qwen_$w" 200 python3 -m mmenc bench --model $model --load-format dummy --workload $w --compile \
          --cuda-graphs --profile --warmup 2 --iters 6 --json "$out/qwen_$w.json"
      done ;;
    clip)
      part clip 150 python3 benchmarks/clip_peers.py --batches 32,256 --iters 10 --warmup 3 --json "$out/clip.json" ;;
    *) echo "unknown part $p (setup tests firstcall workers video llava qwen clip)"; exit 2 ;;
  esac
done
echo "== parts"; cat "$out/parts.txt"
for p in "$@"; do
  case $p in
    tests) echo "== tests"; tail -n 1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -n 20 ;;
    firstcall) echo "== firstcall"; grep '"mode"' "$out/firstcall.log" ;;
    workers) echo "== workers"; grep "workers=" "$out/workers.log" ;;
    video) echo "== video"; grep -v "INFO\|WARNING" "$out/video.log" | tail -n 25 ;;
    llava) echo "== llava"; grep -v "INFO\|WARNING" "$out/llava.log" | tail -n 15 ;;
    qwen) for w in 8x1036px 32x448px; do echo "== qwen $w"; grep -v "INFO\|WARNING" "$out/qwen_$w.log" | tail -n 14; done ;;
    clip) echo "== clip"; tail -n 15 "$out/clip.log" ;;
  esac
done
