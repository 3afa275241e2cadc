"""The comparison page (docs/results.md): what was run, where and how long, the table of
`del-eval compare`, its plots, and the notes kept beside the experiment script.

    python -m experiments.results_page COMPARISON_MD OUT_MD --plots DIR
        --minutes N --steps N --seeds N --notes FILE --command TEXT [--summary FILE]

The summary (launch/experiments/results_summary.md: what every experiment on the page
supports, rules out and cannot say) comes first, the loss comparison after it.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

from del_megatron.outputs import write_text_atomic

from .machine import machine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("comparison", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--plots", type=Path, required=True)
    p.add_argument("--minutes", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seeds", type=int, required=True)
    p.add_argument("--notes", type=Path, required=True)
    p.add_argument("--command", required=True)
    p.add_argument("--summary", type=Path, help="the page's opening summary (markdown)")
    args = p.parse_args(argv)
    plots = os.path.relpath(args.plots, args.out.parent)
    summary = f"{args.summary.read_text().strip()}\n\n" if args.summary else ""
    page = f"""# Results: DEL and the other number losses on the tiny model

{summary}## The loss comparison

Regenerate from nothing with `{args.command.strip()}` (written {datetime.date.today()},
{args.minutes} minutes on {machine()}).

Setup: `configs/tiny_cpu.yaml` (a ~1.5M-parameter Llama-style model, tensor parallel 2 on
2 processes), {args.steps} steps on the synthetic math corpus of `data-tools synth`, every
loss kind with its default options, {args.seeds} seeds each (`train.seed`), the same data
and schedule. Each final checkpoint is evaluated by `del-eval`: teacher-forced metrics on
the held-out shards (sequence 128) and greedy answers to 100 held-out problems (no shots,
12 new tokens, checked with math-verify). Mean ± standard deviation over seeds.

{args.comparison.read_text().strip()}

![digit entropy]({plots}/digit_entropy.png)
![accuracy by place]({plots}/place_accuracy.png)
![training cross entropy]({plots}/loss_curves.png)

{args.notes.read_text().strip()}
"""
    write_text_atomic(args.out, page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
