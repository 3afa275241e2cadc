"""One model evaluated (`del-eval MODEL`): every input read or checked before the model loads
(minutes for a 7B), the model loaded by its backend, then each requested part: teacher-forced
metrics on held-out shards, generation accuracy, lm-evaluation-harness tasks."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from .generation import GenerationSettings
from .harness import LmEvalSettings
from .heldout import HeldoutSettings
from .task_suite import TaskSuiteSettings


def evaluate_model(
    model: Path,
    device: torch.device,
    *,
    heldout: HeldoutSettings | None = None,
    generation: GenerationSettings | None = None,
    lm_eval: LmEvalSettings | None = None,
    tasks: TaskSuiteSettings | None = None,
    seq_len: int | None = None,
    progress: bool = True,
) -> dict:
    """Results of `model` (a checkpoint, weights or Hugging Face directory) on `device`:
    {model, kind, numeric?, generation?, lm_eval?, tasks?}. seq_len: the requested window, refused
    past the model's positions whatever is evaluated (None: the default window)."""
    from . import generation as gen
    from .backends import load_model, max_positions
    from .heldout import check_heldout, window_length

    problems = shots = None
    if generation is not None:
        problems, shots = gen.problems_and_shots(generation)
    term = None
    if heldout is not None:
        from .heldout import term_loss

        check_heldout(heldout.manifests)
        term = term_loss(model)  # the loss whose digit term's share is reported
    suite = None
    if tasks is not None:
        from .task_suite import load_suite

        suite = load_suite(tasks.directory)
    positions = max_positions(model)
    window = window_length(seq_len, positions)
    if progress:
        print(f"del-eval: loading {model}", file=sys.stderr, flush=True)
    loaded = load_model(model, device)
    results: dict = {"model": str(model), "kind": loaded.kind}
    with tempfile.TemporaryDirectory(prefix="del-eval-") as scratch:  # a checkpoint's export
        if heldout is not None:
            from .heldout import heldout_metrics

            results["numeric"] = heldout_metrics(
                loaded, heldout, window, progress=progress, loss=term
            )
        if generation is not None:
            results["generation"] = gen.generation_accuracy(
                loaded,
                generation,
                problems,
                shots,
                positions=positions,
                scratch=Path(scratch),
                progress=progress,
            )
        if tasks is not None:
            from .task_suite import evaluate_suite

            results["tasks"] = evaluate_suite(
                loaded,
                suite,
                positions=positions,
                scratch=Path(scratch),
                shots=tasks.shots,
                greedy_limit=tasks.limit,
                batch_size=tasks.batch_size,
                backend=tasks.backend,
            )
        if lm_eval is not None:
            from .backends import hf_directory
            from .harness import run_lm_eval

            results["lm_eval"] = run_lm_eval(
                hf_directory(loaded, Path(scratch)),
                list(lm_eval.tasks),
                include=lm_eval.include,
                limit=lm_eval.limit,
                device=device,
            )
    return results
