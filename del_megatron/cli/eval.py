"""del-eval: evaluate a checkpoint or a Hugging Face model; compare runs.

    del-eval MODEL [--heldout MANIFEST ...] [--gsm8k FILE] [--tasks DIR] [--lm-eval TASKS]
             [--out DIR]
    del-eval compare RESULT_DIR ... --out DIR [--group-by-parent]

MODEL is a del-megatron checkpoint (or weights directory) or a Hugging Face model directory.
Teacher-forced numeric metrics on held-out shards (--heldout), generation accuracy on
GSM8K-format problems (--gsm8k), per-task metrics on the numeric task suite of `data-tools
tasks` (--tasks), standard benchmarks through lm-evaluation-harness
(--lm-eval, the optional extra [eval]). Results: results.json and results.md in --out, and
the table on the console. `compare` reads results of several runs and draws PNG plots.
Mistakes print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..arguments import non_negative_int, positive_int, progress_bars
from ..caches import use_writable_caches
from ..errors import INTERRUPTED, UserError
from ..evaluation.generation import DEFAULT_TEMPLATE, GenerationSettings
from ..evaluation.harness import LmEvalSettings
from ..evaluation.heldout import DEFAULT_WINDOW, HeldoutSettings
from .groups import ended_on_return

if TYPE_CHECKING:  # torch is imported when a model is evaluated: --help answers at once
    import torch


def _device(requested: str) -> torch.device:
    from ..runtime import resolve_device

    try:
        return resolve_device(requested)
    except ValueError as err:
        raise UserError(f"--device: {err}") from None


def evaluate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="del-eval",
        description=__doc__.splitlines()[0],
        epilog="del-eval compare RESULT_DIR ... --out DIR: tables and plots over several "
        "evaluated runs (del-eval compare --help)",
    )
    parser.add_argument(
        "model",
        type=Path,
        help="a checkpoint or weights directory, or a Hugging Face model directory",
    )
    parser.add_argument(
        "--heldout",
        action="append",
        default=[],
        metavar="MANIFEST",
        help="held-out shards (repeatable)",
    )
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        help=f"window length, at most the model's max_position_embeddings (default: that, "
        f"at most {DEFAULT_WINDOW}; the same for a checkpoint and its export)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument(
        "--max-batches", type=positive_int, help="at most this many held-out batches"
    )
    parser.add_argument(
        "--gsm8k", type=Path, help="GSM8K-format jsonl (question, answer ending in '#### N')"
    )
    parser.add_argument("--shots", type=non_negative_int, default=4, help="few-shot examples")
    parser.add_argument(
        "--shots-file",
        type=Path,
        help="take the shots from here (default: the first problems of --gsm8k, then left out)",
    )
    parser.add_argument(
        "--template",
        default=DEFAULT_TEMPLATE,
        help="prompt of one problem, with {question}",
    )
    parser.add_argument("--limit", type=positive_int, help="at most this many problems")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    parser.add_argument(
        "--tasks",
        type=Path,
        metavar="DIR",
        help="the numeric task suite `data-tools tasks` wrote: per task, teacher-forced "
        "metrics on the answers and greedy exact match",
    )
    parser.add_argument(
        "--task-shots", type=non_negative_int, default=0, help="solved problems before each"
    )
    parser.add_argument(
        "--task-limit", type=positive_int, help="greedy answers to at most this many a task"
    )
    parser.add_argument(
        "--lm-eval",
        metavar="TASKS",
        help="lm-evaluation-harness tasks, comma-separated (extra [eval])",
    )
    parser.add_argument(
        "--lm-eval-include",
        type=Path,
        metavar="DIR",
        help="directory of extra task YAMLs (local tasks)",
    )
    parser.add_argument(
        "--lm-eval-limit", type=positive_int, help="at most this many documents a task"
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", type=Path, help="write results.json and results.md here")
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bars (nor when stderr is no terminal)"
    )
    args = parser.parse_args(argv)
    try:
        args.template.format(question="")
    except (KeyError, IndexError, ValueError) as err:
        parser.error(f"--template: only {{question}} may stand in braces ({err!r})")
    if "{question}" not in args.template:
        parser.error("--template needs {question}")
    if not (args.heldout or args.gsm8k or args.lm_eval or args.tasks):
        parser.error("nothing to evaluate: give --heldout, --gsm8k, --tasks and/or --lm-eval")

    from ..evaluation.report import markdown_table, write_results
    from ..evaluation.runner import evaluate_model
    from ..outputs import check_output_dir, output_lock, write_error

    if args.out:  # before the work: a long evaluation is not lost at its last step
        check_output_dir(args.out, "--out")

    heldout = generation = lm_eval = tasks = None
    if args.heldout:
        heldout = HeldoutSettings(
            manifests=tuple(args.heldout),
            batch_size=args.batch_size,
            max_batches=args.max_batches,
        )
    if args.gsm8k:
        generation = GenerationSettings(
            problems=args.gsm8k,
            shots=args.shots,
            shots_file=args.shots_file,
            template=args.template,
            limit=args.limit,
            max_new_tokens=args.max_new_tokens,
            backend=args.backend,
            batch_size=args.batch_size,
        )
    if args.lm_eval:
        lm_eval = LmEvalSettings(
            tasks=tuple(t.strip() for t in args.lm_eval.split(",") if t.strip()),
            include=args.lm_eval_include,
            limit=args.lm_eval_limit,
        )
    if args.tasks:
        from ..evaluation.task_suite import TaskSuiteSettings  # imports torch: not for --help

        tasks = TaskSuiteSettings(
            directory=args.tasks,
            shots=args.task_shots,
            limit=args.task_limit,
            backend=args.backend,
            batch_size=args.batch_size,
        )
    with output_lock(args.out) if args.out else contextlib.nullcontext():
        results = evaluate_model(
            args.model,
            _device(args.device),
            heldout=heldout,
            generation=generation,
            lm_eval=lm_eval,
            tasks=tasks,
            seq_len=args.seq_len,
            progress=progress_bars(args.quiet),
        )
        print(markdown_table(results), end="", flush=True)  # shown before it is written
        if "lm_eval" in results:
            print(json.dumps(results["lm_eval"], indent=1), flush=True)
        if args.out:
            try:
                write_results(args.out, results)
            except OSError as err:
                raise write_error(args.out, err, "--out") from None
    return 0


def compare_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="del-eval compare", description="tables and plots over several evaluated runs"
    )
    parser.add_argument(
        "results",
        nargs="+",
        type=Path,
        help="directories holding results.json (and metrics.jsonl for loss curves)",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--agree-within",
        type=float,
        metavar="TOL",
        help="fail (exit 2) unless every teacher-forced metric agrees across the runs within "
        "TOL (relative to max(1, |value|)): e.g. a checkpoint and its export",
    )
    parser.add_argument(
        "--group-by",
        choices=["run", "parent-name"],
        default="run",
        help="parent-name: runs named KIND-SEED group by KIND",
    )
    args = parser.parse_args(argv)

    from ..evaluation.compare import compare_runs
    from ..outputs import check_output_dir

    check_output_dir(args.out, "--out")
    comparison = compare_runs(
        args.results, args.out, group_by=args.group_by, agree_within=args.agree_within
    )
    if comparison.agreement:
        print(comparison.agreement)
    for png in comparison.plots:
        print(f"plot: {png}")
    if not comparison.curves:
        print("no loss curves: no metrics.jsonl beside the results (copy a run's in to plot it)")
    print(comparison.table, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    """del-eval: its exit status, the groups loading a model made ended (cli/groups.py)."""
    with ended_on_return():
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    try:
        use_writable_caches("del-eval")
        if argv[:1] == ["compare"]:
            return compare_main(argv[1:])
        return evaluate_main(argv)
    except UserError as err:
        print(f"del-eval: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # --out is written whole at the end: nothing of it yet
        print("del-eval: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
