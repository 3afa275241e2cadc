"""bench/gpu_acceptance.sh without a GPU (its no-GPU exit, --dry-run, --only) and the pure parts
of its helper bench/gpu_acceptance.py (rows, table, JSON, weights and loss comparison, figures
of the benchmarks' output). The CPU smoke run (--cpu-smoke) is not part of the suite: it
trains several tiny runs, minutes on CI's two cores."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ..distributed.launcher import ROOT

SCRIPT = ROOT / "bench" / "gpu_acceptance.sh"
CHECKS = [
    "env",
    "transformer-engine",
    "data",
    "train-tp1",
    "train-fused-tp1",
    "stop-resume-tp1",
    "train-tp2",
    "train-fused-tp2",
    "stop-resume-tp2",
    "init-hf",
    "del-eval",
    "bench-hook-ce",
    "bench-hook-ce-fp32",
    "bench-fused",
    "bench-train-step",
]


def _helper():
    spec = importlib.util.spec_from_file_location(
        "gpu_acceptance", ROOT / "bench" / "gpu_acceptance.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


helper = _helper()


def run_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The script with an nvidia-smi that lists no GPU first on PATH: the no-GPU path, also
    on a machine that has one."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path)}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_no_gpu_skips_every_check_and_exits_0(tmp_path):
    out = run_script(tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"no GPU: {len(CHECKS)} checks skipped")
    assert not (tmp_path / "gpu_acceptance.json").exists()  # nothing ran


def listed(stdout: str) -> list[str]:
    """The check names of a --dry-run listing (the lines that are not indented)."""
    return [
        line.split(" (time limit")[0]
        for line in stdout.splitlines()[1:]
        if line and not line.startswith(" ")
    ]


def test_dry_run_lists_every_check_with_its_commands(tmp_path):
    out = run_script(tmp_path, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert listed(out.stdout) == CHECKS
    text = out.stdout
    # the user's entry points, the device and today's benchmark flags
    assert (
        "bash launch/torchrun.sh --nproc-per-node 1 configs/tiny_cpu.yaml train.device=cuda" in text
    )
    assert "bash launch/torchrun.sh --nproc-per-node 2 " in text  # the TP 2 checks
    assert "loss.fused_output=true" in text
    assert "-m del_megatron.cli.convert megatron-to-hf" in text
    assert "-m del_megatron.cli.eval compare" in text
    assert "init.hf=" in text and "model.tie_word_embeddings=true" in text
    assert "bench/loss_fused.py --device cuda --dtype bf16 --tp 1 --tokens 16384" in text
    assert "bench/train_step.py --gpu-7b" in text
    assert "bench/loss_tp.py --device cuda --dtype bf16 --vocab 152064" in text
    assert "SIGUSR1" in text


def test_dry_run_cpu_smoke_and_only(tmp_path):
    out = run_script(tmp_path, "--dry-run", "--cpu-smoke", "--only", "del-eval")
    assert out.returncode == 0, out.stderr
    assert listed(out.stdout) == ["env", "data", "train-tp1", "del-eval"]  # with what it needs
    assert "train.device=cpu" in out.stdout and "cuda" not in out.stdout
    assert "--agree-within 1e-4" in out.stdout  # on the CPU every del-eval metric, as .ci/run


def test_unknown_check_is_refused(tmp_path):
    out = run_script(tmp_path, "--only", "train-tp3")
    assert out.returncode == 2
    assert "unknown check 'train-tp3'" in out.stderr


# ---- the helper ----------------------------------------------------------------------------


def test_rows_from_exit_status_notes_and_log():
    notes = {"status": "pass", "note": "fine", "figures": {"x": 1.5}}
    row = helper.make_row("a", rc=0, seconds=1.234, notes=notes)
    assert row == {
        "name": "a",
        "status": "pass",
        "seconds": 1.2,
        "note": "fine",
        "figures": {"x": 1.5},
    }
    log = "starting\nRuntimeError: CUDA out of memory\ncleanup\n"
    failed = helper.make_row("b", rc=1, seconds=2.0, notes=None, log=log)
    assert failed["status"] == "fail"
    assert failed["note"] == "exit 1: RuntimeError: CUDA out of memory"
    assert helper.make_row("c", rc=124, seconds=9.0, notes=notes)["note"].startswith(
        "ran past its time limit"
    )
    # a failing verdict of the check itself is its note
    said = helper.make_row("d", rc=1, seconds=1.0, notes={"status": "fail", "note": "differs"})
    assert said["note"] == "differs"
    # a check may skip itself (Transformer Engine not installed) and exit 0
    own = helper.make_row("e", rc=0, seconds=0.1, notes={"status": "skipped", "note": "no TE"})
    assert own["status"] == "skipped"
    skipped = helper.make_row("f", rc=None, seconds=None, notes=None, skipped="needs 2 GPUs")
    assert skipped["status"] == "skipped" and skipped["seconds"] is None


def test_table_and_json(tmp_path):
    rows = [
        helper.make_row(
            "env", rc=0, seconds=1.0, notes={"note": "ok", "figures": {"torch": "2.11"}}
        ),
        helper.make_row("train-tp2", rc=None, seconds=None, notes=None, skipped="needs 2 GPUs"),
        helper.make_row("bench", rc=0, seconds=3.0, notes={"figures": {"ratio": 1.23456}}),
    ]
    table = helper.render_table(rows)
    lines = table.splitlines()
    assert lines[0].split() == ["check", "status", "s", "note", "/", "figures"]
    assert "ok; torch=2.11" in table and "ratio=1.235" in table
    assert lines[-1] == "2 passed, 0 failed, 1 skipped"
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.json"
    assert (
        helper.main(["table", str(results), "--json", str(out), "--meta", '{"mode": "gpu"}']) == 0
    )
    document = json.loads(out.read_text())
    assert document["mode"] == "gpu" and document["passed"] == 2 and document["skipped"] == 1
    assert [c["name"] for c in document["checks"]] == ["env", "train-tp2", "bench"]
    with results.open("a") as f:
        f.write(json.dumps(helper.make_row("x", rc=1, seconds=1.0, notes=None)) + "\n")
    assert helper.main(["table", str(results)]) == 1  # a failed check fails the script


def write_checkpoint(run: Path, step: int, tensors: dict[str, torch.Tensor], losses: list[float]):
    model = run / "checkpoints" / f"step-{step:07d}" / "model"
    model.mkdir(parents=True)
    save_file(tensors, str(model / "tp00.safetensors"))
    with (run / "metrics.jsonl").open("w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": i, "loss": loss, "tokens_per_s": 100.0 * i}) + "\n")


def test_weights_comparison(tmp_path):
    w = {"a": torch.randn(4, 3).bfloat16(), "b": torch.arange(5.0)}
    write_checkpoint(tmp_path / "x", 3, w, [3.0, 2.0, 1.0])
    write_checkpoint(tmp_path / "y", 3, {k: v.clone() for k, v in w.items()}, [3.0, 2.0, 1.0])
    x, y = (helper.checkpoint_dir(tmp_path / n, 3) for n in "xy")
    assert helper.compare_weights(x, y) == {"bit_equal": True, "max_abs_diff": 0.0, "tensors": 2}
    changed = {**w, "b": torch.arange(5.0) + torch.tensor([0, 0, 0.25, 0, 0])}
    write_checkpoint(tmp_path / "z", 3, changed, [3.0, 2.0, 1.5])
    z = helper.checkpoint_dir(tmp_path / "z", 3)
    result = helper.compare_weights(x, z)
    assert not result["bit_equal"] and result["max_abs_diff"] == 0.25
    write_checkpoint(tmp_path / "n", 3, {"a": w["a"]}, [3.0])
    with pytest.raises(ValueError, match="tensor names differ"):
        helper.compare_weights(x, helper.checkpoint_dir(tmp_path / "n", 3))
    # the stop/resume verdict: bit-equal passes; a difference passes only within tolerance
    notes = tmp_path / "notes.json"
    argv = ["compare-runs", str(tmp_path / "x"), str(tmp_path / "y"), "--steps", "3"]
    assert helper.main([*argv, "--stopped-at", "1", "--notes", str(notes)]) == 0
    assert "bit-equal" in json.loads(notes.read_text())["note"]
    argv[2] = str(tmp_path / "z")
    assert helper.main([*argv, "--stopped-at", "1", "--notes", str(notes)]) == 1
    tolerant = ["--weights-tol", "0.3", "--loss-tol", "0.6", "--notes", str(notes)]
    assert helper.main([*argv, "--stopped-at", "1", *tolerant]) == 0
    verdict = json.loads(notes.read_text())
    assert "not bit-equal: max diff 0.25" in verdict["note"]
    assert verdict["figures"]["loss_max_abs_diff_after_resume"] == 0.5


def test_train_figures(tmp_path):
    write_checkpoint(tmp_path / "run", 3, {"a": torch.zeros(1)}, [3.0, 2.0, 1.0])
    write_checkpoint(tmp_path / "ref", 3, {"a": torch.zeros(1)}, [3.0 + 1e-7, 2.5, 2.0])
    notes = tmp_path / "notes.json"
    argv = ["train-figures", str(tmp_path / "run"), "--steps", "3", "--notes", str(notes)]
    assert helper.main(argv) == 0
    figures = json.loads(notes.read_text())["figures"]
    assert figures["loss_step3"] == 1.0 and figures["tokens_per_s"] == 300.0
    assert helper.main([*argv, "--reference", str(tmp_path / "ref"), "--tol", "1e-6"]) == 0
    assert helper.main([*argv, "--reference", str(tmp_path / "ref"), "--tol", "1e-9"]) == 1
    assert helper.main([*argv[:3], "4", *argv[4:]]) == 1  # a step missing


HOOK_CE = """\
device cuda, bf16, TP 1, logits [8192, 2, 152064] per rank, V=152064, digit targets 15.0%
                     fwd+bwd ms    time  peak MiB, logits peak MiB, logits
                                            handed over   kept by caller
