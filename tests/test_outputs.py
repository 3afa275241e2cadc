"""The one policy for outputs (del_megatron/outputs.py): a command that writes where an
earlier output is sets it aside into previous-<time>/ and says so, never replaces it
without a word; the user's files stay where they are."""

from __future__ import annotations

import json

from del_megatron.evaluation.report import write_results


def test_del_eval_out_sets_the_previous_results_aside(tmp_path, capsys):
    """Issue 27, case 4: del-eval --out on an earlier evaluation replaced its results.json."""
    out = tmp_path / "eval"
    write_results(out, {"model": "step-0000300", "numeric": {"ce": 1.5}})
    (out / "metrics.jsonl").write_text("{}\n")  # the user's, copied in for `compare`
    assert capsys.readouterr().out == ""  # a first output: nothing to say
    write_results(out, {"model": "step-0000600", "numeric": {"ce": 1.25}})
    [aside] = out.glob("previous-*")
    assert capsys.readouterr().out == f"{out}: the previous output moved to {aside}\n"
    assert json.loads((out / "results.json").read_text())["model"] == "step-0000600"
    assert json.loads((aside / "results.json").read_text())["model"] == "step-0000300"
    assert sorted(p.name for p in aside.iterdir()) == ["results.json", "results.md"]
    assert (out / "metrics.jsonl").read_text() == "{}\n"
    write_results(out, {"model": "step-0000900"})  # a third: a second set-aside directory
    assert len(list(out.glob("previous-*"))) == 2
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("previous-")) == [
        "metrics.jsonl",
        "results.json",
        "results.md",
    ]


def test_closing_on_the_way_out_of_an_error_adds_no_error(tmp_path):
    """The way out writes to the full disk (issue 37): wandb's log handler's flush on the
    disk that had just failed a checkpoint raised while that error was handled (6 chained
    tracebacks instead of its one line). While an error is raised, a failure to close is
    dropped; otherwise a write that cannot be made is the one line of a full disk."""
    import pytest

    from del_megatron.errors import UserError
    from del_megatron.outputs import close_on_the_way_out

    def close():
        raise OSError(28, "No space left on device")

    close_on_the_way_out(close, tmp_path, failing=True)
    with pytest.raises(UserError, match=f"{tmp_path}: no space left on the device"):
        close_on_the_way_out(close, tmp_path, failing=False)
