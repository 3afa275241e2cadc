#!/usr/bin/env bash
# The GPU acceptance run: every check through the user's own commands, on whatever GPUs the
# machine has, about 8 minutes on one H200, installing nothing from the network.
#
#   bash bench/gpu_acceptance.sh [--cpu-smoke] [--plan]
#
# The checks, their bounds and the output are bench/gpu_acceptance.py's (see its docstring);
# this script only picks the interpreter: DEL_PYTHON, else .venv/bin/python, else python3.
# Environment: OUT (results: gpu_acceptance.json and logs/), DEL_SITE (where the wheels of
# .whl/ go when the interpreter lacks a package; default /tmp/del-site-pyX.Y).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${DEL_PYTHON:-}" ]; then
  python=$DEL_PYTHON
elif [ -x .venv/bin/python ]; then
  python=.venv/bin/python
else
  python=python3
fi
exec "$python" bench/gpu_acceptance.py "$@"
