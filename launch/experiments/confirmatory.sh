#!/usr/bin/env bash
# Does DEL at its default alpha = 0.1 beat MLE, or equal it within +-0.025? The pre-registered
# confirmatory test (docs/results/confirmatory/preregistration.md): 12 new MLE bases (seeds
# 101-112), each continued 300 steps by MLE, DEL 0.1 and the shift-invariant DEL 0.1 on one
# data order per base; one base also 1,000 steps by each arm. Analysis:
# experiments/confirmatory/report.py; the page: docs/results/confirmatory/.
#
#   bash launch/experiments/confirmatory.sh           # about 85-120 minutes on 2 idle cores
#   bash launch/experiments/confirmatory.sh --ci      # 2 bases, 3 arms, 10 steps (CI)
#   ... --root DIR --out DIR --jobs N
#
# Runs and data go to runs/confirmatory (--root), the page to ROOT/report (--out). A killed
# experiment continues where it stopped: finished runs are kept, a run cut short is made
# again. One progress line per run.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash launch/setup_env.sh
exec .venv/bin/python -m experiments.confirmatory.run "$@"
