"""docs/first-hour.md runs as written: every command block after the quick start (which CI's
main job runs) in order, in a checkout whose runs/tiny/ holds what the quick start leaves
(the session's synthetic corpus, tokenizer and shards), with 4 training steps for 50."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data_tools.build import build_shards

from .distributed.launcher import ROOT, torchrun_env

pytestmark = pytest.mark.slow

DOC = ROOT / "docs" / "first-hour.md"


def blocks() -> list[tuple[str, str]]:
    return re.findall(r"```(bash|python)\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_first_hour_runs(tmp_path, synth_corpus, synth_tokenizer, synth_shards):
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("configs", "examples", "launch"):
        (repo / name).symlink_to(ROOT / name)
    (repo / ".venv").symlink_to(Path(sys.executable).parents[1])
    tiny = repo / "runs" / "tiny"
    (tiny / "shards").mkdir(parents=True)
    shutil.copy(synth_tokenizer, tiny / "tokenizer.model")
    shutil.copytree(synth_shards.parent, tiny / "shards" / "train")
    heldout = [synth_corpus / "heldout.jsonl"]
    build_shards(heldout, tiny / "shards" / "heldout", synth_tokenizer, progress=False)

    found = blocks()
    assert found[0] == ("bash", "bash launch/quickstart.sh\n")  # CI's main job runs it
    assert [lang for lang, _ in found[1:]] == ["bash", "bash", "bash", "bash", "python"]
    for lang, body in found[1:]:
        body = body.replace("train.steps=50", "train.steps=4")
        body = body.replace("step-0000050", "step-0000004")
        command = ["bash", "-euo", "pipefail", "-c", body]
        if lang == "python":
            command = [sys.executable, "-c", body]
        proc = subprocess.run(
            command,
            cwd=repo,
            env=torchrun_env(),
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert proc.returncode == 0, (body, proc.stdout[-2000:], proc.stderr[-3000:])
        if "data-tools inspect" in body:  # §2 promises the digit share and a decoded problem
            assert '"digit_share"' in proc.stdout and "give --tokenizer" not in proc.stdout
            assert "prompt (not trained on)" in proc.stdout, proc.stdout[-2000:]
