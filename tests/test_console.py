"""What the commands print for a user: every number named for what it is."""

from __future__ import annotations

from pathlib import Path

from del_megatron.cli.train import final_table, objective_name
from del_megatron.evaluation.report import markdown_table
from del_megatron.losses import NumericLossConfig

HELD_OUT = {"loss": 2.5, "ce": 2.4, "digit_acc": 0.1, "digit_entropy": 1.0, "digit_abs_error": 2}


def test_the_two_losses_are_named_for_what_they_add_up():
    """The quick start's held-out loss is the training objective (CE + alpha * DEL), del-eval's
    is the cross entropy; each table says which, and the quick start shows both."""
    objective = objective_name(NumericLossConfig(kind="del", alpha=0.1))
    assert objective == "CE + 0.1·del"
    table = final_table(HELD_OUT, HELD_OUT, objective)
    assert "held-out CE " in table and "held-out loss (CE + 0.1·del) " in table
    assert objective_name(NumericLossConfig(kind="mle")) == "CE"
    assert "held-out loss" not in final_table(HELD_OUT, HELD_OUT, "CE")  # one number, once
    assert "| loss (CE) | 2.4000 |" in markdown_table({"numeric": {"loss": 2.4}})


def test_a_resumed_run_still_shows_its_held_out_metrics():
    """A resumed run evaluated before training in its first part only: the table shows the
    metrics after training with '-' before (it said there was no held-out data)."""
    table = final_table(None, HELD_OUT, "CE + 0.1·del")
    assert "no held-out data" not in table
    row = next(line for line in table.splitlines() if line.startswith("held-out CE"))
    assert row.split()[-2:] == ["-", "2.4000"]
    assert final_table(None, None) == "no held-out data (eval.sources) to compare"


def test_a_finished_run_says_how_to_evaluate_and_export_it(tmp_path, monkeypatch):
    """The commands named are those of the environment del-train runs in, and exist."""
    import shlex

    from del_megatron.cli.train import next_steps
    from del_megatron.config import load_run_config

    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(
        Path(__file__).parents[1] / "configs" / "tiny_cpu.yaml", [f"output_dir={tmp_path}/run"]
    )
    lines = next_steps(cfg, "run/checkpoints/step-0000300").splitlines()
    evaluate = shlex.split(lines[1].split(":", 1)[1])
    assert Path(evaluate[0]).is_file() and evaluate[0].endswith("del-eval")
    assert evaluate[1:] == [
        "run/checkpoints/step-0000300",
        "--heldout",
        "runs/tiny/shards/heldout/manifest.json",
        "--out",
        f"{tmp_path}/run/eval",
    ]
    export = shlex.split(lines[2].split(":", 1)[1])
    assert Path(export[0]).is_file() and export[1] == "megatron-to-hf"


def test_a_cpu_dry_run_plans_no_assumed_gpu(
    tmp_path, capsys, monkeypatch, synth_tokenizer, synth_shards
):
    from del_megatron.cli.train import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    config = Path(__file__).parents[1] / "configs" / "tiny_cpu.yaml"
    overrides = [
        f"data.tokenizer={synth_tokenizer}",
        f"data.sources=[{{manifest: {synth_shards}}}]",
        "eval.sources=[]",
        f"output_dir={tmp_path}",
    ]
    assert main(["--config", str(config), "--dry-run", *overrides]) == 0
    plan = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# plan")]
    assert plan[1] == (
        "# plan: train.device=cpu: no GPU memory to plan (--gpu-memory GIB plans it for a GPU)"
    )
    assert not any("GiB GPU" in line for line in plan)


def test_no_progress_bars_into_a_log(monkeypatch):
    """A bar's every redraw ends up in a log file: drawn only on a terminal."""
    import sys

    from del_megatron.arguments import progress_bars

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert not progress_bars(quiet=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert progress_bars(quiet=False) and not progress_bars(quiet=True)
