"""What may change on resume (training/resume_changes.py): every config field has a row, and
each change is said in one line in the dry run or refused in one line naming its override.
The checks run on the files of a checkpoint (tests/training/test_bad_input.py's
fake_checkpoint plus its run_config.yaml), no training."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from del_megatron.cli.train import main
from del_megatron.config import dump_run_config, parse_run_config
from del_megatron.training.resume_changes import TABLE, config_fields
from del_megatron.training.schedule import Schedule, saved_schedule

from . import test_bad_input
from .test_bad_input import fake_checkpoint, snapshot

setup = test_bad_input.setup  # the fixture: a tiny config, its data, an output_dir


def test_every_config_field_has_a_row():
    """A new config field must say what happens when it changes on resume."""
    fields = config_fields()
    assert "loss.kind" in fields and "data.sources" in fields and "model.hidden_size" in fields
    assert sorted(set(fields) - set(TABLE)) == []  # a field without a row
    assert sorted(set(TABLE) - set(fields)) == []  # a row of no field


def saved_run(setup):
    """The files of a checkpoint of the config in `setup`, run_config.yaml included."""
    tmp, _, _, fingerprint, tree = setup
    path = fake_checkpoint(tmp / "run", tree, fingerprint)
    (path / "run_config.yaml").write_text(dump_run_config(parse_run_config(tree)))
    return path


def dry_run(capsys, config, *args):
    code = main(["--config", str(config), "--dry-run", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_restart_continues_only_the_same_run(setup, capsys):
    """--resume same (the launchers' default): the same config resumes, a layout change too;
    other data (a command that left out output_dir=) is refused naming --resume auto."""
    tmp, config, shards, *_ = setup
    saved_run(setup)
    code, out, err = dry_run(capsys, config, "--resume", "same")
    assert code == 0, err
    assert '"resume_step": 4' in out and "# resume:" not in out
    code, out, err = dry_run(capsys, config, "--resume", "same", "logging.progress_bar=false")
    assert code == 0, err
    assert "# resume: logging.progress_bar true -> false: what is shown and logged only" in out
    other = f"data.sources=[{{manifest: {shards / 'manifest.json'}, weight: 2.0}}]"
    before = snapshot(tmp)
    code, out, err = dry_run(capsys, config, "--resume", "same", other, "train.steps=600")
    assert code == 2 and err.count("\n") == 1, err
    assert f"output_dir={tmp / 'run'} holds a run of another config (step-0000004: " in err
    assert "train.steps, data.sources differ): --resume auto to continue it" in err
    assert snapshot(tmp) == before
    code, out, err = dry_run(capsys, config, "--resume", "auto", other)
    assert code == 0, err
    assert "# resume: data.sources " in out and "new ones start at their beginning" in out


@pytest.mark.parametrize("kind", ["emo", "mle"])
def test_another_loss_kind_is_refused_naming_the_new_run(kind, setup, capsys):
    """A DEL run resumed as EMO failed after the checks with torchrun's traceback; as MLE it
    resumed silently (its log read 'numeric nan')."""
    path = saved_run(setup)
    _, config, *_ = setup
    code, _, err = dry_run(capsys, config, "--resume", "auto", f"loss.kind={kind}")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{path}: saved with loss.kind=del, this run has {kind}: cannot change on resume" in err
    assert (
        f"resume with loss.kind=del, or to train its weights that way, start a new run "
        f"from them: init.megatron={path} and another output_dir" in err
    )
    code, out, err = dry_run(capsys, config, "--resume", "auto", "loss.alpha=0.2")
    assert code == 0, err
    assert "# resume: loss.alpha 0.1 -> 0.2: the loss follows it from the next step" in out


def test_optimizer_settings_and_peak_rate_are_refused_or_restart(setup, capsys):
    saved_run(setup)
    _, config, *_ = setup
    code, _, err = dry_run(capsys, config, "--resume", "auto", "optim.weight_decay=0.1")
    assert code == 2 and "optim.weight_decay=0.01, this run has 0.1: cannot change" in err
    code, _, err = dry_run(capsys, config, "--resume", "auto", "optim.lr=0.001")
    assert code == 2 and "optim.schedule_on_resume=restart applies the new schedule" in err
    code, out, err = dry_run(
        capsys, config, "--resume", "auto", "optim.lr=0.001", "optim.schedule_on_resume=restart"
    )
    assert code == 0, err
    assert "# resume: optim.schedule_on_resume=restart: the schedule of train.steps=300" in out


def test_train_further_continues_the_learning_rate(setup, capsys):
    """train.steps 300 -> 600 at step 4: the rate goes on from the one it had (no jump), the
    dry run says so, and the old behaviour is optim.schedule_on_resume=restart."""
    saved_run(setup)
    _, config, *_ = setup
    code, out, err = dry_run(capsys, config, "--resume", "auto", "train.steps=600")
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("# resume: schedule:")]
    assert len(lines) == 1 and "cosine to optim.min_lr=0.0003 at step 600" in lines[0], out


def test_a_continued_schedule_has_no_jump_and_ends_at_the_floor(tmp_path):
    old = Schedule(total=300, warmup=15, min_ratio=0.1)
    for at in (4, 150, 300):
        new = old.continued(at, total=600, min_ratio=0.1)
        assert new.factor(at) == pytest.approx(old.factor(at), abs=1e-15)
        rates = [new.factor(s) for s in range(at, 601)]
        assert all(b <= a + 1e-15 for a, b in itertools.pairwise(rates))
        assert rates[-1] == pytest.approx(0.1)
        jumps = [abs(b - a) for a, b in itertools.pairwise(rates)]
        assert max(jumps) < 0.01  # the old schedule, restarted, jumps by 0.5 at step 150
        (tmp_path / "schedule.json").write_text(
            new.text()
        )  # what a checkpoint holds gives the same function back
        assert saved_schedule(tmp_path) == new


@pytest.mark.slow
def test_train_further_through_the_real_run(synth_tokenizer, synth_shards, tmp_path):
    """Issue 27, case 3 (on main the rate jumped at the first step after the resume, from
    the floor 0.0001 to 0.00038 here): continued by default and said at the start; the old
    behaviour with optim.schedule_on_resume=restart; a continued run resumed unchanged
    follows the schedule it was saved with, bit for bit (one process, 4 short runs)."""
    from ..distributed.launcher import run_torchrun

    output = run_torchrun(
        "schedule_resume.py", 1, str(synth_tokenizer), str(synth_shards), str(tmp_path)
    )

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines)}

    first, continued, restarted, again = (
        rows(n) for n in ("first", "continued", "restarted", "again")
    )
    assert first[4]["lr"] == pytest.approx(1e-4)  # the end of a 4-step cosine
    assert [continued[s]["lr"] for s in range(5, 9)] == pytest.approx([1e-4] * 4)
    assert restarted[5]["lr"] == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * 5 / 8)))
    assert (
        "del-train: resume: schedule: the learning rate continues from 0.0001 (step 4), "
        "cosine to optim.min_lr=0.0001 at step 8" in output
    )
    assert "del-train: resume: optim.schedule_on_resume=restart: the schedule of" in output
    for step in (7, 8):  # from the continued run's step 6: its schedule and its losses
        assert again[step]["lr"] == continued[step]["lr"]
        assert again[step]["loss"] == continued[step]["loss"]


def test_the_docs_name_every_row():
    """docs/checkpoints.md's table of every config field stays the code's."""
    from ..distributed.launcher import ROOT

    doc = (ROOT / "docs" / "checkpoints.md").read_text()
    section = doc.split("### Every field of the run config", 1)[1].split("### ", 1)[0]
    named = {
        f"model.{n}"
        for n in section.split("`model.*` (", 1)[1].split(")", 1)[0].replace("`", "").split(", ")
    }
    missing = [p for p in TABLE if f"`{p}`" not in section and p not in named]
    assert missing == []
