#!/usr/bin/env bash
# The GPU acceptance run, about 9 minutes on one H200 (two GPUs: the rows of two ranks too,
# about 15), installing nothing from the network:
#   bash bench/gpu_acceptance.sh [--cpu-smoke] [--plan]
# bench/gpu_acceptance.py holds the checks and their bounds; this picks its interpreter:
# DEL_PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${DEL_PYTHON:-}" ] && [ -x .venv/bin/python ]; then DEL_PYTHON=.venv/bin/python; fi
exec "${DEL_PYTHON:-python3}" bench/gpu_acceptance.py "$@"
