"""The launch scripts outside SLURM: the container entrypoint's environment handling (no
container needed), launch/torchrun.sh (arguments, dry run, and a stop by SIGTERM that saves
and exits 75), and the one exit status they share with del-train."""

from __future__ import annotations

import contextlib
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
from ..utils import each_once

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


def test_entrypoint_names_a_user_id_that_has_no_name():
    """`docker run --user 4242` where the image has no such user: `id -un` prints the number
    and fails, and USER was both ('4242' and 'user4242' on two lines) before; now one name."""
    if os.geteuid() != 0:
        pytest.skip("switching to a user id without a name needs root")
    import pwd

    uid = next(u for u in range(4242, 4342) if not any(p.pw_uid == u for p in pwd.getpwall()))
    proc = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        + ["bash", str(ENTRYPOINT), "printenv", "USER"],
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"user{uid}\n"


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
    # tests/docker runs train-cpu: the GPU service less its GPU request and pinned memory
    cpu = {k: v for k, v in service.items() if k not in ("deploy", "ulimits")}
    assert compose["services"]["train-cpu"] == cpu
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


def tiny_run(tmp_path: Path, tokenizer: Path, manifest: Path) -> list[str]:
    """configs/tiny_cpu.yaml's overrides for the session's synthetic data."""
    return [
        "configs/tiny_cpu.yaml",
        f"data.tokenizer={tokenizer}",
        f"data.sources=[{{manifest: {manifest}}}]",
        "eval.sources=[]",
        "logging.wandb=disabled",
        f"output_dir={tmp_path / 'run'}",
    ]


def test_torchrun_sh_arguments():
    for args, message in (
        (["--nproc-per-node", "0", "configs/tiny_cpu.yaml"], "must be a positive integer"),
        (["configs/nowhere.yaml"], "config file not found: configs/nowhere.yaml"),
        (["--bogus", "configs/tiny_cpu.yaml"], "unknown option --bogus"),
        ([], "usage:"),
    ):
        proc = torchrun_sh(*args)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


def test_torchrun_sh_dry_run_checks_the_run_for_its_process_count(
    tmp_path, synth_tokenizer, synth_shards
):
    """--dry-run is del-train's dry run for N ranks, then the command; without GPUs the
    process count it picks (1) is said, and a TP 2 config is refused for it in one line."""
    run = tiny_run(tmp_path, synth_tokenizer, synth_shards)
    proc = torchrun_sh("--dry-run", "--nproc-per-node", "2", *run, "train.steps=3")
    assert proc.returncode == 0, proc.stderr
    assert '"world_size": 2, "tensor_parallel": 2' in proc.stdout  # the layout for 2 ranks
    command = proc.stdout.split("# command: ", 1)[1]
    assert "--standalone --nproc-per-node=2" in command
    assert "-m del_megatron.cli.train --config configs/tiny_cpu.yaml --resume same" in command
    proc = torchrun_sh("--dry-run", *run, PATH="/usr/bin:/bin")  # no nvidia-smi: no GPU
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "torchrun.sh: no GPU found: 1 process (--nproc-per-node N to choose)",
        "del-train: error: world size 1 is not a multiple of parallel.tensor_parallel=2 "
        "(world size = tensor parallel x data parallel): start 2 processes (bash "
        "launch/torchrun.sh --nproc-per-node 2, also with --dry-run) or set "
        "parallel.tensor_parallel=1",
    ]


def test_launchers_continue_only_a_run_of_the_same_config(tmp_path, synth_tokenizer, synth_shards):
    """Issue 27, case 1: torchrun.sh always resumed (--resume auto), so a command that left out
    output_dir= continued the quick start's run on the user's data. Now both launchers resume
    a run of the same config only (a stop, a requeue: --resume same); another config is one
    line naming --resume auto, which continues it with its changes said."""
    from del_megatron.config import dump_run_config, parse_run_config
    from del_megatron.tokenizer import Tokenizer

    from ..training.test_bad_input import fake_checkpoint

    run = tiny_run(tmp_path, synth_tokenizer, synth_shards)
    tree = yaml.safe_load((ROOT / run[0]).read_text())
    cfg = parse_run_config(tree, run[1:])
    saved = fake_checkpoint(
        tmp_path / "run", cfg.model_dump(mode="json"), Tokenizer(synth_tokenizer).fingerprint
    )
    (saved / "run_config.yaml").write_text(dump_run_config(cfg))
    other = f"data.sources=[{{manifest: {synth_shards}, weight: 3.0}}]"
    refused = (
        f"del-train: error: output_dir={tmp_path / 'run'} holds a run of another config "
        "(step-0000004: data.sources differ): --resume auto to continue it with these "
        "changes, or choose another output_dir"
    )
    proc = torchrun_sh("--dry-run", "--nproc-per-node", "2", *run)  # a restart
    assert proc.returncode == 0 and '"resume_step": 4' in proc.stdout, proc.stderr
    proc = torchrun_sh("--dry-run", "--nproc-per-node", "2", *each_once(*run, other))
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == refused, proc.stderr
    proc = torchrun_sh(
        "--dry-run", "--nproc-per-node", "2", "--resume", "auto", *each_once(*run, other)
    )
    assert proc.returncode == 0 and "# resume: data.sources " in proc.stdout, proc.stderr
    assert "--resume auto" in proc.stdout.split("# command: ", 1)[1]
    proc = sbatch_dry_run(tmp_path, *each_once(*run, other), WORLD_SIZE="2")
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == refused, proc.stderr
    proc = sbatch_dry_run(tmp_path, "--resume", "auto", *each_once(*run, other), WORLD_SIZE="2")
    assert proc.returncode == 0 and "# resume: data.sources " in proc.stdout, proc.stderr


