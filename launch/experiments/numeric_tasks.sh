#!/usr/bin/env bash
# Every loss kind against MLE on the numeric task suite (data_tools/tasks.py): mle, del,
# del_distance, ntl_was, ntl_mse, dist2, mixce and emo, 5 seeds each, the same data, model
# (configs/numeric_tasks_cpu.yaml) and schedule; each run's checkpoints at fixed steps
# evaluated per task (digit accuracy, exact match teacher-forced and greedy, digit entropy
# against the true entropy, ECE); then the report: each kind's difference to MLE with its
# 95% interval paired by seed, steps to threshold, plots, and the raw per-run metrics.
#
#   bash launch/experiments/numeric_tasks.sh         # about 2 hours on 2 idle cores
#   bash launch/experiments/numeric_tasks.sh --ci    # 2 kinds x 2 seeds, 20 steps (CI)
#   ... --root DIR --out DIR --jobs N --kinds K ... --seeds S ... --steps N --eval-every N
#
# Runs and data go to runs/numeric-tasks (--root), the report to ROOT/report (--out). A
# killed experiment continues where it stopped: finished runs are kept, a run cut short is
# made again. One progress line per run. Module: experiments/numeric_tasks/run.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash launch/setup_env.sh
exec .venv/bin/python -m experiments.numeric_tasks.run "$@"
