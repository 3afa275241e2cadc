"""launch/slurm/train.sbatch on a real two-node SLURM cluster (tests/slurm/cluster.sh; CI
starts it). Two nodes, one rank each, tensor parallel 2 across them (the tiny config's
layout): a run to the end, preemption by a signal to the batch shell and to one node's rank
only (checkpoint, requeue, exact resume), the restart cap, and failures that must not
requeue. Skipped when no cluster answers, unless DEL_REQUIRE_SLURM=1 (CI)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ..distributed.launcher import ROOT
from ..utils import each_once, logged_steps

pytestmark = pytest.mark.slow

STEPS = 30
EVERY_STEP = "train.log_interval=1"  # in place of the overrides' 10
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def cluster_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    proc = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, check=False
    )
    states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
    return proc.returncode == 0 and all(
        states.get(n, "").rstrip("*") in ("idle", "mix", "alloc") for n in ("n1", "n2")
    )


@pytest.fixture(scope="module", autouse=True)
def slurm():
    if not cluster_up():
        if os.environ.get("DEL_REQUIRE_SLURM") == "1":
            pytest.fail("DEL_REQUIRE_SLURM=1 but the test cluster (tests/slurm/cluster.sh) is down")
        pytest.skip("no two-node SLURM test cluster (bash tests/slurm/cluster.sh start)")


class Job:
    def __init__(self, job_id: str, root: Path) -> None:
        self.id = job_id
        self.root = root

    @property
    def log(self) -> str:
        found = list((self.root / "logs").glob(f"*-{self.id}/job.log"))
        return found[0].read_text() if found else ""

    def info(self) -> dict[str, str]:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", self.id], capture_output=True, text=True, check=True
        ).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_until(self, predicate, what: str, timeout: float = 240) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.info()
            if predicate(info):
                return info
            time.sleep(0.3)
        raise AssertionError(f"job {self.id}: {what} did not happen in time\n{self.log[-3000:]}")

    def finish(self) -> dict[str, str]:
        """Wait for the end; a requeued job (held ~2 minutes by SLURM) is released early. Not
        at once: slurmd refuses a job whose credential is not newer than the revocation of
        its previous run, to the second ("Job credential revoked")."""
        held_since = None

        def done(info):
            nonlocal held_since
            if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime":
                held_since = held_since or time.monotonic()
                if time.monotonic() - held_since > 2.5:
                    subprocess.run(
                        ["scontrol", "update", f"JobId={self.id}", "StartTime=now"], check=True
                    )
            return info["JobState"] in TERMINAL

        return self.wait_until(done, "the end of the job")


def overrides(tokenizer, manifest, out: Path, *extra: str) -> list[str]:
    """The run's overrides; `extra`'s values replace these (each field once)."""
    return each_once(
        f"data.tokenizer={tokenizer}",
        f"data.sources=[{{manifest: {manifest}}}]",
        "eval.sources=[]",
        f"train.steps={STEPS}",
        "train.log_interval=10",
        "logging.wandb=disabled",
        f"output_dir={out}",
        *extra,
    )


def sbatch(root: Path, args: list[str], *, wait: bool = False, nodes: str = "2", **env: str):
    command = [
        "sbatch",
        "--parsable",
        f"--nodes={nodes}",
        # not with a node range: SLURM would size the job by its smallest count
        *([] if "-" in nodes else ["--ntasks-per-node=1"]),
        "--gpus-per-node=0",
        f"--output={root}/slurm-%j.out",
        *(["--wait"] if wait else []),
        "launch/slurm/train.sbatch",
        "configs/tiny_cpu.yaml",
        *args,
    ]
    environment = {
        **os.environ,
        "DEL_PYTHON": sys.executable,
        "DEL_LOG_DIR": str(root / "logs"),
        "DEL_EXIT_GRACE": "30",
        **env,
    }
    proc = subprocess.run(
        command, cwd=ROOT, env=environment, capture_output=True, text=True, check=False
    )
    job_id = proc.stdout.strip().split(";")[0]
    assert job_id.isdigit(), proc.stderr
    return Job(job_id, root), proc.returncode


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def wait_for_step(job: Job, out: Path, step: int) -> None:
    def reached(info):
        assert info["JobState"] in ("PENDING", "RUNNING"), job.log[-3000:]
        return len(logged_steps(out / "metrics.jsonl")) >= step

    job.wait_until(reached, f"step {step}")


@pytest.fixture(scope="module")
def uninterrupted(synth_tokenizer, synth_shards, tmp_path_factory):
    """sbatch --wait of the whole run: exit 0, a checkpoint, the log in the job's directory."""
    root = tmp_path_factory.mktemp("slurm-straight")
    out = root / "run"
    job, status = sbatch(root, overrides(synth_tokenizer, synth_shards, out), wait=True)
    assert status == 0, job.log[-3000:]
    assert (out / "checkpoints" / f"step-{STEPS:07d}" / "meta.json").is_file()
    assert "train.sbatch: finished" in job.log
    assert f"0: step {STEPS}/{STEPS}" in job.log
    assert "1 node(s)" not in job.log and "2 node(s), 2 rank(s)" in job.log
    return [row["loss"] for row in metrics(out)]