def test_torchrun_sh_a_mistake_is_one_line_and_status_2(tmp_path, synth_tokenizer, synth_shards):
    """A typo in an override: its one line, last, status 2; no torchrun report (the checks
    run once before torchrun starts the ranks), nothing written."""
    run = tiny_run(tmp_path, synth_tokenizer, synth_shards)
    proc = torchrun_sh("--nproc-per-node", "2", *run, "optim.lrr=1")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        "del-train: error: optim.lrr: unknown field; did you mean optim.lr?"
    )
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_torchrun_sh_ends_with_a_ranks_mistake_and_status_2(tmp_path):
    """A mistake a rank meets after the checks (a damaged record mid-run): torchrun reports
    its failure as status 1 in many lines; the script ends with the rank's line and 2. A
    stand-in interpreter plays del-train and torchrun, so no ranks start."""
    python = tmp_path / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'case " $* " in\n'
        '  *" --help "*) exit 0 ;;\n'  # torchrun's --help, read for its options
        '  *" --check "*) echo "del-train: checks passed"; exit 0 ;;\n'
        "esac\n"
        'echo "del-train: error: data.sources: shard-00003.tar: damaged at byte 7" >&2\n'
        'printf "%s\\n" "del-train: error: data.sources: shard-00003.tar: damaged at byte 7" '
        '> "$DEL_USER_ERROR_DIR/rank-1"\n'
        'for i in $(seq 40); do echo "torchrun report line $i" >&2; done\n'
        "exit 1\n"
    )
    python.chmod(0o755)
    proc = torchrun_sh("--nproc-per-node", "2", "configs/tiny_cpu.yaml", DEL_PYTHON=str(python))
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last == "del-train: error: data.sources: shard-00003.tar: damaged at byte 7"
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("del-train-errors.*/rank-1"))


STAND_IN = """#!{python}
# plays del-train's checks, and torchrun with one rank; both log each SIGINT they get (the
# rank: the first is a stop, it goes on as a rank writing its checkpoint; the second ends it)
import os, signal, subprocess, sys, time

def log(line):
    with open(os.environ["LOG"], "a") as f:
        f.write(line + "\\n")

if "--help" in sys.argv or "--check" in sys.argv:
    sys.exit(0)
if "--rank" in sys.argv:
    got = []
    def stop(signum, frame):
        got.append(signum)
        log(f"rank got SIGINT {{len(got)}}")
        if len(got) == 2:
            sys.exit(130)
    signal.signal(signal.SIGINT, stop)
    log("ready")
    while True:
        time.sleep(0.05)
signal.signal(signal.SIGINT, lambda signum, frame: log("torchrun got SIGINT"))
if os.environ.get("RANK_AFTER"):  # a torchrun slow to start its rank (a loaded node)
    log("torchrun up")
    time.sleep(float(os.environ["RANK_AFTER"]))
rank = subprocess.Popen([sys.executable, __file__, "--rank"])
while rank.poll() is None:
    time.sleep(0.05)
sys.exit(rank.returncode)
"""


def as_a_terminal_starts_a_job() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def stand_in_run(tmp_path: Path, **env: str):
    """launch/torchrun.sh on one rank with STAND_IN for the interpreter, as the terminal's
    foreground job (a process group of its own). Yields (proc, logged, said): logged(line)
    waits for the stand-ins to log `line` (60 s) and returns every line logged; said() is
    the script's stderr so far. Whatever is left is killed at the end, the stand-ins in
    their own session too."""
    python, log, errors = tmp_path / "python", tmp_path / "signals", tmp_path / "stderr"
    python.write_text(STAND_IN.format(python=sys.executable))
    python.chmod(0o755)
    # as a terminal's shell starts a job: SIGINT neither ignored nor blocked (both are
    # inherited through exec, and a shell started with SIGINT ignored cannot trap it)
    inherited = (signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, []))
    with errors.open("w") as stderr:
        proc = subprocess.Popen(
            ["bash", "launch/torchrun.sh", "--nproc-per-node", "1", "configs/tiny_cpu.yaml"],
            cwd=ROOT,
            env={**torchrun_env(), "DEL_PYTHON": str(python), "LOG": str(log), **env},
            stderr=stderr,
            start_new_session=True,
            preexec_fn=as_a_terminal_starts_a_job,
        )

    def said() -> str:
        return errors.read_text()

    def logged(line: str) -> list[str]:
        deadline = time.time() + 60
        while not (log.is_file() and line in log.read_text().splitlines()):
            lines = log.read_text().splitlines() if log.is_file() else []
            assert time.time() < deadline and proc.poll() is None, (line, lines, said(), inherited)
            time.sleep(0.05)
        return log.read_text().splitlines()

    try:
        yield proc, logged, said
    finally:
        subprocess.run(["pkill", "-KILL", "-f", str(python)], check=False)
        proc.kill()
        proc.wait()


