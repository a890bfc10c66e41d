#!/usr/bin/env bash
# One call on the lent GPU machine runs the stages named as arguments, logging under $OUT:
#   fa4-part1   park the first half of the split FA4 libs wheel in /tmp/fa4 (call 1 of 2, carry .whl/split/*.part-aa)
#   fa4         finish the FA4 install into /tmp/site (carry .whl/base .whl/extra .whl/split/*.part-ab ...)
#   tests       pytest -m "gpu or multigpu" (every GPU test) + the CPU suite's tower parity on GPU
#   attn        benchmarks/attention_bench.py (every usable backend, both packs, 4 head sizes)
#   sweep       TRITON_ATTN config sweep
#   towers      mmenc bench (Qwen2.5-VL-7B, both workloads) vs transformers, per backend
#   families    mmenc bench for the other families' largest towers
#   multigpu    benchmarks/multigpu_bench.py (1 GPU vs 2 GPUs, data and weights modes)
#   parity      full-size bf16 towers vs transformers fp32 (benchmarks/parity_fp32.py)
#   fa4-cost    FA4's first-use compile time per shape class (benchmarks/fa4_first_use.py)
#   towers-nofa4  mmenc bench --compile with FA4 hidden (what a machine without FA4 gets), Qwen2.5-VL and Kimi
#   newtests    the GPU tests of the worker group (2 GPUs, CUDA IPC) and of CUDA graphs
#   multigpu-compile  benchmarks/multigpu_bench.py --compile
#   towers-graphs     mmenc bench --compile --cuda-graphs (Qwen2.5-VL-7B, both workloads) vs transformers
#   multigpu-staging  the 2-GPU tests, then the compiled multi-GPU bench comparing pinned and device staging
#   glm-compile       mmenc bench --compile for GLM-4.1V vs transformers
# Every stage tees its full output under $OUT, so a call that hits its limit still returns its logs.
# Example: bash benchmarks/gpu_session.sh fa4 tests attn
set -u
OUT=${OUT:-/tmp/mmenc-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d /tmp/site/flash_attn ]; then
  export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
fi
MMENC="python3 -m mmenc.cli.main"
stamp() { echo "== $(date +%T) $*"; }

