"""The bridge to lm-evaluation-harness (optional extra [eval]): its tasks on a Hugging Face
directory, so GSM8K / MATH / MMLU numbers come out the way they are reported elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError, one_line

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class LmEvalSettings:
    tasks: tuple[str, ...]
    """lm-evaluation-harness task names."""
    include: Path | None = None
    """Directory of extra task YAMLs (local tasks)."""
    limit: int | None = None
    """At most this many documents a task."""


def run_lm_eval(
    hf_dir: Path,
    tasks: list[str],
    *,
    include: Path | None = None,
    limit: int | None = None,
    device: torch.device,
    batch_size: int = 8,
) -> dict:
    """{task: {metric: value}} from lm_eval.simple_evaluate with its "hf" model."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError(
            "--lm-eval needs lm-evaluation-harness: pip install 'del-megatron[eval]'"
        ) from None
    manager = TaskManager(include_path=str(include)) if include else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"--lm-eval: unknown task {unknown[0]!r} (see `lm_eval --tasks list`)")
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    try:
        output = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={hf_dir},dtype={dtype}",
            tasks=tasks,
            task_manager=manager,
            limit=limit,
            device=str(device),
            batch_size=batch_size,
        )
    except (FileNotFoundError, ValueError) as err:  # a task's data or arguments
        raise UserError(f"--lm-eval: {one_line(err)}") from None
    return {
        task: {k: v for k, v in values.items() if isinstance(v, int | float) and k != "alias"}
        for task, values in output["results"].items()
    }
