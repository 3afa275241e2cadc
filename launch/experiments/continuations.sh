#!/usr/bin/env bash
# Can DEL move a model that MLE has already trained? Shared MLE bases (one per seed, step
# 1000), then 300-step continuations of each on one data order: MLE, a placebo (lr x1.1),
# DEL at alpha 0.1, 0.3, 1, 3, the shift-invariant DEL (ours) at the same alphas, DIST2 0.1,
# NTL-WAS 0.3. Pre-registered primary endpoints, each a trend in log alpha, Holm-corrected
# (experiments/continuations/report.py); the page: docs/results/continuations/.
#
#   bash launch/experiments/continuations.sh          # about 40 minutes on 2 idle cores
#   bash launch/experiments/continuations.sh --ci     # 2 bases, 3 arms, 10 steps (CI)
#   ... --root DIR --out DIR --jobs N
#
# Runs and data go to runs/continuations (--root), the report to ROOT/report (--out). A
# killed experiment continues where it stopped: finished runs are kept, a run cut short is
# made again. One progress line per run.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash launch/setup_env.sh
exec .venv/bin/python -m experiments.continuations.run "$@"
