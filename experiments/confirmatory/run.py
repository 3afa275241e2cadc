"""The confirmatory experiment (launch/experiments/confirmatory.sh): does DEL at its default
α = 0.1 beat MLE, or equal it within ±0.025, continuing a model MLE has trained? The
continuation experiment's design and runner (`continuations.run`) with a protocol of its
own: 12 new MLE bases (seeds 101-112, the earlier run's were 1-4), each continued 300
steps by MLE, DEL at α = 0.1 and the shift-invariant DEL at α = 0.1 on one data order per
base, greedy answers on every held-out problem; one base (101) also continued 1,000 steps
by each arm. The analysis is pre-registered (`report`, docs/results/confirmatory/).

    python -m experiments.confirmatory.run [--ci] [--root DIR] [--out DIR] [--jobs N]

Resumable as the continuation experiment is: finished runs are kept, a run cut short is
made again; runs of another protocol in the same root are refused.
"""

from __future__ import annotations

import sys

from ..continuations.run import ARMS, Experiment, Protocol, experiment_main

# MLE, DEL 0.1 and the shift-invariant DEL 0.1, as the continuation experiment names them
CONFIRMATORY_ARMS = tuple(a for a in ARMS if a.name in ("mle", "del-0.1", "del_si-0.1"))

# 12 bases: the detectable difference from the earlier run's spread (`prior`) falls below
# the margin's third; about 85-120 minutes on 2 idle cores (`prior.minutes`).
FULL = Protocol(
    seeds=tuple(range(101, 113)),
    base_steps=1000,
    steps=300,
    log_every=25,
    documents=40000,
    heldout=200,
    greedy_limit=200,  # every held-out problem of a task
    arms=CONFIRMATORY_ARMS,
    long_seeds=(101,),
    long_steps=1000,
)
# CI: that everything runs and the page is written (2 bases, the 3 arms, 10 steps, no long
# continuation).
CI = Protocol(
    seeds=(101, 102),
    base_steps=20,
    steps=10,
    log_every=5,
    documents=1500,
    heldout=16,
    greedy_limit=8,  # as the continuation experiment's CI: greedy answers cost most
    arms=CONFIRMATORY_ARMS,
)


def main(argv: list[str] | None = None) -> int:
    from .report import write_report

    experiment = Experiment(
        "confirmatory", "launch/experiments/confirmatory.sh", FULL, CI, write_report
    )
    return experiment_main(experiment, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
