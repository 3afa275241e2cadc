"""The README's promises: its Quick start is what CI runs; its Python examples run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
NOT_RUN = "<!-- not run"


def _runnable_python_blocks() -> list[str]:
    blocks = []
    for match in re.finditer(r"```python\n(.*?)```", README, flags=re.S):
        preceding = README[: match.start()].rstrip().splitlines()[-1]
        if not preceding.startswith(NOT_RUN):
            blocks.append(match.group(1))
    return blocks


def test_quick_start_has_one_bash_block_whose_test_line_ci_runs():
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    lines = [line.strip() for line in blocks[0].splitlines() if line.strip()]
    assert lines == ["bash launch/quickstart.sh", "bash launch/test.sh"]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci_lines[-1] == lines[1]  # CI ends with the README's test command
    assert any(
        line.endswith("launch/quickstart.sh train.steps=30 train.log_interval=10")
        for line in ci_lines
    )  # and runs a shortened main job first


def _example(index: int, tmp_path: Path) -> Path:
    script = tmp_path / "example.py"
    script.write_text(_runnable_python_blocks()[index])
    return script


def _run(command: list[str]) -> subprocess.CompletedProcess:
    from tests.distributed.launcher import torchrun_env

    env = torchrun_env()
    env.pop("PYTHONWARNINGS")  # the console as a user sees it: every warning shown
    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env, check=False
    )


@pytest.mark.parametrize("index", range(len(_runnable_python_blocks())))
def test_python_example_runs(index, tmp_path):
    proc = _run([sys.executable, str(_example(index, tmp_path))])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stderr  # nothing the user cannot act on


TENSOR_PARALLEL = [
    index
    for index, block in enumerate(_runnable_python_blocks())
    if "initialize_model_parallel" in block
]


@pytest.mark.slow
@pytest.mark.parametrize("index", TENSOR_PARALLEL)
def test_python_example_runs_at_tensor_parallel_2(index, tmp_path):
    """The README's promise for the model example: `torchrun --nproc_per_node=2` runs it at
    TP 2, where the padded vocabulary leaves rank 1 no real column; one line of metrics."""
    from tests.distributed.launcher import free_port

    assert "torchrun --nproc_per_node=2" in README
    proc = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(_example(index, tmp_path)),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(proc.stdout.splitlines()) == 1, proc.stdout  # printed once, by rank 0
    assert "Warning" not in proc.stderr, proc.stderr


# Programs a user's system brings (or a cluster does); everything else we print as a command
# must be installed by launch/setup_env.sh into the virtual environment.
SYSTEM_PROGRAMS = {"bash", "sbatch", "scancel", "docker", "cd", "git", "python", "export"}


def _commands_in_docs() -> list[tuple[str, str]]:
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = [w for w in line.split("#", 1)[0].split() if "=" not in w]
                if words:
                    found.append((page.name, words[0]))
    return found


def test_every_command_we_print_is_installed():
    venv_bin = Path(sys.executable).parent
    for page, program in _commands_in_docs():
        if program not in SYSTEM_PROGRAMS:
            name = program.removeprefix(".venv/bin/")
            assert (venv_bin / name).exists(), f"{page}: {program} is not installed"
    # huggingface_hub 2.x installs `hf` and no longer `huggingface-cli`: no page, config or
    # message of ours may print the old name
    for path in [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("configs/*.yaml")]:
        assert "huggingface-cli" not in path.read_text(), path
    for path in [*ROOT.glob("del_megatron/**/*.py"), *ROOT.glob("launch/**/*.sh")]:
        assert "huggingface-cli" not in path.read_text(), path


def test_one_exit_status_for_a_stop():
    """A stop by signal exits 75 (del-train's EXIT_STOPPED) wherever the README says it."""
    from del_megatron.cli.train import EXIT_STOPPED

    flat = " ".join(README.split())
    assert not re.search(r"SIG(TERM|USR1)[^.;]{0,60}exits? 0", flat)
    assert f"exit {EXIT_STOPPED}" in flat


def test_every_code_block_says_what_it_needs():
    """Each fenced block of the README is introduced by what it needs (or why it is not
    run), in the text just before it."""
    for match in re.finditer(r"```(bash|python)\n", README):
        before = README[: match.start()][-400:]
        assert "Needs" in before or "needs" in before, README[match.start() : match.start() + 80]
