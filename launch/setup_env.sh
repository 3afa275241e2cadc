#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv with everything the project
# and its tests need. Safe to re-run: when pyproject.toml has not changed since the last
# install, nothing is reinstalled.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
SPEC=${SPEC:-.[test]}  # what is installed, editable (launch/setup_env_newest.sh: .[newest])
stamp=$VENV/.del-megatron-installed
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)

if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

pip_install --upgrade pip
# Without a GPU, pin the CPU build of torch first: the project's own range would otherwise
# pull a multi-GB CUDA build. GPU machines take torch from the range (or bring their own).
if ! command -v nvidia-smi >/dev/null 2>&1; then
  pip_install "torch==2.13.0"
fi
# setuptools' notice about editable installs is for package authors, not for this script
PYTHONWARNINGS=ignore pip_install -e "$SPEC"
echo "$wanted" >"$stamp"
echo "environment ready: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
