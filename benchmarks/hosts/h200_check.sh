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
#   servedeps  mmenc serve's extra (fastapi, uvicorn, pydantic, ...) from .whl/inf and .whl/serve into .gpu/serve_site
#   infinity Infinity 0.0.78 and its packages (transformers 4.57) from .whl/inf (carried) into .gpu/inf_site,
#            run through .gpu/inf_bin/infinity_emb (its own PYTHONPATH: the host's transformers stays 5.x)
#   embeddings  POST /v1/embeddings, mmenc serve against Infinity and mmenc offline (benchmarks/embeddings_load.py,
#            a random SigLIP so400m/384 in bf16, 64 clients x 4 images, 1,024 JPEGs; issue 31)
#   serve_variants  mmenc serve alone on /v1/embeddings (as embeddings) with 4 and 1 front ends, 4 preprocessing workers,
#            each server's CPU time by process
#   kpad     the MLP's bf16 GEMMs with the 3420-wide dimension padded (benchmarks/kernels_check.py kpad)
#   eager    the Qwen tower eager, 8x1036px, on the ALIGNED and NATIVE linear backends
#   cache    one fresh Inductor cache: a video-sized compile first, then 8x1036px compiled on NATIVE and ALIGNED
#   fa4      FlashAttention-4 from .whl (base/, extra/, split/ halves: carried over two calls) into .gpu/fa4;
#            every later part (and call) runs with it on PYTHONPATH
# .gpu/ and OUTDIR's files stay on the host while it is warm, so parts can go over calls made back to back:
#   bash benchmarks/hosts/h200_check.sh OUTDIR setup tests workers llava     # one call
#   bash benchmarks/hosts/h200_check.sh OUTDIR video                         # the next
# The kernel bench of issue 27 is benchmarks/kernels_gpu.sh (a call of its own). A short table of each part last.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bash benchmarks/hosts/h200_check.sh OUTDIR PART...}
shift
mkdir -p "$out" .gpu/clips
export PYTHONPATH="$PWD:$PWD/.gpu/site:$PWD/.gpu/serve_site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
fa4_path() { export PYTHONPATH="$PYTHONPATH:$PWD/.gpu/fa4:$PWD/.gpu/fa4/nvidia_cutlass_dsl/dsl_packages"; }
[ -e .gpu/fa4/done ] && fa4_path
model=Qwen/Qwen2.5-VL-7B-Instruct
clips=.gpu/clips

wait_clips() {  # the background writers of part setup (or the clips of an earlier call)
  for _ in $(seq 300); do
    [ -e "$clips/done" ] && return 0
    sleep 1
  done
  echo "clips: not written after 300 s (see $clips/write.log)"; return 1
}

