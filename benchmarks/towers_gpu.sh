#!/usr/bin/env bash
# Issues 15/16 on one H200: the new tower families compiled + CUDA graphs (and eager where never run),
# side by side with transformers in the same `mmenc bench` run, then the GPU parity tests of the new
# families, then one summary table. Not run by CI.
#   bash benchmarks/towers_gpu.sh OUTDIR          # from the repository root
# Env: PY (python, default python3), BUDGET_S (whole-script budget in seconds, default 450: every step gets
# `timeout min(its own limit, what is left)`; a step is skipped when under 2/3 of its limit is left),
# TF_SITE (a folder with a newer transformers put first on PYTHONPATH when it exists, default /tmp/site):
# transformers 5.17 has every tower class these runs use, but its PaddleOCR-VL interpolates the position
# table with align_corners=True (5.24: False, as mmenc): with 5.17 PaddleOCR-VL differs by ~2.5e-2 (fp32)
# and its parity rows fail, so install 5.24 there; WARMUP/ITERS (bench, default 2/6),
# LIMIT_SCALE (integer factor on every step's own limit, default 1: e.g. 2 where FA4 compiles its kernels
# on first use), TARBALL (a path: every log and JSON of OUTDIR packed there at the end, one file to fetch),
# ONLY (space-separated step names, e.g. "internvl_compiled parity_compiled": run just those; a step's
# name is its log's name in OUTDIR).
# Order is by value: the missed targets first (SigLIP2 NaFlex, GLM-OCR, Qwen3-Omni), the eager GPU parity
# tests and CUDA-graph capture tests of the new families, the never-run families (InternViT-6B, the slowest to load, last of them), Pixtral,
# the compiled parity tests, then eager runs of the never-run families. Expected: the first ten steps in
# ~7 min; what the budget cuts is listed as skipped and can be run with ONLY=... in a second call.
# A re-run of some steps, e.g. (~3 min):
#   ONLY="ovis2_compiled internvl_compiled" BUDGET_S=210 TARBALL=$OUT/towers.tgz bash benchmarks/towers_gpu.sh /tmp/t
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/towers_gpu.sh OUTDIR}
py=${PY:-python3}
budget=${BUDGET_S:-450}
warmup=${WARMUP:-2}
iters=${ITERS:-6}
site=${TF_SITE:-/tmp/site}
mkdir -p "$out"
: > "$out/steps.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$site" ] && export PYTHONPATH="$site:$PYTHONPATH"
start=$SECONDS
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
  transformers.__file__, 'cuda', torch.cuda.is_available())" | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$out/env.txt" 2>&1

# step NAME LIMIT_S CMD...: run with the smaller of LIMIT_S and the budget left; log to OUTDIR/NAME.log
step() {
  local name=$1 limit=$(( $2 * ${LIMIT_SCALE:-1} )); shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local left=$((budget - (SECONDS - start)))
  if [ $((3 * left)) -lt $((2 * limit)) ] || [ "$left" -lt 30 ]; then  # would likely be cut: leave it for ONLY=
    echo "$name: skipped (budget: ${left} s left, its limit ${limit} s)" | tee -a "$out/steps.txt"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$out/steps.txt"
  [ "$rc" -ne 0 ] && tail -n 4 "$out/$name.log"
}
# bench NAME LIMIT_S MODEL MODE(compiled|eager) WORKLOAD-ARGS...
bench() {
  local name=$1 limit=$2 model=$3 mode=$4; shift 4
  local flags=""
  [ "$mode" = compiled ] && flags="--compile --cuda-graphs"
  step "${name}_$mode" "$limit" $py -m mmenc.cli.main bench --model "$model" --load-format dummy --dtype bfloat16 $flags \
    --warmup "$warmup" --iters "$iters" --quiet --json "$out/${name}_$mode.json" "$@"
}

