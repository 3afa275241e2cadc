#!/usr/bin/env bash
# The second test environment, .venv312: the newest megatron-core pyproject.toml allows
# (0.17 and later need Python 3.12) and Megatron-Bridge, for the tests marked `megatron`
# (the model, the loss hook, the Megatron-LM and Megatron-Bridge adapters), which
# launch/test.sh runs there as well as in .venv (megatron-core 0.16 on Python 3.11).
# Exit 0 when ready; 3 when no Python 3.12 is found (launch/test.sh then skips those tests and
# says so, unless DEL_REQUIRE_PY312=1, as CI sets). PYTHON312 names the interpreter. Safe to
# re-run: launch/setup_env.sh makes it (the project with its `newest` extra: pytest and what
# Bridge's modules import, its transformers pin among them), then Bridge itself.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV312:-.venv312}
# Megatron-Bridge's release tested here, installed without its dependencies (they include
# CUDA-only packages); transformer_engine, modelopt and nvidia-resiliency-ext stay absent
# (tests/gpu_only_stubs.py)
BRIDGE=0.6.2

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
PYTHON=$python312 VENV=$VENV SPEC=".[newest]" bash launch/setup_env.sh
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys
sys.exit(m.version('megatron-bridge') != '$BRIDGE')" 2>/dev/null; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "megatron-bridge==$BRIDGE"
fi