def test_two_nodes_train_to_the_end(uninterrupted):
    assert len(uninterrupted) == STEPS


def check_resumed_exactly(job: Job, out: Path, uninterrupted: list[float]) -> None:
    info = job.finish()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.log[-3000:]
    assert info["Restarts"] == "1"
    log = job.log
    assert "stopped on request, checkpoint saved: requeueing" in log
    stopped = int(re.search(r"checkpoint of step (\d+) saved", log).group(1))
    assert 1 <= stopped < STEPS
    assert f"resumed from {out}/checkpoints/step-{stopped:07d} at step {stopped}" in log
    rows = metrics(out)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # every step once
    assert [row["loss"] for row in rows] == uninterrupted  # bit for bit


def test_preemption_signal_to_the_batch_shell(
    synth_tokenizer, synth_shards, tmp_path, uninterrupted
):
    out = tmp_path / "run"
    # a line every step: the signal goes out at step 3, not after the first flush at step 10
    # with a third of the run left (a race the one-node signal lost once in CI)
    job, _ = sbatch(tmp_path, overrides(synth_tokenizer, synth_shards, out, EVERY_STEP))
    wait_for_step(job, out, 3)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.id], check=True)
    check_resumed_exactly(job, out, uninterrupted)
    assert "received SIGUSR1: forwarding to every rank" in job.log


def job_processes(job: Job) -> list[tuple[psutil.Process, dict[str, str], str]]:
    """(process, environment, command line) of every process of `job`, each looked up afresh.
    Not psutil.process_iter: it keeps its Process objects between calls, and once the pid
    counter wraps (pid_max is 32768 here; a full test run starts more processes) a cached
    one whose pid a new process took reads the new process's /proc but refuses every signal
    (NoSuchProcess, 'PID has been reused'): a kill skipped the job's batch shell and rank 0."""
    found = []
    for pid in psutil.pids():
        try:
            proc = psutil.Process(pid)
            env = proc.environ()
            if env.get("SLURM_JOB_ID") == job.id:
                found.append((proc, env, " ".join(proc.cmdline())))
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def rank_process(job: Job, rank: int) -> psutil.Process:
    """Rank `rank`'s del-train process itself. Its data loader's workers are forks of it (the
    same command line and environment); once pids wrap one can have the lower pid, and the
    signal went to it (the job ran to the end, nothing stopped): the one whose parent is not
    one of them."""
    ranks = [
        proc
        for proc, env, cmdline in job_processes(job)
        if env.get("SLURM_PROCID") == str(rank) and "del_megatron.cli.train" in cmdline
    ]
    pids = {proc.pid for proc in ranks}
    itself = [proc for proc in ranks if proc.ppid() not in pids]
    assert len(itself) == 1, f"rank {rank} of job {job.id}: {[p.pid for p in ranks]}"
    return itself[0]


def test_preemption_signal_to_one_node_only(synth_tokenizer, synth_shards, tmp_path, uninterrupted):
    out = tmp_path / "run"
    # a line every step: the signal goes out at step 3, not after the first flush at step 10
    # with a third of the run left (a race the one-node signal lost once in CI)
    job, _ = sbatch(tmp_path, overrides(synth_tokenizer, synth_shards, out, EVERY_STEP))
    wait_for_step(job, out, 3)
    rank_process(job, 1).send_signal(signal.SIGUSR1)  # node n2's rank; rank 0 gets nothing
    check_resumed_exactly(job, out, uninterrupted)
    assert "forwarding" not in job.log


