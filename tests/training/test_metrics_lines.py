"""The training metrics of issue 39 on the host side: `numeric_share` from the reduced means
(kinds with a digit term only), the console line's short labels for the diagnostics, and
steps whose sets of metrics differ (a log step's gradient probe) read with one host
synchronisation and each its own values."""

from __future__ import annotations

from pathlib import Path

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


def test_a_flush_appends_its_lines_in_one_write(tmp_path, monkeypatch):
    """A reader following metrics.jsonl while the run writes (tail -f, a dashboard, the tests'
    waits) must not find a line cut at the file buffer's 8 KiB: the steps one flush writes
    (here about 40 KiB) reach the file in one write call. Before, each line was written
    through the buffer, which wrote whatever filled it."""
    import io

    from del_megatron.config import load_run_config
    from del_megatron.training.metrics import Reporter

    cfg = load_run_config(
        Path(__file__).parents[2] / "configs" / "tiny_cpu.yaml",
        [
            f"output_dir={tmp_path}",
            "train.steps=100",
            "train.log_interval=100",
            "logging.wandb=disabled",
        ],
    )
    writes: list[bytes] = []

    class Recorded(io.RawIOBase):  # the file under the buffers open() stacks, its writes kept
        def __init__(self, path):
            self.file = io.FileIO(path, "a")

        def writable(self):
            return True

        def write(self, data):
            writes.append(bytes(data))
            return self.file.write(data)

        def close(self):
            self.file.close()
            super().close()

    def recorded_open(path, mode="r", *args, **kwargs):
        if Path(path).name == "metrics.jsonl" and mode == "a":
            return io.TextIOWrapper(io.BufferedWriter(Recorded(path)), encoding="utf-8")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(metrics, "open", recorded_open, raising=False)
    reporter = Reporter(cfg, start=0, enabled=True)
    names = ["loss", "ce", "digit_acc", *(f"padding_{i}" for i in range(20))]
    for step in range(1, 101):
        reporter.step(step, StepMetrics(names, torch.rand(len(names), 2, dtype=torch.float64), 1.0))
    reporter.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert len(text) > 4 * 8192 and text.count("\n") == 100
    assert writes == [text.encode()], [len(w) for w in writes]


def test_the_tests_waits_count_only_whole_lines(tmp_path):
    """The tests' waits on a running job read metrics.jsonl while it grows: a half-written
    last line is not yet a step (CI failed once parsing one as JSON)."""
    from ..utils import logged_steps

    path = tmp_path / "metrics.jsonl"
    assert logged_steps(path) == []
    path.write_text('{"step": 8, "loss": 1.5}\n{"step": 9, "loss": 1.4, "digit_logsumexp": 3.90')
    assert logged_steps(path) == [8]