for stage in "$@"; do
  stamp "stage $stage"
  case "$stage" in
    fa4-part1)
      mkdir -p /tmp/fa4 && cp .whl/split/*.part-aa /tmp/fa4/ && ls -la /tmp/fa4 ;;
    fa4)
      cp /tmp/fa4/*.part-aa .whl/split/ 2>/dev/null
      bash .whl/install_fa4.sh > "$OUT/fa4_install.log" 2>&1; tail -2 "$OUT/fa4_install.log"
      export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages" ;;
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
      $MMENC backends --head-size 80 --dtype bfloat16; $MMENC backends --head-size 72 --dtype bfloat16 | tail -3 ;;
    tests)
      timeout 420 python3 -m pytest -q -x -p no:cacheprovider -m "gpu or multigpu" tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    attn)
      timeout 200 python3 benchmarks/attention_bench.py --out "$OUT/attn.json" 2>&1 | tee "$OUT/attn.log" | grep -v "UserWarn\|exe_args" | tail -45 ;;
    sweep)
      timeout 300 python3 benchmarks/attention_bench.py --sweep-only --out "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log" | tail -40 ;;
    towers)
      timeout 150 $MMENC bench --json "$OUT/bench_qwen25_auto.json" 2>&1 | tee "$OUT/bench_qwen25_auto.log" | tail -6
      timeout 200 $MMENC bench --compile --no-hf --json "$OUT/bench_qwen25_compile.json" 2>&1 | tee "$OUT/bench_qwen25_compile.log" | tail -4
      timeout 100 $MMENC bench --no-hf --mm-encoder-attn-backend FLASH_ATTN --json "$OUT/bench_qwen25_fa.json" 2>&1 | tail -4 ;;
    tower-tests)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_tower_parity.py 2>&1 | tee "$OUT/gpu_tower_tests.log" | grep -E "passed|failed|Error|FAILED" | tail -15 ;;
    families)
      for m in Qwen/Qwen2-VL-72B-Instruct Qwen/Qwen3-VL-235B-A22B-Instruct zai-org/GLM-4.1V-9B-Thinking moonshotai/Kimi-K2.5; do
        f=$(echo "$m" | tr '/' '_')
        timeout 120 $MMENC bench --model "$m" --json "$OUT/bench_$f.json" 2>&1 | tee "$OUT/bench_$f.log" | tail -6
        timeout 150 $MMENC bench --model "$m" --compile --no-hf --json "$OUT/bench_${f}_compile.json" 2>&1 | tail -3
      done ;;
    parity)
      timeout 240 python3 benchmarks/parity_fp32.py --compile 2>&1 | tee "$OUT/parity.log" | grep -v "^INFO\|^WARN\|UserWarn\|exe_args\|^  " | tail -8 ;;
    fa4-cost)
      timeout 240 python3 benchmarks/fa4_first_use.py --json "$OUT/fa4_cost.json" 2>&1 | tee "$OUT/fa4_cost.log" | grep -v "UserWarn\|exe_args\|^  " | tail -10 ;;
    towers-nofa4)
      nofa=$(echo "$PYTHONPATH" | tr ':' '\n' | grep -v '^/tmp/site' | paste -sd: -)
      PYTHONPATH="$nofa" timeout 200 $MMENC bench --compile --json "$OUT/bench_qwen25_nofa4.json" 2>&1 | tee "$OUT/bench_qwen25_nofa4.log" | grep -v "^INFO\|^WARN\|UserWarn\|exe_args\|^  " | tail -8
      PYTHONPATH="$nofa" timeout 200 python3 benchmarks/kimi_vs_transformers.py --compile --json "$OUT/kimi_nofa4.json" 2>&1 | tee "$OUT/kimi_nofa4.log" | grep -v "^INFO\|^WARN" | tail -8 ;;
    families-compile)
      for m in Qwen/Qwen3-VL-235B-A22B-Instruct zai-org/GLM-4.1V-9B-Thinking Qwen/Qwen2-VL-72B-Instruct; do
        f=$(echo "$m" | tr '/' '_')
        timeout 100 $MMENC bench --model "$m" --compile --iters 5 --json "$OUT/bench_${f}_compile.json" 2>&1 | tee "$OUT/bench_${f}_compile.log" | grep -v "^INFO\|^WARN\|UserWarn\|exe_args\|^  " | tail -6
      done ;;
    kimi)
      timeout 150 python3 benchmarks/kimi_vs_transformers.py --json "$OUT/kimi.json" 2>&1 | grep -v "^INFO\|^WARN" | tail -8 ;;
    kimi-compile)
      timeout 200 python3 benchmarks/kimi_vs_transformers.py --compile --json "$OUT/kimi_compile.json" 2>&1 | grep -v "^INFO\|^WARN" | tail -8 ;;
    towers-compile)
      timeout 240 $MMENC bench --compile --json "$OUT/bench_qwen25_compile.json" 2>&1 | tee "$OUT/bench_qwen25_compile.log" | grep -v "^INFO\|^WARN\|UserWarn\|exe_args" | tail -9 ;;
    triton-tests)
      timeout 240 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_triton_attn.py 2>&1 | tee "$OUT/triton_tests.log" | tail -6 ;;
    multigpu)
      timeout 300 python3 benchmarks/multigpu_bench.py --staging pinned,device --out "$OUT/multigpu.json" 2>&1 | tee "$OUT/multigpu.log" | tail -20 ;;
    newtests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" tests/test_multigpu.py tests/test_cuda_graphs.py 2>&1 | tee "$OUT/newtests.log" | grep -v "UserWarn\|exe_args" | tail -25 ;;
    multigpu-staging)
      timeout 100 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/test_multigpu.py 2>&1 | tee "$OUT/multigpu_tests.log" | tail -3
      timeout 250 python3 benchmarks/multigpu_bench.py --compile --warmup 3 --budget-s 230 --staging pinned,device --out "$OUT/multigpu_staging.json" 2>&1 | tee "$OUT/multigpu_staging.log" | grep -v "^INFO\|^WARN\|UserWarn\|exe_args" | tail -24 ;;
    multigpu-compile)
      timeout 280 python3 benchmarks/multigpu_bench.py --compile --warmup 3 --budget-s 260 --staging pinned,device --out "$OUT/multigpu_compile.json" 2>&1 | tee "$OUT/multigpu_compile.log" | grep -v "^INFO\|^WARN\|UserWarn\|exe_args" | tail -16 ;;
    towers-graphs)
      timeout 200 $MMENC bench --compile --cuda-graphs --json "$OUT/bench_qwen25_graphs.json" 2>&1 | tee "$OUT/bench_qwen25_graphs.log" | grep -v "^INFO\|^WARN\|UserWarn\|exe_args\|^  " | tail -9 ;;
    glm-compile)
      timeout 120 $MMENC bench --model zai-org/GLM-4.1V-9B-Thinking --compile --json "$OUT/bench_glm_compile.json" 2>&1 | tee "$OUT/bench_glm_compile.log" | grep -v "^INFO\|^WARN\|UserWarn\|exe_args\|^  " | tail -6 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
stamp done
