#!/usr/bin/env bash
# The test command: set up .venv, lint, run the whole suite (slow multi-process tests too).
# Extra arguments go to pytest, e.g. `bash launch/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."

bash launch/setup_env.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
