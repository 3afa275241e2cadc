#!/usr/bin/env bash
# The test command: set up .venv, lint (Python, shell scripts, the Dockerfile), run the whole
# suite (slow multi-process tests too; on DEL_TEST_WORKERS=2 pytest workers). Extra arguments go to pytest, e.g.
# `bash launch/test.sh -m "not slow"`. The SLURM launch tests run when a test cluster answers
# (bash tests/slurm/cluster.sh start; CI starts one), beside the rest of a whole-suite run,
# and are skipped otherwise; the container
# tests likewise when a Docker engine answers (bash tests/docker/engine.sh prepare; CI too). Then the tests
# marked `megatron` (models, loss hook, Megatron-LM and Megatron-Bridge) run again on the newest
# megatron-core, in .venv312 (launch/setup_env_newest.sh; skipped, saying so, where there is no
# Python 3.12, unless DEL_REQUIRE_PY312=1, as CI sets).
set -euo pipefail
cd "$(dirname "$0")/.."

bash launch/setup_env.sh
# the newest megatron-core's environment is mostly a download (torch's CUDA build on Python
# 3.12): made in the background, beside the lint and the first run of the suite
newest_log=$(mktemp)
setsid bash launch/setup_env_newest.sh >"$newest_log" 2>&1 &
newest_pid=$!  # its own process group: a failed lint or suite stops it, pip included
slurm_log=$(mktemp)
slurm_pid=""
trap 'kill -- -"$newest_pid" ${slurm_pid:+-"$slurm_pid"} 2>/dev/null || true; rm -f "$newest_log" "$slurm_log"' EXIT
.venv/bin/ruff check .
.venv/bin/shellcheck launch/*.sh launch/experiments/*.sh launch/slurm/train.sbatch docker/entrypoint.sh \
  tests/slurm/cluster.sh .ci/run bench/gpu_acceptance.sh bench/fetch_gpu_wheels.sh \
  docker/pip-install.sh tests/docker/engine.sh
.venv/bin/hadolint docker/Dockerfile tests/docker/standin.Dockerfile
if [ $# = 0 ]; then
  # The whole suite. The SLURM launch tests mostly wait on the scheduler (2 cores half idle
  # over 4 minutes): they run beside the rest, and their report follows the rest's.
  setsid .venv/bin/python -m pytest -p no:cacheprovider tests/slurm >"$slurm_log" 2>&1 &
  slurm_pid=$!
  # Two workers (pytest-xdist), each test file on one of them (its module fixtures once): a
  # test's ranks are forks of a warm server (tests/distributed/launcher.py), so most of the
  # time left is the tests' own work, one core's worth for much of the suite
  # (docs/benchmarks.md, "Test suite").
  suite=0
  .venv/bin/python -m pytest --ignore=tests/slurm -n "${DEL_TEST_WORKERS:-2}" --dist loadfile \
    || suite=$?
  slurm=0
  wait "$slurm_pid" || slurm=$?
  slurm_pid=""
  echo "== tests/slurm (run beside the rest of the suite): exit status $slurm"
  cat "$slurm_log"
  [ "$suite" = 0 ] || exit "$suite"
  [ "$slurm" = 0 ] || exit "$slurm"
else
  .venv/bin/python -m pytest "$@"
fi

newest=0
wait "$newest_pid" || newest=$?
cat "$newest_log"
if [ "$newest" = 3 ] && [ "${DEL_REQUIRE_PY312:-0}" != 1 ]; then
  echo "skipped: the tests on the newest megatron-core (no Python 3.12; see launch/setup_env_newest.sh)"
elif [ "$newest" != 0 ]; then
  exit "$newest"
else
  # exit status 5: the selection held no test marked megatron. The whole selection on two
  # workers, a test file on each, as the first run
  workers=()
  [ $# = 0 ] && workers=(-n "${DEL_TEST_WORKERS:-2}" --dist loadfile)
  DEL_MEGATRON_ONLY=1 .venv312/bin/python -m pytest "${workers[@]}" "$@" || [ $? = 5 ]
fi