def test_torchrun_sh_passes_each_ctrl_c_to_the_ranks_once(tmp_path):
    """The terminal (issue 37): a Ctrl-C (SIGINT to the script's process group, as a terminal
    sends it) reaches each rank once, through the script, and torchrun not at all; a second
    ends the ranks. Before: torchrun got it from the terminal too (it turns it into SIGTERMs
    of its own and a traceback), and the script did not pass it on. A stand-in interpreter
    plays del-train and torchrun, so no ranks start."""
    with stand_in_run(tmp_path) as (proc, logged, said):
        logged("ready")
        os.killpg(proc.pid, signal.SIGINT)
        logged("rank got SIGINT 1")
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == EXIT_STOPPED, said()  # the last checkpoint kept
        assert logged("rank got SIGINT 2") == ["ready", "rank got SIGINT 1", "rank got SIGINT 2"]
    assert "torchrun.sh: SIGINT: every rank saves a checkpoint and stops" in said()
    assert "torchrun.sh: SIGINT again: every rank exits at once" in said()


def test_a_ctrl_c_before_torchrun_starts_its_ranks_stops_the_run(tmp_path):
    """A Ctrl-C while torchrun is up but has started no rank yet: the script stops torchrun
    (nothing trained) and exits 75. Before: the script passed it to torchrun's children,
    there were none, and the rank started next trained on as if no Ctrl-C had come."""
    with stand_in_run(tmp_path, RANK_AFTER="3") as (proc, logged, said):
        logged("torchrun up")  # its rank 3 s later
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == EXIT_STOPPED, said()  # lost: the rank runs on
    assert "torchrun.sh: no rank started yet: stopping torchrun" in said()
    assert "torchrun.sh: stopped on request; run the same command again" in said()


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("DEL_REQUIRE_DOCKER") == "1",
    reason="tests/docker/test_container.py stops the same script by docker stop (CI runs it)",
)
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
    deadline = time.time() + 600  # a guard against a hang; the launcher checks the run first
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


def sbatch_dry_run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """launch/slurm/train.sbatch run as a script outside any allocation (no SLURM_*)."""
    environment = {k: v for k, v in torchrun_env().items() if not k.startswith("SLURM_")}
    environment.update(DEL_DRY_RUN="1", DEL_LOG_DIR=str(tmp_path / "logs"), **env)
    return subprocess.run(
        ["bash", "launch/slurm/train.sbatch", *args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_sbatch_dry_run_needs_no_allocation_and_writes_nothing(
    tmp_path, synth_tokenizer, synth_shards
):
    proc = sbatch_dry_run(tmp_path, "configs/tiny_cpu.yaml", "train.steps=5")
    assert proc.returncode == 0, proc.stderr
    command = proc.stdout.split("# command: ", 1)[1]
    assert command.startswith(  # outside an allocation: one node, one rank per node
        "srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --kill-on-bad-exit=0 --wait=120 --label "
    )
    assert "-m del_megatron.cli.train --config configs/tiny_cpu.yaml --resume same" in command
    assert "with WORLD_SIZE=N (the job's ranks) this dry run also runs del-train's" in proc.stdout
    assert not (tmp_path / "logs").exists()
    # with the job's ranks: del-train's dry run for them, and its one line for a mistake
    run = tiny_run(tmp_path, synth_tokenizer, synth_shards)
    proc = sbatch_dry_run(tmp_path, *run, WORLD_SIZE="4")
    assert proc.returncode == 0, proc.stderr
    assert '"world_size": 4, "tensor_parallel": 2, "data_parallel": 2' in proc.stdout
    proc = sbatch_dry_run(tmp_path, *run, "optim.lrr=1", WORLD_SIZE="4")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        "del-train: error: optim.lrr: unknown field; did you mean optim.lr?"
    )
    assert not (tmp_path / "logs").exists()
    assert "logs/" in (ROOT / ".gitignore").read_text().split()


def test_no_launch_script_fixes_a_port():
    """Two runs on one machine must not meet on a fixed rendezvous port: torchrun picks a
    free one with --standalone; SLURM jobs take theirs from the job id."""
    scripts = [*ROOT.glob("launch/*.sh"), *ROOT.glob("launch/experiments/*.sh")]
    for script in scripts:
        text = script.read_text()
        assert "master_port" not in text and "MASTER_PORT" not in text, script
    sbatch = (ROOT / "launch" / "slurm" / "train.sbatch").read_text()
    assert "MASTER_PORT=${MASTER_PORT:-$((20000 + job % 20000))}" in sbatch
