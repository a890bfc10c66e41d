#!/usr/bin/env bash
# OPTIONAL helper for machines without network: install ray[serve,data] 2.60.0 (+ what `mmenc serve`
# needs) offline from the wheels fetch_ray_wheels.sh put beside this script, into DIR (default ./.ray-site),
# a folder to put first on PYTHONPATH. Every carried wheel is installed with --no-deps: the set is the
# resolved one minus torch, numpy, pyarrow and pandas, which the machine's Python already has. (A venv with
# --system-site-packages does not work where that Python is itself a venv, as on the lent GPU machine: the
# new venv sees the system interpreter's packages, not numpy and torch; seen in run 9b.)
# Usage: bash install_ray.sh [DIR] ; then PYTHONPATH=DIR python3 ... (benchmarks/ray_h200.sh: PY=python3).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
site="$(realpath -m "${1:-.ray-site}")"
tmp=$(mktemp -d)
cp "$here"/wheels/*.whl "$tmp"/
for sum in "$here"/split/*.sha256; do
  [ -e "$sum" ] || continue
  name=$(basename "$sum" .sha256)
  cat "$here/split/$name".part-* > "$tmp/$name"
  (cd "$tmp" && sha256sum -c "$sum")
done
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$tmp"/*.whl
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
  "import ray, ray.serve, ray.data, fastapi, torch; print('ray', ray.__version__, '| torch', torch.__version__)"
echo "installed into $site: run with PYTHONPATH=$site"
