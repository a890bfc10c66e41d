#!/usr/bin/env bash
# The vLLM interop suite: interop/vllm/run.sh [pytest args]. Makes the venv if needed (setup.sh; MMENC_VLLM_VENV
# picks its folder, default <repo>/.venv-vllm), then runs this folder's tests with the venv's python and
# this checkout's mmenc on PYTHONPATH. Not part of `python -m pytest` (tests/): it needs vLLM.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${MMENC_VLLM_VENV:-$repo/.venv-vllm}
"$here/setup.sh" "$venv"
cd "$repo"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest -q -p no:cacheprovider "$here" "$@"
