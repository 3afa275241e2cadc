"""del-eval's mistakes: one line on stderr and exit status 2, and every input read or
checked before a model loads (a wrong file must not cost the minutes of loading a 7B)."""

from __future__ import annotations

import json
import os

import pytest

from del_megatron.cli.eval import main
from del_megatron.errors import UserError
from del_megatron.evaluation.report import read_curve

NO_MODEL = "/nonexistent/model"


def fails(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main([str(a) for a in argv]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err and "Traceback" not in err, err
    return err.splitlines()[-1]


def test_nothing_to_evaluate_and_bad_templates(capsys):
    assert "nothing to evaluate" in fails(capsys, NO_MODEL)
    assert "--template" in fails(capsys, NO_MODEL, "--gsm8k", "x.jsonl", "--template", "Q:")
    line = fails(capsys, NO_MODEL, "--gsm8k", "x.jsonl", "--template", "{question} {answer}")
    assert "--template" in line and "braces" in line


def test_inputs_are_checked_before_the_model_loads(capsys, tmp_path):
    bad = tmp_path / "problems.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "no answer"}\n')
    line = fails(capsys, NO_MODEL, "--gsm8k", bad, "--shots", "0")
    assert f"{bad} line 2" in line
    assert "problems.jsonl" in fails(capsys, NO_MODEL, "--gsm8k", tmp_path / "problems.jsonl")
    missing = tmp_path / "missing.jsonl"
    assert str(missing) in fails(capsys, NO_MODEL, "--gsm8k", missing)
    one = tmp_path / "one.jsonl"
    one.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    assert "no problems left after 4 shots" in fails(capsys, NO_MODEL, "--gsm8k", one)
    manifest = tmp_path / "heldout" / "manifest.json"
    assert str(manifest) in fails(capsys, NO_MODEL, "--heldout", manifest)
    manifest.parent.mkdir()
    manifest.write_text('{"version": 1}')
    assert "not a shard manifest" in fails(capsys, NO_MODEL, "--heldout", manifest)
    # with good inputs, the model is what is wrong
    line = fails(capsys, tmp_path, "--gsm8k", one, "--shots", "0")
    assert "neither a del-megatron checkpoint" in line


def write_results(directory, numeric=None, **extra):
    directory.mkdir(parents=True, exist_ok=True)
    result = {"model": "m", "kind": "hf", **extra}
    if numeric is not None:
        result["numeric"] = numeric
    (directory / "results.json").write_text(json.dumps(result))
    return directory


def test_compare_refuses_what_it_cannot_read(capsys, tmp_path):
    a = write_results(tmp_path / "a", {"loss": 1.0, "digit_acc": 0.5})
    out = tmp_path / "out"
    assert "results.json" in fails(capsys, "compare", a, tmp_path / "absent", "--out", out)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "results.json").write_text('{"model": ')
    assert "not readable results" in fails(capsys, "compare", a, tmp_path / "broken", "--out", out)
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "results.json").write_text("[1, 2]")
    assert "not del-eval results" in fails(capsys, "compare", a, tmp_path / "list", "--out", out)
    b = write_results(tmp_path / "b", {"loss": 1.0})
    line = fails(capsys, "compare", a, b, "--out", out, "--agree-within", "1e-4")
    assert "digit_acc is missing" in line
    c = write_results(tmp_path / "c", generation={"accuracy": 0.1})
    line = fails(capsys, "compare", a, c, "--out", out, "--agree-within", "1e-4")
    assert "needs two or more results with teacher-forced metrics" in line
    d = write_results(tmp_path / "d", {"loss": 1.1, "digit_acc": 0.5})
    line = fails(capsys, "compare", a, d, "--out", out, "--agree-within", "1e-4")
    assert "loss differs beyond" in line
    (a / "metrics.jsonl").write_text('{"step": 1, "ce": 2.0}\nnot json\n')
    assert "metrics.jsonl line 2: not JSON" in fails(capsys, "compare", a, d, "--out", out)
    assert not out.exists()  # nothing written by a comparison that failed