# 1. the missed targets, compiled + graphs
bench siglip2 90 google/siglip2-so400m-patch16-naflex compiled --workload naflex1024-mix-32 --workload naflex256-mix-32
bench glm_ocr 75 zai-org/GLM-OCR compiled --workload 8xpage-p14
bench qwen3_omni 75 Qwen/Qwen3-Omni-30B-A3B-Instruct compiled --workload 32x448px
# 2. bf16 parity of the new families against transformers' fp32, every usable backend, eager (fast) ...
new="siglip or pixtral or internvl or glm_ocr or paddleocr_vl or ernie4_5_vl or hunyuan_vl or qwen3_omni or llama4 or ovis2"
step parity_eager 120 $py -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_tower_parity.py -k "($new) and not compile"
# ... and every new family's packings captured as CUDA graphs, replays equal to the plain tower
step graphs 60 $py -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_graphs.py -k families_capture
# 3. never run on a GPU, compiled + graphs (largest published sizes), cheapest first
bench siglip 60 google/siglip-so400m-patch14-384 compiled --workload siglip-32x384px
bench paddleocr_vl 60 PaddlePaddle/PaddleOCR-VL compiled --workload 8xpage-p14
bench hunyuan_vl 60 tencent/HunyuanOCR compiled --workload 8xpage-p16
bench ernie4_5_vl 75 baidu/ERNIE-4.5-VL-424B-A47B-PT compiled --workload 8xpage-p14
bench llama4 75 meta-llama/Llama-4-Maverick-17B-128E-Instruct compiled --grid '13x24x24*8'
bench ovis2 75 thisisiron/Ovis2-8B-hf compiled --grid '7x32x32*8'
# InternViT-6B: ~0.9 s per call at 56 tiles of 1025 tokens, and transformers' random init of 5.7 B parameters
bench internvl 150 OpenGVLab/InternVL3-78B-hf compiled --grid '7x32x32*8' --warmup 1 --iters 4
bench pixtral 75 mistralai/Pixtral-Large-Instruct-2411 compiled --workload 8xmixed-aspect
# 4. ... and compiled (inductor, one compile per family)
step parity_compiled 150 $py -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_tower_parity.py -k "($new) and compile"
# 5. eager, for the families never run on a GPU (if the budget allows)
bench siglip 45 google/siglip-so400m-patch14-384 eager --workload siglip-32x384px
bench paddleocr_vl 45 PaddlePaddle/PaddleOCR-VL eager --workload 8xpage-p14
bench hunyuan_vl 45 tencent/HunyuanOCR eager --workload 8xpage-p16
bench ernie4_5_vl 45 baidu/ERNIE-4.5-VL-424B-A47B-PT eager --workload 8xpage-p14
bench llama4 45 meta-llama/Llama-4-Maverick-17B-128E-Instruct eager --grid '13x24x24*8'
bench ovis2 45 thisisiron/Ovis2-8B-hf eager --grid '7x32x32*8'
bench internvl 90 OpenGVLab/InternVL3-78B-hf eager --grid '7x32x32*8' --warmup 1 --iters 4
# 6. peak memory (issues 15/16): Ovis2 and InternViT-6B with their wide intermediates whole (row blocks off,
# --max-intermediate-bytes 0: the peak before mmenc.layers.row_blocks; the q/k norms' unstacked outputs stay),
# against ovis2_*/internvl_* above (on, the default). Only with ONLY=, e.g. the memory check in two calls (each under 600 s):
#   ONLY="ovis2_compiled ovis2_whole_compiled ovis2_eager ovis2_whole_eager" BUDGET_S=330 bash benchmarks/towers_gpu.sh OUT
#   ONLY="internvl_compiled internvl_whole_compiled internvl_eager" BUDGET_S=560 bash benchmarks/towers_gpu.sh OUT
if [ -n "${ONLY:-}" ]; then
  bench ovis2_whole 75 thisisiron/Ovis2-8B-hf compiled --grid '7x32x32*8' --max-intermediate-bytes 0
  bench ovis2_whole 45 thisisiron/Ovis2-8B-hf eager --grid '7x32x32*8' --max-intermediate-bytes 0
  bench internvl_whole 150 OpenGVLab/InternVL3-78B-hf compiled --grid '7x32x32*8' --warmup 1 --iters 4 \
    --max-intermediate-bytes 0
  bench internvl_whole 90 OpenGVLab/InternVL3-78B-hf eager --grid '7x32x32*8' --warmup 1 --iters 4 \
    --max-intermediate-bytes 0
  # 7. peak memory of GLM-OCR, HunyuanOCR and Pixtral-Large under the low 512 MiB row-block budget
  # (mmenc.layers.row_blocks.LOW_INTERMEDIATE_BYTES; docs/towers.md, "Graph pools under transformers' peak"), beside
  # the default 1.5 GiB rows above (the speed A/B in one session), plus Qwen2.5-VL-7B's two workloads both ways (its
  # MLP splits in 3 / 2 blocks under 512 MiB). Two calls, each under 600 s:
  #   ONLY="glm_ocr_compiled hunyuan_vl_compiled pixtral_compiled glm_ocr_b512_compiled hunyuan_vl_b512_compiled \
  #     pixtral_b512_compiled" BUDGET_S=560 bash benchmarks/towers_gpu.sh OUT
  #   ONLY="glm_ocr_b512_eager pixtral_b512_eager qwen25_compiled qwen25_b512_compiled" BUDGET_S=560 \
  #     bash benchmarks/towers_gpu.sh OUT2
  # and InternViT-6B (6 MLP blocks under 512 MiB instead of 2): ONLY="internvl_compiled internvl_b512_compiled"
  low=536870912
  bench glm_ocr_b512 75 zai-org/GLM-OCR compiled --workload 8xpage-p14 --max-intermediate-bytes $low
  bench hunyuan_vl_b512 60 tencent/HunyuanOCR compiled --workload 8xpage-p16 --max-intermediate-bytes $low
  bench pixtral_b512 75 mistralai/Pixtral-Large-Instruct-2411 compiled --workload 8xmixed-aspect \
    --max-intermediate-bytes $low
  bench glm_ocr_b512 45 zai-org/GLM-OCR eager --workload 8xpage-p14 --max-intermediate-bytes $low
  bench pixtral_b512 45 mistralai/Pixtral-Large-Instruct-2411 eager --workload 8xmixed-aspect --max-intermediate-bytes $low
  bench internvl_b512 150 OpenGVLab/InternVL3-78B-hf compiled --grid '7x32x32*8' --warmup 1 --iters 4 \
    --max-intermediate-bytes $low
  bench qwen25 90 Qwen/Qwen2.5-VL-7B-Instruct compiled --workload 8x1036px --workload 32x448px
  bench qwen25_b512 90 Qwen/Qwen2.5-VL-7B-Instruct compiled --workload 8x1036px --workload 32x448px \
    --max-intermediate-bytes $low
