#!/usr/bin/env bash
# OPTIONAL helper: download ray[serve,data] 2.60.0 and every wheel it (and `mmenc serve`) needs for
# CPython 3.12 on x86-64 Linux into .whl/ray/ (git-ignored), for a GPU machine without network. Left out:
# torch, numpy, pyarrow, pandas (large; the machine has them; ray needs pyarrow>=17, pandas>=2.2.3). The
# small ones the machine may already have (aiohttp, grpcio, protobuf, ...) are carried anyway, because
# ray 2.60's floors are recent (aiohttp>=3.14.4, grpcio-reflection -> grpcio>=1.85.1, protobuf>=7.35.1):
# install_ray.sh installs every carried wheel with --no-deps into a folder for PYTHONPATH. Wheels over 45 MB (ray, 79 MB)
# are split in parts for transfers limited to 64 MiB. On the GPU machine: `bash .whl/ray/install_ray.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
tags=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
      --platform manylinux1_x86_64)
out=.whl/ray
mkdir -p "$out/wheels" "$out/split"
report=$(mktemp)
python3 -m pip install -q --dry-run --ignore-installed --report "$report" --target "$(mktemp -d)" "${tags[@]}" \
  "ray[serve,data]==2.60.0" "fastapi>=0.133" "uvicorn[standard]>=0.29" "prometheus_client>=0.20" "python-multipart>=0.0.9"
python3 - "$report" > "$out/requirements.txt" <<'PY'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if name.lower() not in ("torch", "numpy", "pyarrow", "pandas"):  # large; the machine has recent ones
        print(f"{name}=={version}")
PY
python3 -m pip download -q --no-deps "${tags[@]}" -d "$out/wheels" -r "$out/requirements.txt"
for whl in "$out"/wheels/*.whl; do
  if [ "$(stat -c %s "$whl")" -gt $((45 * 1024 * 1024)) ]; then
    name=$(basename "$whl")
    (cd "$out/wheels" && sha256sum "$name" > "../split/$name.sha256")
    split -b 45M "$whl" "$out/split/$name.part-"
    rm "$whl"
  fi
done
cp benchmarks/hosts/install_ray.sh "$out/install_ray.sh"
du -sh "$out"; ls "$out/split"; wc -l "$out/requirements.txt"
