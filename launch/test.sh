#!/usr/bin/env bash
# The test command: set up .venv, lint (Python, shell scripts, the Dockerfile), run the whole
# suite (slow multi-process tests too). Extra arguments go to pytest, e.g.
# `bash launch/test.sh -m "not slow"`. The SLURM launch tests run when a test cluster answers
# (bash tests/slurm/cluster.sh start; CI starts one) and are skipped otherwise; the container
# tests likewise when a Docker engine answers (bash tests/docker/engine.sh prepare; CI too).
set -euo pipefail
cd "$(dirname "$0")/.."

bash launch/setup_env.sh
.venv/bin/ruff check .
.venv/bin/shellcheck launch/*.sh launch/experiments/*.sh launch/slurm/train.sbatch docker/entrypoint.sh \
  tests/slurm/cluster.sh .ci/run bench/gpu_acceptance.sh bench/fetch_gpu_wheels.sh \
  docker/pip-install.sh tests/docker/engine.sh
.venv/bin/hadolint docker/Dockerfile tests/docker/standin.Dockerfile
.venv/bin/python -m pytest "$@"
