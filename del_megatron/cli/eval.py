"""del-eval: evaluate a checkpoint or a Hugging Face model; compare runs.

    del-eval MODEL [--heldout MANIFEST ...] [--gsm8k FILE] [--lm-eval TASKS] [--out DIR]
    del-eval compare RESULT_DIR ... --out DIR [--group-by-parent]

MODEL is a del-megatron checkpoint (or weights directory) or a Hugging Face model directory.
Teacher-forced numeric metrics on held-out shards (--heldout), generation accuracy on
GSM8K-format problems (--gsm8k), standard benchmarks through lm-evaluation-harness
(--lm-eval, the optional extra [eval]). Results: results.json and results.md in --out, and
the table on the console. `compare` reads results of several runs and draws PNG plots.
Mistakes print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from ..errors import UserError
from .arguments import non_negative_int, positive_int

# The longest default window: a checkpoint and its Hugging Face export share
# max_position_embeddings, so a default taken from it alone gives both the same windows
# (and the same metrics); the cap keeps long-context models' windows affordable.
DEFAULT_WINDOW = 2048


def window_length(requested: int | None, positions: int) -> int:
    if requested is None:
        return min(positions, DEFAULT_WINDOW)
    if requested > positions:
        raise UserError(
            f"--seq-len {requested} exceeds the model's max_position_embeddings={positions}: "
            f"choose --seq-len {positions} or less"
        )
    return requested


def fitting_prompts(
    lengths: list[int], max_new_tokens: int, shots: int, positions: int
) -> list[int]:
    """Which prompts leave room for --max-new-tokens within the model's positions (past them
    a model's outputs are meaningless; transformers only warns). None fitting is refused."""
    keep = [i for i, n in enumerate(lengths) if n + max_new_tokens <= positions]
    if not keep:
        raise UserError(
            f"--gsm8k: no prompt ({min(lengths)} tokens or more with {shots} shots) leaves "
            f"room for --max-new-tokens {max_new_tokens} within the model's "
            f"max_position_embeddings={positions}: use fewer --shots or a smaller "
            "--max-new-tokens"
        )
    return keep


def check_heldout(manifests: list[str]) -> None:
    """Each held-out manifest readable and its listed shards present at their sizes."""
    from ..data.format import check_listed_shards, read_manifest

    for url in manifests:
        check_listed_shards(url, read_manifest(url))


def heldout_config(manifests: list[str], seq_len: int, batch_size: int):
    from ..data import DataConfig, DataSource

    return DataConfig(
        sources=tuple(DataSource(manifest=m) for m in manifests),
        seq_len=seq_len,
        micro_batch_size=batch_size,
        shuffle=False,
        epochs=1,
    )


def teacher_forced(loaded, config, max_batches: int | None, progress: bool) -> dict:
    from tqdm import tqdm

    from ..data import StreamingLoader
    from ..evaluation import NumericMetrics

    loader = StreamingLoader(
        config, 0, 1, fingerprint=loaded.tokenizer.fingerprint, num_batches=max_batches
    )
    metrics = NumericMetrics(loaded.tokenizer.digit_vocab)
    batches = 0
    for batch in tqdm(loader, desc="teacher-forced", unit="batch", disable=not progress):
        metrics.add(loaded.forward(batch["tokens"]), batch["labels"], batch["loss_mask"])
        batches += 1
    result = metrics.result()
    result.update(
        heldout=[s.manifest for s in config.sources], seq_len=config.seq_len, batches=batches
    )
    return result


def problems_and_shots(args) -> tuple[list, list]:
    """The GSM8K-format problems to answer and the few-shot examples (read before any model
    loads, so that a wrong file costs nothing)."""
    from ..evaluation import generation as gen

    problems = gen.load_problems(args.gsm8k, None)
    if args.shots_file:
        shots = gen.load_problems(args.shots_file, args.shots)
    else:
        shots, problems = problems[: args.shots], problems[args.shots :]
    if args.limit is not None:
        problems = problems[: args.limit]
    if not problems:
        raise UserError(f"{args.gsm8k}: no problems left after {args.shots} shots")
    return problems, shots


def generation(loaded, args, problems: list, shots: list, scratch: Path) -> dict:
    from ..evaluation import generation as gen
    from ..evaluation.backends import hf_directory

    prompts = [gen.prompt_of(p, shots, args.template) for p in problems]
    keep = fitting_prompts(
        [len(loaded.tokenizer.encode(p)) for p in prompts],
        args.max_new_tokens,
        len(shots),
        args.max_positions,
    )
    left_out = len(prompts) - len(keep)
    if left_out:
        print(
            f"del-eval: left out {left_out} of {len(prompts)} problems whose prompt plus "
            f"--max-new-tokens {args.max_new_tokens} exceeds the model's "
            f"{args.max_positions} positions",
            file=sys.stderr,
            flush=True,
        )
        problems, prompts = [problems[i] for i in keep], [prompts[i] for i in keep]
    if args.backend == "vllm":
        completions = gen.generate_vllm(
            hf_directory(loaded, scratch),
            loaded.tokenizer,
            prompts,
            max_new_tokens=args.max_new_tokens,
        )
    else:
        model = loaded.hf_model
        if model is None:  # a checkpoint: transformers runs its export
            from ..evaluation.backends import load_model

            model = load_model(hf_directory(loaded, scratch), _device(args.device)).hf_model
        completions = gen.generate_transformers(
            model,
            loaded.tokenizer,
            prompts,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            progress=not args.quiet,
        )
    result = gen.score(problems, completions)
    result.update(
        file=str(args.gsm8k),
        shots=len(shots),
        template=args.template,
        backend=args.backend,
        left_out_too_long=left_out,
    )
    return result