fi

for f in "$out"/parity_*.log "$out"/graphs.log; do [ -f "$f" ] && { echo "$(basename "$f"):"; grep -E "passed|failed|error|skipped" "$f" | tail -n 12; }; done
echo "total $((SECONDS - start)) s"
cat "$out/steps.txt"
if [ -n "${TARBALL:-}" ]; then tar czf "$TARBALL" -C "$out" . && echo "logs and JSON: $TARBALL"; fi
$py - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
print(f"{'model':<46} {'workload':<18} {'mode':<8} {'mmenc ms':>9} {'HF ms':>9} {'ratio':>6} {'peak GiB mmenc/HF':>18} "
      f"{'rel err':>8} {'floor %':>7}  mmenc attention")
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    doc = json.load(open(path))
    mode = path.rsplit("_", 1)[-1].removesuffix(".json")
    errs = {w["workload"]: w.get("rel_err_vs_transformers") for w in doc["workloads"]}
    for workload in dict.fromkeys(r["workload"] for r in doc["rows"]):
        rows = [r for r in doc["rows"] if r["workload"] == workload]
        ours = next((r for r in rows if r["impl"].startswith("mmenc")), None)
        hf = next((r for r in rows if r["impl"].startswith("transformers")), None)
        if ours is None:
            continue
        # a CUDA-graph replay allocates nothing: its working memory is the graph pool (mmenc.bench.measure)
        peak = lambda r: "-" if not r or r.get("peak_gib") is None else f"{r['peak_gib'] + (r.get('graph_pool_gib') or 0) * ('+graphs' in r['impl']):.2f}"
        ratio = f"{hf['ms'] / ours['ms']:.2f}x" if hf else "-"
        err = f"{errs[workload]:.1e}" if errs.get(workload) is not None else "-"
        rate = doc.get("matmul_tflops")
        floor = f"{100 * ours['gflop'] / rate / ours['ms']:.0f}" if rate and ours.get("gflop") else "-"
        backend = ours["impl"].partition("(")[2][:-1]
        print(f"{doc['model']:<46} {workload:<18} {mode:<8} {ours['ms']:>9.2f} {hf['ms'] if hf else float('nan'):>9.2f} "
              f"{ratio:>6} {peak(ours) + ' / ' + peak(hf):>18} {err:>8} {floor:>7}  {backend}")
PY