def test_restart_cap_stops_requeueing(synth_tokenizer, synth_shards, tmp_path):
    out = tmp_path / "run"
    job, _ = sbatch(tmp_path, overrides(synth_tokenizer, synth_shards, out), DEL_MAX_RESTARTS="0")
    wait_for_step(job, out, 2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.id], check=True)
    info = job.finish()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "75:0", job.log[-3000:]
    assert info["Restarts"] == "0"
    assert "not requeued; resubmit to continue" in job.log
    assert len(list((out / "checkpoints").glob("step-*"))) == 1


def test_a_preemption_notice_during_the_start_up_check_ends_as_a_stop(
    synth_tokenizer, synth_shards, tmp_path
):
    """A notice that reaches the batch shell before srun has launched a rank (here while the
    start-up check runs, made to take 5 s) ends the job as a stop (75, requeued up to
    DEL_MAX_RESTARTS), not by the signal's default action: before, the shell died of SIGUSR1
    and the job ended without a requeue, for a person to resubmit."""
    out = tmp_path / "run"
    slow = tmp_path / "python"
    slow.write_text(
        f'#!/bin/sh\ncase " $* " in *" --check "*) sleep 5 ;; esac\nexec {sys.executable} "$@"\n'
    )
    slow.chmod(0o755)
    job, _ = sbatch(
        tmp_path,
        overrides(synth_tokenizer, synth_shards, out),
        DEL_MAX_RESTARTS="0",  # the decision is the point; a requeue is tested above
        DEL_PYTHON=str(slow),
    )
    job.wait_until(lambda info: "checking the run for" in job.log, "the start-up check")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.id], check=True)
    info = job.finish()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "75:0", job.log[-3000:]
    assert "received SIGUSR1 before the ranks started" in job.log
    assert "not requeued; resubmit" in job.log
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.steps=-3", "train.steps: Input should be greater than 0"),
        ("data.sources=[{manifest: /nowhere/manifest.json}]", "/nowhere/manifest.json"),
    ],
    ids=["bad-config", "missing-data"],
)
def test_mistakes_fail_fast_without_requeue(
    override, expected, synth_tokenizer, synth_shards, tmp_path
):
    job, _ = sbatch(tmp_path, overrides(synth_tokenizer, synth_shards, tmp_path / "run", override))
    info = job.finish()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", job.log[-3000:]
    assert info["Restarts"] == "0"
    lines = [line for line in job.log.splitlines() if "del-train: error:" in line]
    assert lines and expected in lines[0], job.log[-3000:]
    assert "Traceback" not in job.log
    assert "del-train exited with status 2: not requeued" in job.log


def test_dry_run_resolves_rendezvous_and_container(tmp_path):
    job, _ = sbatch(
        tmp_path,
        ["train.steps=5"],
        DEL_DRY_RUN="1",
        DEL_CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:25.09-py3",
    )
    info = job.finish()
    assert info["ExitCode"] == "0:0", job.log
    log = job.log
    assert f"rendezvous 127.0.0.1:{20000 + int(job.id) % 20000}" in log  # n1's NodeAddr
    assert "--container-image=nvcr.io#nvidia/pytorch:25.09-py3" in log
    assert f"--container-mounts={ROOT}:{ROOT}" in log
    assert "-m del_megatron.cli.train --config configs/tiny_cpu.yaml --resume same" in log


def scontrol_node(name: str, *state: str, check: bool = True) -> None:
    subprocess.run(["scontrol", "update", f"NodeName={name}", *state], check=check)