def _device(requested: str) -> torch.device:
    from ..models.device import resolve_device

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
        default="Question: {question}\nAnswer:",
        help="prompt of one problem, with {question}",
    )
    parser.add_argument("--limit", type=positive_int, help="at most this many problems")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
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
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        args.template.format(question="")
    except (KeyError, IndexError, ValueError) as err:
        parser.error(f"--template: only {{question}} may stand in braces ({err!r})")
    if "{question}" not in args.template:
        parser.error("--template needs {question}")
    if not (args.heldout or args.gsm8k or args.lm_eval):
        parser.error("nothing to evaluate: give --heldout, --gsm8k and/or --lm-eval")

    from ..evaluation.backends import load_model, max_positions
    from ..evaluation.report import markdown_table, write_results

    device = _device(args.device)
    inputs = {}  # every input read or checked before the model (minutes for a 7B) loads
    if args.gsm8k:
        inputs["problems"], inputs["shots"] = problems_and_shots(args)
    check_heldout(args.heldout)
    args.max_positions = max_positions(args.model)
    seq_len = window_length(args.seq_len, args.max_positions)
    if not args.quiet:
        print(f"del-eval: loading {args.model}", file=sys.stderr, flush=True)
    loaded = load_model(args.model, device)
    if args.heldout:
        inputs["heldout"] = heldout_config(args.heldout, seq_len, args.batch_size)
    with tempfile.TemporaryDirectory(prefix="del-eval-") as scratch:  # a checkpoint's export
        results = _evaluate(loaded, args, inputs, device, Path(scratch))
    if args.out:
        write_results(args.out, results)
    print(markdown_table(results), end="")
    if "lm_eval" in results:
        print(json.dumps(results["lm_eval"], indent=1))
    return 0


def _evaluate(
    loaded, args: argparse.Namespace, inputs: dict, device: torch.device, scratch: Path
) -> dict:
    results: dict = {"model": str(args.model), "kind": loaded.kind}
    if args.heldout:
        results["numeric"] = teacher_forced(
            loaded, inputs["heldout"], args.max_batches, not args.quiet
        )
    if args.gsm8k:
        results["generation"] = generation(
            loaded, args, inputs["problems"], inputs["shots"], scratch
        )
    if args.lm_eval:
        from ..evaluation.backends import hf_directory
        from ..evaluation.harness import run_lm_eval

        tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
        results["lm_eval"] = run_lm_eval(
            hf_directory(loaded, scratch),
            tasks,
            include=args.lm_eval_include,
            limit=args.lm_eval_limit,
            device=device,
        )
    return results


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

    from ..evaluation.report import comparison_table, plot_comparison, read_curve, window_note
    from ..outputs import write_text_atomic

    groups: dict[str, list[dict]] = {}
    curves: dict[str, list] = {}
    for directory in args.results:
        path = directory / "results.json"
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise UserError(f"{path}: not readable results ({err})") from None
        if not isinstance(result, dict):
            raise UserError(f"{path}: not del-eval results (a JSON object)")
        name = (
            directory.name.rsplit("-", 1)[0] if args.group_by == "parent-name" else directory.name
        )
        groups.setdefault(name, []).append(result)
        metrics = directory / "metrics.jsonl"
        if metrics.is_file():
            curves.setdefault(name, []).append(read_curve(metrics))
    if args.agree_within is not None:
        check_agreement([r for rs in groups.values() for r in rs], args.agree_within)
    table = comparison_table(groups)
    note = window_note(groups)
    if note:
        table += f"\n{note}\n"
    write_text_atomic(args.out / "comparison.md", table)
    for png in plot_comparison(groups, curves, args.out):
        print(f"plot: {png}")
    if not curves:
        print("no loss curves: no metrics.jsonl beside the results (copy a run's in to plot it)")
    print(table, end="")
    return 0


def check_agreement(results: list[dict], tolerance: float) -> None:
    """Every scalar teacher-forced metric equal across `results` within `tolerance`."""
    numeric = [r["numeric"] for r in results if isinstance(r.get("numeric"), dict)]
    if len(numeric) != len(results) or len(numeric) < 2:
        raise UserError("--agree-within needs two or more results with teacher-forced metrics")
    for key, value in numeric[0].items():
        if not isinstance(value, int | float):
            continue
        values = [n.get(key) for n in numeric]
        if not all(isinstance(v, int | float) for v in values):
            raise UserError(f"{key} is missing from some of the results: {values}")
        if max(values) - min(values) > tolerance * max(1.0, abs(value)):
            raise UserError(f"{key} differs beyond {tolerance:g}: {values}")
    print(f"teacher-forced metrics agree within {tolerance:g}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["compare"]:
            return compare_main(argv[1:])
        return evaluate_main(argv)
    except UserError as err:
        print(f"del-eval: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