load_args() {  # sets load=(...): benchmarks/embeddings_load.py on the SigLIP so400m/384 below (written by the first
  # run) under issue 31's load (64 clients x 4 images, 1,024 JPEGs), mmenc serve in bf16, compiled + CUDA graphs
  local ckpt=.gpu/siglip-so400m-384
  load=(benchmarks/embeddings_load.py --checkpoint "$ckpt" --device cuda --clients 64 --per-request 4 --images 1024
        --size 640x480 --serve-arg=--dtype=bfloat16 --serve-arg=--compile --serve-arg=--cuda-graphs)
  [ -e "$ckpt/config.json" ] || load+=(--write-checkpoint "$ckpt" --preset so400m-384 --checkpoint-dtype bfloat16)
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
    servedeps)  # mmenc serve's extra (fastapi, uvicorn, ...) from .whl/inf and .whl/serve, not the host's
      # transformers, huggingface_hub, tokenizers or pillow (those .whl/inf holds are Infinity's)
      wheels=$(ls .whl/inf/*.whl .whl/serve/*.whl | grep -v -E "/(transformers|huggingface_hub|hf_xet|tokenizers|\
safetensors|pillow|regex|PyYAML|pyyaml|tqdm|requests|urllib3|certifi|idna|charset_normalizer|packaging|infinity_emb)-")
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu/serve_site \
        $wheels 2>&1 | grep -v "already exists"
      python3 -c "import uvicorn, fastapi, pydantic, multipart, pybase64, mmenc.serving.app" \
        && echo "servedeps: ok" | tee -a "$out/parts.txt" ;;
    infinity)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu/inf_site \
        .whl/inf/*.whl
      mkdir -p .gpu/inf_bin
      printf '#!/usr/bin/env bash\nPYTHONPATH=%s exec python3 -c "from infinity_emb.cli import cli; cli()" "$@"\n' \
        "$PWD/.gpu/inf_site" > .gpu/inf_bin/infinity_emb
      chmod +x .gpu/inf_bin/infinity_emb
      .gpu/inf_bin/infinity_emb --help > "$out/infinity.log" 2>&1
      echo "infinity: exit $? (infinity_emb --help)" | tee -a "$out/parts.txt" ;;
    embeddings)
      load_args
      part embeddings 480 python3 "${load[@]}" --targets "${TARGETS:-mmenc,infinity}" --offline \
        --offline-kwargs '{"dtype": "bfloat16", "compile": true, "cuda_graphs": true}' --serve-arg=--frontends=4 \
        --infinity-bin .gpu/inf_bin/infinity_emb --infinity-arg=--dtype=bfloat16 --json "$out/embeddings.json"
      cp /tmp/embeddings_load_*.log "$out/" 2>/dev/null ;;
    serve_variants)  # mmenc serve alone on /v1/embeddings, by front ends and preprocessing threads
      for v in "frontends=4" "frontends=1" "frontends=4 preprocess-threads=4"; do
        name=serve_${v// /_}; name=${name//=/}
        flags=(); for f in $v; do flags+=("--serve-arg=--${f%%=*}=${f#*=}"); done
        load_args
        part "$name" 200 python3 "${load[@]}" --targets mmenc "${flags[@]}" --json "$out/$name.json"
        cp /tmp/embeddings_load_mmenc_0.log "$out/$name.server.log" 2>/dev/null
      done ;;
    kpad)
      part kpad 120 python3 benchmarks/kernels_check.py kpad ;;
    eager)
      for b in aligned native; do
        part "eager_$b" 150 python3 -m mmenc bench --model $model --load-format dummy --workload 8x1036px --no-hf \
          --linear-backend $b --profile --warmup 2 --iters 6 --json "$out/eager_$b.json"
      done ;;
    cache)
      rm -rf .gpu/inductor-cache
      export TORCHINDUCTOR_CACHE_DIR=$PWD/.gpu/inductor-cache
      part cache_video 200 python3 -m mmenc bench --model $model --load-format dummy --grid '5x40x72*2' --no-hf \
        --linear-backend native --compile --warmup 1 --iters 2
      for b in native aligned; do
        part "cache_$b" 200 python3 -m mmenc bench --model $model --load-format dummy --workload 8x1036px --no-hf \
          --linear-backend $b --compile --cuda-graphs --profile --warmup 2 --iters 6 --json "$out/cache_$b.json"
      done
      unset TORCHINDUCTOR_CACHE_DIR ;;
    fa4)
      if [ ! -e .gpu/fa4/done ]; then
        bash benchmarks/hosts/install_fa4.sh .gpu/fa4 .whl > "$out/fa4.log" 2>&1 && touch .gpu/fa4/done
        echo "fa4: $(tail -n 1 "$out/fa4.log")" | tee -a "$out/parts.txt"
      fi
      [ -e .gpu/fa4/done ] && fa4_path ;;
    *) echo "unknown part $p (setup tests firstcall workers video llava qwen clip servedeps infinity embeddings serve_variants kpad eager cache fa4)"
       exit 2 ;;
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
    embeddings) echo "== embeddings"; grep -v "INFO\|WARNING" "$out/embeddings.log" | tail -n 12 ;;
    kpad) echo "== kpad"; cat "$out/kpad.log" ;;
    serve_variants) for f in "$out"/serve_*.log; do case $f in *.server.log) continue ;; esac
      echo "== $f"; grep -v "INFO\|WARNING" "$f" | tail -n 12 | cut -c1-250; done ;;
    eager) for b in aligned native; do echo "== eager $b"; grep -v "INFO\|WARNING" "$out/eager_$b.log" | tail -n 6; done ;;
    cache) for b in video native aligned; do echo "== cache $b"; grep -v "INFO\|WARNING" "$out/cache_$b.log" | tail -n 6; done ;;
  esac
done
