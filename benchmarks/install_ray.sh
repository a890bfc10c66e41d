#!/usr/bin/env bash
# OPTIONAL helper for machines without network: install ray[serve,data] 2.60.0 (+ what `mmenc serve`
# needs) offline from the wheels fetch_ray_wheels.sh put beside this script, into VENV (default
# ./.ray-venv), a virtualenv that sees the machine's own packages (--system-site-packages): pip installs
# only the requirements the machine's Python 3.12 lacks or has too old, never a second torch.
# Usage: bash install_ray.sh [VENV] ; then run the benchmarks with VENV/bin/python.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$(realpath -m "${1:-.ray-venv}")"
tmp=$(mktemp -d)
cp "$here"/wheels/*.whl "$tmp"/
for sum in "$here"/split/*.sha256; do
  [ -e "$sum" ] || continue
  name=$(basename "$sum" .sha256)
  cat "$here/split/$name".part-* > "$tmp/$name"
  (cd "$tmp" && sha256sum -c "$sum")
done
python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --no-index --find-links "$tmp" "ray[serve,data]==2.60.0" "fastapi>=0.133" \
  "uvicorn[standard]>=0.29" "prometheus_client>=0.20" "python-multipart>=0.0.9"
"$venv/bin/python" -c "import ray, ray.serve, ray.data, torch; print('ray', ray.__version__, '| torch', torch.__version__)"