megatron fused CE          12.3  1.000x              9000             9000
hook (kind=del)            14.1  1.146x              9500             9600
hook / megatron fused CE: time 1.146x, peak 1.056x (logits handed over), \
1.067x (logits kept by the caller)
"""
FUSED = """\
device cuda, bf16, TP 1, V=152064 (V/tp 152064), h=1536, 16384 tokens, chunk 1024, torch 2.11
           fwd+bwd s    time  peak MiB  memory
megatron        0.05  1.000x     19000  1.000x
fused           0.06  1.200x      1200  0.063x
fused / megatron: time 1.200x, peak memory 0.063x
chunk    512: time 1.300x, peak 900 MiB (0.047x)
"""
TRAIN_STEP = """\
GPU 4-layer Llama-2-7B widths, TP 1, DP 1, 16384 tokens a step
kind     step ms   ratio   tokens/s  TFLOP/s    MFU
mle        800.0  1.000x      20480    400.0  0.404
del        840.0  1.050x      19505    381.0  0.385
"""


def test_benchmark_figures():
    hook = helper.bench_figures("hook-ce", HOOK_CE)
    assert hook == {
        "hook_over_megatron_time": 1.146,
        "hook_over_megatron_peak": 1.056,
        "hook_over_megatron_peak_logits_kept": 1.067,
        "megatron_ms": 12.3,
        "hook_ms": 14.1,
    }
    fused = helper.bench_figures("fused", FUSED)
    assert fused["fused_over_megatron_time"] == 1.2 and fused["chunk512_peak"] == 0.047
    step = helper.bench_figures("train-step", TRAIN_STEP)
    assert step["del_over_mle"] == pytest.approx(1.05) and step["mfu_del"] == 0.385
    assert step["tflops_del"] == 381.0 and step["tokens_per_s_del"] == 19505
    assert helper.bench_figures("fused", "a new format\n") == {}  # then the log's last line


def test_failure_line():
    assert helper.failure_line("a\nValueError: bad\nb\n") == "ValueError: bad"
    assert helper.failure_line("one\ntwo\n\n") == "two"
    assert helper.failure_line("") == "no output"


def test_eval_agreement():
    ours = {"loss": 4.0, "digit_entropy": 2.0, "digit_acc": 0.5, "number_abs_error": 100.0}
    close = {**ours, "loss": 4.0 + 4e-3, "digit_acc": 0.45, "number_abs_error": 180.0}
    beyond, figures = helper.eval_agreement(ours, close, 2e-3 / 2)
    assert beyond == []  # 4e-3 <= 1e-3 * 4: relative to |value|; flips are reported only
    assert figures["digit_acc_diff"] == pytest.approx(0.05)
    assert figures["number_abs_error_diff"] == 80.0
    beyond, _ = helper.eval_agreement(ours, {**close, "digit_entropy": 2.1}, 1e-3)
    assert beyond == ["digit_entropy 2 vs 2.1"]
    assert helper.eval_agreement(ours, {"loss": 4.0}, 1.0)[0][0] == "digit_entropy missing"
