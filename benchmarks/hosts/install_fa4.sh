#!/usr/bin/env bash
# OPTIONAL helper for machines without network: install FlashAttention-4 (flash-attn-4 4.0.0b36 +
# nvidia-cutlass-dsl 4.8.1, cu13) offline into TARGET (default ./fa4-site) from the wheels that
# fetch_fa4_wheels.sh put in WHEELS (default: the folder this script is in, e.g. .whl/).
# With network, `pip install flash-attn-4` is all you need. Needs, under WHEELS: base/, split/*.part-aa,
# split/*.part-ab, split/*.sha256 (and extra/ for the packages the machine may lack). Then:
#   export PYTHONPATH=TARGET:TARGET/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
# Usage: bash install_fa4.sh [TARGET] [WHEELS]
set -euo pipefail
target="$(realpath -m "${1:-fa4-site}")"
here="$(cd "${2:-$(dirname "$0")}" && pwd)"
name=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
tmp=$(mktemp -d)
for part in part-aa part-ab; do
  [ -f "$here/split/$name.$part" ] || { echo "missing .whl/split/$name.$part (carry it)"; exit 1; }
done
cat "$here/split/$name.part-aa" "$here/split/$name.part-ab" > "$tmp/$name"
(cd "$tmp" && sha256sum -c "$here/split/$name.sha256")
wheels=("$here"/base/*.whl "$tmp/$name")
# Only the extras this Python lacks (a --target copy would shadow the machine's own versions).
python3 -c "import cuda.bindings" 2>/dev/null || wheels+=("$here"/extra/cuda_bindings-*.whl "$here"/extra/cuda_pathfinder-*.whl)
python3 -c "import einops" 2>/dev/null || wheels+=("$here"/extra/einops-*.whl)
python3 -c "import google.protobuf" 2>/dev/null || wheels+=("$here"/extra/protobuf-*.whl)
python3 -m pip install --no-deps --no-index --target "$target" "${wheels[@]}"
PYTHONPATH="$target:$target/nvidia_cutlass_dsl/dsl_packages" python3 -c \
  "import flash_attn.cute as f, importlib.metadata as m; print('flash_attn.cute OK, flash-attn-4', m.version('flash-attn-4'))"
