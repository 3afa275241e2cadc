"""Experiments on the library, not part of it: they use del_megatron (its commands and its
evaluation), and nothing under del_megatron/ imports them (the wheel ships del_megatron and
data_tools only). Run from the repository root, as launch/experiments/*.sh run them, with
the extra `experiments` installed (scipy; launch/setup_env.sh's `.[test]` has it):

    numeric_tasks/   every loss kind against MLE on the numeric task suite (run, report)
    continuations/   DEL continuing a model MLE has trained (run, report)
    confirmatory/    DEL at alpha 0.1 against MLE, pre-registered (run, report, prior),
                     on the continuation runner
    claims.py        the numbers the pages' hand-written sentences quote, from the raw rows
    effects.py       paired-by-seed intervals and tests both reports use
    machine.py       the date, machine and commit a run records (protocol.json)
    results_page.py  the loss comparison's page (docs/results.md)
"""

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
"""The checkout these experiments sit in: the configs they train with are found from here."""
