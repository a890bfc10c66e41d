#!/usr/bin/env bash
# OPTIONAL helper: download FlashAttention-4 and its CuTe-DSL wheels (Python 3.12, x86-64) into .whl/
# (git-ignored) for a GPU machine without network; the 92 MB cu13 libs wheel is split into two halves for
# transfers limited to 64 MiB. On the GPU machine: `bash .whl/install_fa4.sh TARGET` (see that script).
set -euo pipefail
cd "$(dirname "$0")/../.."
tags=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
mkdir -p .whl/base .whl/extra .whl/split
python3 -m pip download --no-deps "${tags[@]}" -d .whl/base flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
  nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi==0.1.15.post2 \
  torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5
python3 -m pip download --no-deps "${tags[@]}" -d .whl/extra cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 \
  einops==0.8.2 protobuf==7.36.2
tmp=$(mktemp -d)
python3 -m pip download --no-deps "${tags[@]}" -d "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
name=$(basename "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl)
(cd "$tmp" && sha256sum "$name" > "$OLDPWD/.whl/split/$name.sha256")
split -b 45M "$tmp/$name" ".whl/split/$name.part-"
cp benchmarks/hosts/install_fa4.sh .whl/install_fa4.sh
ls -la .whl/base .whl/extra .whl/split