def test_node_range_resumes_on_the_nodes_left(synth_tokenizer, synth_shards, tmp_path):
    """--nodes=1-2: the job starts on both nodes (data parallel 2), is preempted, node n2 goes
    down before the requeue, and the job continues on n1 alone (data parallel 1, twice the
    accumulation steps) from the checkpoint, to the end."""
    from ..training.test_resume_layouts import epoch_documents, steps_past_the_epoch

    out = tmp_path / "run"
    documents = epoch_documents(synth_shards)
    steps = steps_past_the_epoch(documents)
    args = overrides(
        synth_tokenizer,
        synth_shards,
        out,
        "parallel.tensor_parallel=1",
        f"train.steps={steps}",
        f"data.trace={out / 'trace'}",
    )
    job, _ = sbatch(tmp_path, args, nodes="1-2")
    wait_for_step(job, out, 3)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.id], check=True)
    job.wait_until(
        lambda info: info["JobState"] == "PENDING" and info.get("Restarts") == "1",
        "the requeue",
    )
    scontrol_node("n2", "State=DOWN", "Reason=test")
    try:
        info = job.finish()
    finally:  # refused if the node is back already (ReturnToService=2: at its registration)
        scontrol_node("n2", "State=RESUME", check=False)
    log = job.log
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    assert "(restart 0): 2 node(s), 2 rank(s)" in log
    assert "(restart 1): 1 node(s), 1 rank(s)" in log
    assert "checking the run for 1 rank(s)" in log
    stopped = int(re.search(r"checkpoint of step (\d+) saved", log).group(1))
    assert f"resumed from {out}/checkpoints/step-{stopped:07d} at step {stopped}" in log
    assert "data: data-parallel size 2 -> 1" in log, log[-3000:]
    rows = metrics(out)
    assert [row["step"] for row in rows] == list(range(1, steps + 1))  # every step once
    from del_megatron.data.trace import trained

    tokens = trained(out / "trace")  # every document of the epoch, all its tokens, once
    assert {(s, d): n for (_, e, s, d), n in tokens.items() if e == 0} == documents
    assert all(n <= documents[(s, d)] for (_, e, s, d), n in tokens.items() if e > 0)


ANOTHER_HOST = """#!/bin/sh
# each run of the job on a node of its own name (a UTS namespace): what one run leaves, the
# next finds as another host's, as after a requeue onto another node
name="node-r${SLURM_RESTART_COUNT:-0}-${SLURM_PROCID:-b}"
exec unshare -u sh -c 'hostname "$0" && exec "$@"' "$name" PYTHON "$@"
"""


def kill_every_process_of(job: Job) -> list[int]:
    """SIGKILL to every process of the job at once, as when its node dies: no handler runs,
    no cleanup (the output lock, a .tmp- checkpoint stay). slurmstepd is SLURM's own."""
    killed = []
    for proc, _, _ in job_processes(job):
        try:
            if proc.name() != "slurmstepd":
                proc.send_signal(signal.SIGKILL)
                killed.append(proc.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return killed


def test_a_node_that_dies_without_cleanup_is_requeued_and_resumes(
    synth_tokenizer, synth_shards, tmp_path, uninterrupted
):
    """What a dead process leaves behind (issue 37): every process of the job killed at once
    (its node dies: nothing cleans up, the output lock naming that node stays), SLURM
    requeues it, and its next run, on a node of another name, takes over its own lock (one
    line) and resumes from the last checkpoint: every step once, bit for bit. Before: the
    requeued run was refused ('being written by another process (host node-r0-0, ...)') and
    the fault SLURM's requeue exists for needed a person."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("another host name needs unshare -u as root")
    wrapper = tmp_path / "python-on-its-own-host"
    wrapper.write_text(ANOTHER_HOST.replace("PYTHON", sys.executable))
    wrapper.chmod(0o755)
    out = tmp_path / "run"
    args = overrides(synth_tokenizer, synth_shards, out, EVERY_STEP, "train.save_interval=5")
    job, _ = sbatch(tmp_path, args, DEL_PYTHON=str(wrapper))
    wait_for_step(job, out, 8)  # past the checkpoint of step 5
    assert kill_every_process_of(job)
    deadline = time.monotonic() + 60
    while subprocess.run(["scontrol", "requeue", job.id], capture_output=True).returncode:
        assert time.monotonic() < deadline, job.log[-3000:]  # as SLURM does for a lost node
        time.sleep(0.5)
    info = job.finish()
    log = job.log
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    assert info["Restarts"] == "1"
    taken = [line for line in log.splitlines() if "taking over the lock" in line]
    assert len(taken) == 1 and "of host node-r0-0, pid " in taken[0], log[-3000:]
    assert f"this job's earlier run (SLURM job {job.id}, restart 0; this is restart 1)" in taken[0]
    resumed = int(re.search(r"resumed from \S+/step-(\d+) at step", log).group(1))
    assert resumed in (5, 10)  # the newest complete checkpoint when the node died
    rows = metrics(out)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # every step once
    assert [row["loss"] for row in rows] == uninterrupted  # bit for bit