def test_a_metrics_line_cut_by_a_kill_is_left_out(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "ce": 2.0}\n{"event": "resume"}\n{"step": 2, "ce": 1.')
    assert read_curve(path) == [(1, 2.0)]


def test_help_names_compare(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "del-eval compare RESULT_DIR" in capsys.readouterr().out


def test_windows_fit_the_model_and_are_shown(capsys, tmp_path):
    """--seq-len past the model's positions is refused before it loads; the table names the
    window length; compare notes results measured on different windows."""
    from del_megatron.evaluation.generation import fitting_prompts
    from del_megatron.evaluation.heldout import window_length
    from del_megatron.evaluation.report import markdown_table

    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 256}')
    one = tmp_path / "one.jsonl"
    one.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    line = fails(capsys, model, "--gsm8k", one, "--shots", "0", "--seq-len", "1024")
    assert line == (
        "del-eval: error: --seq-len 1024 exceeds the model's max_position_embeddings=256: "
        "choose --seq-len 256 or less"
    )
    assert window_length(None, 256) == 256 and window_length(None, 32768) == 2048
    with pytest.raises(UserError, match="use fewer --shots or a smaller --max-new-tokens"):
        fitting_prompts([400, 530], 256, 4, 256)  # 4 shots on the tiny model: nothing fits
    assert fitting_prompts([40, 200, 230], 56, 0, 256) == [0, 1]
    assert "| windows (tokens) | 256 |" in markdown_table({"numeric": {"seq_len": 256}})
    a = write_results(tmp_path / "a", {"loss": 1.0, "seq_len": 128})
    b = write_results(tmp_path / "b", {"loss": 1.1, "seq_len": 256})
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "c")]) == 0
    note = "note: the teacher-forced metrics come from windows of different lengths (a 128, b 256"
    assert note in capsys.readouterr().out
    assert note in (tmp_path / "c" / "comparison.md").read_text()


@pytest.fixture
def tiny_models(tmp_path, synth_tokenizer):
    """A Hugging Face directory whose vocabulary is the tokenizer's (800), one whose
    config.vocab_size (120) is smaller than its tokenizer's, and the latter converted to a
    del-megatron weights directory (both 64 positions)."""
    import shutil

    from del_megatron.cli.convert import main as convert

    from ..models.tiny_hf import tiny_hf_model

    tiny_hf_model("llama-mha", tmp_path / "fits", vocab_size=800)
    tiny_hf_model("llama-mha", tmp_path / "small")
    for name in ("fits", "small"):
        shutil.copy(synth_tokenizer, tmp_path / name / "tokenizer.model")
    hf_to_megatron = ["hf-to-megatron", "--hf", tmp_path / "small", "--out", tmp_path / "weights"]
    assert convert([str(a) for a in hf_to_megatron]) == 0
    assert (tmp_path / "weights" / "model" / "tokenizer.model").is_file()
    return tmp_path


def test_a_model_smaller_than_its_tokenizer_is_refused_before_it_loads(
    capsys, tiny_models, synth_shards
):
    """Before: an IndexError traceback of 65 lines from inside the forward (Hugging Face) or
    the embedding (checkpoint); now one line naming both sizes, for both backends."""
    for model, where in (("small", "small/config.json"), ("weights", "weights/model/arch.json")):
        line = fails(capsys, tiny_models / model, "--heldout", synth_shards, "--quiet")
        assert where in line, line
        assert "vocab_size=120 is smaller than its tokenizer's 800 tokens" in line, line


def test_windows_past_the_positions_are_refused_for_both_backends(
    capsys, tiny_models, synth_shards
):
    for model in ("fits", "weights"):
        line = fails(capsys, tiny_models / model, "--heldout", synth_shards, "--seq-len", "65")
        assert line.endswith(
            "--seq-len 65 exceeds the model's max_position_embeddings=64: choose --seq-len 64 "
            "or less"
        ), line


def test_heldout_metrics_of_a_hugging_face_model(capsys, tiny_models, synth_shards, tmp_path):
    """The teacher-forced loop end to end in this process: the default window is the model's
    64 positions, --max-batches counts batches, the metrics are read."""
    out = tmp_path / "out"
    argv = ["--heldout", synth_shards, "--max-batches", "2", "--batch-size", "2", "--quiet"]
    assert main([str(a) for a in [tiny_models / "fits", *argv, "--out", out]]) == 0
    numeric = json.loads((out / "results.json").read_text())["numeric"]
    assert numeric["seq_len"] == 64 and numeric["batches"] == 2
    assert numeric["tokens"] == 2 * 2 * 64 and numeric["digits"] > 0
    assert 0 < numeric["loss"] < 20 and "| windows (tokens) | 64 |" in capsys.readouterr().out


