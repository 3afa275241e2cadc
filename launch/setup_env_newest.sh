#!/usr/bin/env bash
# The second test environment, .venv312: the newest megatron-core pyproject.toml allows
# (0.17 and later need Python 3.12) and Megatron-Bridge, for the tests marked `megatron`
# (the model, the loss hook, the Megatron-LM and Megatron-Bridge adapters), which
# launch/test.sh runs there as well as in .venv (megatron-core 0.16 on Python 3.11).
# Exit 0 when ready; 3 when no Python 3.12 is found (launch/test.sh then skips those tests and
# says so, unless DEL_REQUIRE_PY312=1, as CI sets). PYTHON312 names the interpreter. Safe to
# re-run: nothing is reinstalled when pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV312:-.venv312}
# Megatron-Bridge's release tested here; installed without its dependencies (they include
# CUDA-only packages), with the ones its training and model modules import (its own pin of
# transformers among them); transformer_engine and modelopt stay absent (tests/gpu_only_stubs.py)
BRIDGE=megatron-bridge==0.6.2
BRIDGE_IMPORTS=("transformers>=5.8,<=5.12.1" omegaconf hydra-core einops rich accelerate datasets
  megatron-energon tensorboard diffusers)

find_python312() {
  local candidate
  for candidate in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
    "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    # pyenv's shim for python3.12 exists even where 3.12 is not selected: run each candidate
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
      >/dev/null 2>&1; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

if ! python312=$(find_python312); then
  echo "no Python 3.12 found (set PYTHON312=/path/to/python3.12): the newest megatron-core is not tested" >&2
  exit 3
fi
stamp=$VENV/.del-megatron-installed
wanted=$(cat pyproject.toml "$0" | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$python312" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

pip_install --upgrade pip
# torch first, pinned as setup_env.sh does (on Python 3.12 the registry's build is the CUDA
# one; it runs on the CPU all the same)
if ! command -v nvidia-smi >/dev/null 2>&1; then
  pip_install "torch==2.13.0"
fi
PYTHONWARNINGS=ignore pip_install -e . "pytest>=8" "hypothesis>=6.100" "psutil>=5.9"
pip_install --no-deps "$BRIDGE"
pip_install "${BRIDGE_IMPORTS[@]}"
echo "$wanted" >"$stamp"
echo "environment ready: $VENV ($("$VENV/bin/python" -c 'from megatron.core import __version__ as v; print("megatron-core", v)'))"
