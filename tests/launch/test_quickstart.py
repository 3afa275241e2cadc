"""launch/quickstart.sh around its steps, with the slow ones stubbed (CI runs the real main
job): mistakes are refused before minutes of set-up and data, a re-run moves the previous
run's results aside instead of deleting them, and the ranks start through torchrun.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..distributed.launcher import ROOT, torchrun_env

STUB = "#!/usr/bin/env bash\n"
STUBS = {
    "setup_env.sh": STUB + "exit 0\n",
    "tiny_data.sh": STUB + 'mkdir -p "$1/shards"; touch "$1/data-generated"\n',
    # what the real launcher leaves: a checkpoint and the metrics of a run
    "torchrun.sh": STUB + 'echo "$@" > "$RUN/torchrun-args"\n'
    'mkdir -p "$RUN/checkpoints/step-0000003"; echo "{}" > "$RUN/metrics.jsonl"\n',
}


def quickstart(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """A copy of the repository's launch/ with the slow steps stubbed, run as a user would."""
    repo = tmp_path / "repo"
    if not repo.exists():
        (repo / "launch").mkdir(parents=True)
        shutil.copy(ROOT / "launch" / "quickstart.sh", repo / "launch")
        for name, text in STUBS.items():
            (repo / "launch" / name).write_text(text)
        (repo / "configs").symlink_to(ROOT / "configs")
        (repo / ".venv").symlink_to(Path(sys.executable).parents[1])
    env = {**torchrun_env(), "RUN": str(tmp_path / "run")}
    return subprocess.run(
        ["bash", "launch/quickstart.sh", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_missing_gsm8k_file_is_refused_at_once():
    proc = subprocess.run(
        ["bash", "launch/quickstart.sh", "--gsm8k", "../shared/nowhere/train.jsonl"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "quickstart: --gsm8k ../shared/nowhere/train.jsonl: no such file (a few problems ship "
        "in examples/gsm8k/train.jsonl; examples/gsm8k/README.md says where the full set is)"
    ]
    assert (ROOT / "examples" / "gsm8k" / "train.jsonl").is_file()
    assert "MIT License" in (ROOT / "examples" / "gsm8k" / "LICENSE").read_text()


def test_a_typo_in_an_override_is_refused_before_the_data(tmp_path):
    proc = quickstart(tmp_path, "train.stpes=100")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "del-train: error: train.stpes: unknown field; did you mean train.steps?"
    ]
    assert not (tmp_path / "run" / "data-generated").exists()


def test_a_rerun_moves_the_previous_results_aside(tmp_path):
    first = quickstart(tmp_path, "train.steps=3")
    assert first.returncode == 0, first.stderr
    args = (tmp_path / "run" / "torchrun-args").read_text()
    assert args.startswith("--nproc-per-node 2 configs/tiny_cpu.yaml ")  # torchrun.sh's port
    assert args.rstrip().endswith("train.steps=3")  # the user's overrides last
    (tmp_path / "run" / "checkpoints" / "mine.txt").write_text("a note of the user's")
    second = quickstart(tmp_path, "train.steps=3")
    assert second.returncode == 0, second.stderr
    [previous] = (tmp_path / "run").glob("previous-*")
    assert f"the previous run's checkpoints and metrics moved to {previous}" in second.stdout
    assert (previous / "checkpoints" / "mine.txt").read_text() == "a note of the user's"
    assert (previous / "checkpoints" / "step-0000003").is_dir()
    assert (previous / "metrics.jsonl").is_file()
    assert oct(previous.stat().st_mode & 0o777) == oct(0o777 & ~_umask())
    assert "to train this run further: bash launch/torchrun.sh --nproc-per-node 2" in second.stdout


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