def test_an_output_that_cannot_be_written_is_refused_before_the_work(capsys, tmp_path, tmpfs):
    """--out on a read-only filesystem, or naming a file: refused before the model loads
    (before: the whole evaluation ran, then an OSError traceback, the results never shown)."""
    one = tmp_path / "one.jsonl"
    one.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    read_only = tmpfs("64k", read_only=True)
    argv = [NO_MODEL, "--gsm8k", one, "--shots", "0", "--out"]
    line = fails(capsys, *argv, read_only / "eval")
    assert f"--out {read_only}/eval: cannot write there (Read-only file system)" in line, line
    line = fails(capsys, *argv, one)
    assert f"--out {one}: exists and is not a directory" in line, line
    line = fails(capsys, "compare", tmp_path, "--out", read_only / "cmp")
    assert "cannot write there (Read-only file system)" in line, line


def test_results_are_shown_before_they_are_written(
    capsys, tiny_models, synth_shards, tmpfs
):
    """A write that fails after the work (here the disk has room for the lock, not for the
    results) is one line, and the table is on the console already (before: an OSError
    traceback, no table)."""
    small = tmpfs("64k")
    out = small / "out"
    out.mkdir()
    filler = os.open(small / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(filler, b"x" * 4096):
            pass
    except OSError:  # full: then one page freed, which the lock file takes
        os.ftruncate(filler, os.fstat(filler).st_size - 4096)
    os.close(filler)
    argv = ["--heldout", synth_shards, "--max-batches", "1", "--batch-size", "1", "--quiet"]
    assert main([str(a) for a in [tiny_models / "fits", *argv, "--out", out]]) == 2
    captured = capsys.readouterr()
    assert "| windows (tokens) | 64 |" in captured.out
    assert f"{out}: no space left on the device" in captured.err
    assert "Traceback" not in captured.err


def test_a_step_that_does_not_exist_is_named_with_the_steps_that_do(capsys, tmp_path):
    """Issue 27: it was 'neither a del-megatron checkpoint nor a Hugging Face model'."""
    root = tmp_path / "run" / "checkpoints"
    for step in (100, 200):
        (root / f"step-{step:07d}").mkdir(parents=True)
        (root / f"step-{step:07d}" / "meta.json").write_text("{}")
    one = tmp_path / "one.jsonl"
    one.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    missing = root / "step-0000300"
    line = fails(capsys, missing, "--gsm8k", one, "--shots", "0")
    assert line == (
        f"del-eval: error: {missing}: does not exist ({root} holds step-0000100, step-0000200)"
    )
    line = fails(capsys, tmp_path / "x", "--gsm8k", one, "--shots", "0")
    assert line == f"del-eval: error: {tmp_path / 'x'}: does not exist"


def test_problems_must_state_their_final_answer(capsys, tmp_path):
    """Issue 27: an answer without '#### N' was taken whole as the gold answer."""
    from del_megatron.evaluation.generation import gold_of

    assert gold_of("She has 3 + 15 = 18 eggs.\nThe answer is 18.") == "18"
    assert gold_of("42") == "42"  # the synthetic corpus's held-out answers
    assert gold_of("She has 18 eggs.") is None
    bad = tmp_path / "problems.jsonl"
    bad.write_text(
        '{"question": "1+1?", "answer": "#### 2"}\n'
        '{"question": "eggs?", "answer": "She has 3 + 15 = 18 eggs."}\n'
    )
    line = fails(capsys, NO_MODEL, "--gsm8k", bad, "--shots", "0")
    assert f"{bad} line 2: the answer states no final answer: end it with '#### N'" in line


def test_a_corpus_given_as_heldout_names_the_build(capsys, tmp_path):
    corpus = tmp_path / "test.jsonl"
    corpus.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    line = fails(capsys, NO_MODEL, "--heldout", corpus)
    assert "not a shard manifest" in line and "`data-tools build FILE -o DIR" in line
