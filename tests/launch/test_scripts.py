"""The launch scripts outside SLURM: the container entrypoint's environment handling (no
container needed), launch/torchrun.sh (arguments, dry run, and a stop by SIGTERM that saves
and exits 75), and the one exit status they share with del-train."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from del_megatron.cli.train import EXIT_STOPPED

from ..distributed.launcher import ROOT, torchrun_env

ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
VENV_BIN = str(Path(sys.executable).parent)


def entrypoint(*args: str, **env: str | None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PATH": VENV_BIN + os.pathsep + os.environ["PATH"]}
    for key, value in env.items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    return subprocess.run(
        ["bash", str(ENTRYPOINT), *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


SHOW_ENV = ("python3", "-c", "import os; print(os.environ['HOME'], os.environ['USER'])")


def test_entrypoint_keeps_a_writable_home_and_user():
    proc = entrypoint(*SHOW_ENV, HOME="/tmp", USER="someone")
    assert proc.stdout.split() == ["/tmp", "someone"]


@pytest.mark.parametrize("home", [None, "/nonexistent/home"], ids=["unset", "missing"])
def test_entrypoint_replaces_an_unusable_home(home):
    proc = entrypoint(*SHOW_ENV, HOME=home, USER=None)
    got_home, got_user = proc.stdout.split()
    assert got_home == f"/tmp/del-home-{os.getuid()}" and Path(got_home).is_dir()
    assert got_user  # a name for getpass.getuser(), from the passwd entry or the uid


def test_entrypoint_reads_a_home_that_is_no_directory_as_unusable(tmp_path):
    home = tmp_path / "home"
    home.write_text("")
    proc = entrypoint(*SHOW_ENV, HOME=str(home))
    assert proc.stdout.split()[0] == f"/tmp/del-home-{os.getuid()}"


def test_entrypoint_commands():
    assert "usage: del-train" in entrypoint().stdout  # no command: del-train's help
    proc = entrypoint("--config", "/nowhere/run.yaml")  # an option: del-train's
    assert proc.returncode == 2
    assert proc.stderr.strip() == "del-train: error: config file not found: /nowhere/run.yaml"
    proc = entrypoint("bash", "-c", "exit 7")  # anything else, as given
    assert proc.returncode == 7


def test_the_stopped_status_is_one_fact():
    for script in ("launch/slurm/train.sbatch", "launch/torchrun.sh"):
        found = re.findall(r"^STOPPED=(\d+)", (ROOT / script).read_text(), flags=re.M)
        assert found == [str(EXIT_STOPPED)], script


def test_docker_files_fit_together():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "COPY docker/entrypoint.sh /usr/local/bin/del-entrypoint" in dockerfile
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", dockerfile, flags=re.M)
    assert re.search(r"^ARG BASE_IMAGE=nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3$", dockerfile, re.M)
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    service = compose["services"]["train"]
    assert service["entrypoint"][0] == "/usr/local/bin/del-entrypoint"
    assert service["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    ignored = (ROOT / ".dockerignore").read_text()
    for copied in re.findall(r"^COPY (\S+)", dockerfile, flags=re.M):
        assert f"!{copied.rstrip('/')}" in ignored.replace("/\n", "\n"), copied


def torchrun_sh(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "launch/torchrun.sh", *args],
        cwd=ROOT,
        env={**torchrun_env(), "DEL_PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_torchrun_sh_arguments():
    proc = torchrun_sh(
        "--dry-run", "--nproc-per-node", "2", "configs/tiny_cpu.yaml", "train.steps=3"
    )
    assert proc.returncode == 0, proc.stderr
    assert "--standalone --nproc-per-node=2" in proc.stdout
    assert (
        "-m del_megatron.cli.train --config configs/tiny_cpu.yaml --resume auto train.steps=3"
        in (proc.stdout)
    )
    for args, message in (
        (["--nproc-per-node", "0", "configs/tiny_cpu.yaml"], "must be a positive integer"),
        (["configs/nowhere.yaml"], "config file not found: configs/nowhere.yaml"),
        (["--bogus", "configs/tiny_cpu.yaml"], "unknown option --bogus"),
        ([], "usage:"),
    ):
        proc = torchrun_sh(*args)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


@pytest.mark.slow
def test_torchrun_sh_sigterm_saves_and_exits_stopped(tmp_path, synth_tokenizer, synth_shards):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            "bash",
            "launch/torchrun.sh",
            "--nproc-per-node",
            "2",
            "configs/tiny_cpu.yaml",
            f"data.tokenizer={synth_tokenizer}",
            f"data.sources=[{{manifest: {synth_shards}}}]",
            "eval.sources=[]",
            "train.steps=400",
            "logging.wandb=disabled",
            f"output_dir={out}",
        ],
        cwd=ROOT,
        env={**torchrun_env(), "DEL_PYTHON": sys.executable},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert time.time() < deadline and proc.poll() is None, proc.stderr
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # as `docker stop` does to the container's first process
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_STOPPED, stderr[-3000:]
    assert "stopped on request; run the same command again to continue" in stderr
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert len(saved) == 1
    step = json.loads((saved[0] / "meta.json").read_text())["step"]
    assert f"checkpoint of step {step} saved" in stdout
