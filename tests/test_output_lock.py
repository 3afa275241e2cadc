"""The one lock of an output (del_megatron/outputs.py), held by a real other process: every
command that writes an output refuses to write beside it, naming that process."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

HOLD = """
import sys, time
from pathlib import Path
from del_megatron.outputs import output_lock
with output_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def held(tmp_path):
    """hold(path): another process holding path's lock until the test ends; its pid."""
    procs = []

    def hold(path: Path) -> int:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc.pid

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def test_every_writer_refuses_an_output_another_process_holds(tmp_path, held, capsys):
    from del_megatron.cli.convert import main as convert
    from del_megatron.cli.eval import main as evaluate

    where = f"being written by another process (host {socket.gethostname()}, pid"
    from .models.tiny_hf import tiny_hf_model

    tiny_hf_model("llama-mha", tmp_path / "hf")
    pid = held(tmp_path / "m" / "model")  # hf-to-megatron writes <out>/model
    argv = ["hf-to-megatron", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m")]
    assert convert(argv) == 2
    assert f"{where} {pid})" in capsys.readouterr().err
    pid = held(tmp_path / "eval")
    problems = tmp_path / "problems.jsonl"
    problems.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    argv = ["/nonexistent/model", "--gsm8k", str(problems), "--shots", "0"]
    assert evaluate([*argv, "--out", str(tmp_path / "eval")]) == 2
    assert f"{where} {pid})" in capsys.readouterr().err  # before the model is looked at
