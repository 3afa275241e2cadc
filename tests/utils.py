"""Test helpers shared across the suite."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float = 0.0, what: str = ""
) -> None:
    """allclose that says where it failed: worst index, both values, NaN/inf mismatches."""
    actual, expected = (
        x.detach().to(torch.float64).cpu()
        if isinstance(x, torch.Tensor)
        else torch.as_tensor(x, dtype=torch.float64)
        for x in (actual, expected)
    )
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    finite_a, finite_e = torch.isfinite(actual), torch.isfinite(expected)
    if not torch.equal(finite_a, finite_e):
        idx = (finite_a != finite_e).nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: non-finite mismatch at {idx}: {actual[tuple(idx)]} vs {expected[tuple(idx)]}"
        )
    diff = (actual - expected).abs().where(finite_a, 0.0)
    bound = atol + rtol * expected.abs().where(finite_e, 0.0)
    excess = diff - bound
    if actual.numel() and excess.max() > 0:
        idx = tuple(torch.unravel_index(excess.argmax(), excess.shape)) if excess.dim() else ()
        raise AssertionError(
            f"{what}: worst at {[int(i) for i in idx]}: {actual[idx].item():.17g} vs "
            f"{expected[idx].item():.17g} (|diff| {diff[idx].item():.3g} > {bound[idx].item():.3g})"
        )


def each_once(*assignments: str) -> list[str]:
    """section.field=value overrides with each field given once, the last value winning in
    the place of the first: del-train refuses a field set twice, and a test's helper adds
    its case's values to a base list."""
    merged: dict[str, str] = {}
    for assignment in assignments:
        merged[assignment.partition("=")[0]] = assignment
    return list(merged.values())


def end_process_group() -> None:
    """Destroys the default process group with what megatron and DeepSpeed made on it, as
    del-train does before it exits (`parallel.end_distributed`): a test module that makes a
    fresh group after this one would otherwise get megatron's parallel state or DeepSpeed's
    clone of the world group from a destroyed world ("Group ... is not registered")."""
    from del_megatron.parallel import end_distributed

    end_distributed()


def logged_steps(metrics: Path) -> list[int]:
    """The steps of metrics.jsonl's complete lines, [] before the file exists. A run still
    writing can have a line half written (CI once read `{"step": 9, ..., "digit_logsumexp":
    3.9074916094` and failed on the JSON): a line counts once its newline is there."""
    if not metrics.is_file():
        return []
    lines = metrics.read_text().splitlines(keepends=True)
    return [json.loads(line)["step"] for line in lines if line.endswith("\n")]
