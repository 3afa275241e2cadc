"""The one teacher-forced loop: held-out batches -> per-batch scoring -> summed statistics ->
reduced over the data-parallel group -> metrics.

Used by the trainer's periodic evaluation (`training.trainer.evaluate`, scoring with the
training forward: {name: [sum, count]} report pairs) and by del-eval
(`evaluation.heldout.teacher_forced_metrics`, scoring with a checkpoint's or a Hugging Face
model's logits: `numeric.batch_statistics`). The caller brings the scoring and the last step
from sums to metrics; the loop owns what both need to get right: every batch on the compute
device, sums in float64 on the device (no host read per batch), one all-reduce of all sums
through `collectives`, then one host read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import collectives
from ..runtime import batch_to_device

Score = Callable[[Any], dict[str, torch.Tensor]]
"""A batch on the compute device ({tokens, labels, loss_mask: [b, s]}), or a list of them
where the caller's batches come in lists (a pipeline's micro-batches) -> statistics that
add up over batches and ranks ({name: tensor of a fixed shape}, on the device)."""

Metrics = Callable[[dict[str, Any]], dict[str, Any]]
"""Summed statistics, read to the host ({name: float or nested lists of floats, shaped as
the scores}) -> the metrics."""


@dataclass(frozen=True)
class Evaluated:
    metrics: dict[str, Any]
    batches: int  # this rank's


def sum_scores(
    batches: Iterable[dict[str, Any]],
    score: Score,
    device: torch.device,
    *,
    progress: str | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """({name: float64 sum over `batches` on `device`}, number of batches); no host read.
    An item of `batches` may be a list of batches, scored as one call and counted each.
    progress: a tqdm bar with this description (None: no bar)."""
    from tqdm import tqdm

    sums: dict[str, torch.Tensor] = {}
    count = 0
    for batch in tqdm(batches, desc=progress, unit="batch", disable=progress is None):
        if isinstance(batch, list):
            scored, count = score([batch_to_device(b, device) for b in batch]), count + len(batch)
        else:
            scored, count = score(batch_to_device(batch, device)), count + 1
        for name, value in scored.items():
            value = value.detach().to(torch.float64)
            sums[name] = sums[name] + value if name in sums else value
    return sums, count


def reduce_and_read(
    sums: dict[str, torch.Tensor], group: dist.ProcessGroup | None
) -> dict[str, Any]:
    """The sums over every rank of `group` (None: this process alone, no collective), read to
    the host at once: {name: float ([] sums) or nested lists (shaped sums)}. One all-reduce
    of one flat tensor, one host read."""
    names = sorted(sums)
    if not names:
        return {}
    flat = torch.cat([sums[n].reshape(-1) for n in names])
    if group is not None:
        collectives.all_reduce(flat, group=group)
    values = flat.tolist()  # the one host read
    read, start = {}, 0
    for name in names:
        shape = tuple(sums[name].shape)
        size = math.prod(shape)
        read[name] = _nested(values[start : start + size], shape)
        start += size
    return read


def _nested(values: list[float], shape: tuple[int, ...]) -> Any:
    """Flat row-major `values` as nested lists of `shape` (a float for shape ())."""
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    step = math.prod(shape[1:])
    return [_nested(values[i : i + step], shape[1:]) for i in range(0, len(values), step)]


def teacher_forced(
    batches: Iterable[dict[str, Any]],
    score: Score,
    metrics: Metrics,
    *,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    progress: str | None = None,
) -> Evaluated:
    """Score every batch, sum, reduce over `group` (the data-parallel group: every rank must
    call this with the same number of batches and scores of the same names and shapes, which
    a held-out loader with `epochs` set gives; None: one process), read once, make metrics.

    The caller sets the mode (eval, no_grad); this loop only runs it."""
    sums, count = sum_scores(batches, score, device, progress=progress)
    return Evaluated(metrics(reduce_and_read(sums, group)), count)
