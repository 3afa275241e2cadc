"""The training metrics of issue 39 on the host side: `numeric_share` from the reduced means
(kinds with a digit term only), the console line's short labels for the diagnostics, and
steps whose sets of metrics differ (a log step's gradient probe) read with one host
synchronisation and each its own values."""

from __future__ import annotations

import pytest
import torch

from del_megatron import NumericLossConfig
from del_megatron.training import metrics
from del_megatron.training.metrics import StepMetrics, console_line, derived_values, read_steps


def test_numeric_share_is_alpha_numeric_over_loss_for_digit_kinds_only():
    values = {"loss": 2.0, "ce": 1.5, "numeric": 0.25}
    assert derived_values(values, NumericLossConfig(kind="del", alpha=2.0)) == {
        "numeric_share": pytest.approx(0.25)
    }
    assert derived_values(values, NumericLossConfig(kind="del")) == {
        "numeric_share": pytest.approx(0.0125)  # the default alpha, 0.1
    }
    for kind in ("mle", "mixce", "emo"):
        assert derived_values(values, NumericLossConfig(kind=kind)) == {}, kind


def test_console_line_shows_the_diagnostics_shortly():
    values = {
        "loss": 2.0,
        "digit_entropy": 2.2,
        "digit_logit": -0.7,
        "digit_logsumexp": 1.64,
        "numeric_share": 0.08,
        "numeric_grad_share": 0.259,
        "numeric_grad_cos": 0.03,
        "lr": 1e-3,
    }
    assert console_line(10, 30, values) == (
        "step 10/30 | loss 2.0000 | digit_entropy 2.200 | logit -0.70 | lse 1.64 | share 0.080 "
        "| grad_share 0.259 | grad_cos 0.03 | lr 1.00e-03"
    )


def test_steps_with_other_metric_sets_are_read_at_once(monkeypatch):
    plain = StepMetrics(["ce", "lm loss"], torch.tensor([[3.0, 2.0], [4.0, 2.0]]), 1.5)
    probed = StepMetrics(
        ["ce", "lm loss", "numeric_grad_share"],
        torch.tensor([[1.0, 2.0], [2.0, 2.0], [0.5, 2.0]], dtype=torch.float64),
        None,
        {"lr": 0.1},
    )
    reads = []
    tolist = torch.Tensor.tolist

    def counted(tensor):
        reads.append(tensor.shape)
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    first, second = read_steps([plain, probed])
    assert len(reads) == 1, reads
    assert first == {"ce": 1.5, "loss": 2.0, "grad_norm": 1.5}
    assert second == {"ce": 0.5, "loss": 1.0, "numeric_grad_share": 0.25, "lr": 0.1}
    assert metrics.log_step(10, 10, 30) and metrics.log_step(30, 10, 30)
    assert not metrics.log_step(11, 10, 30)
