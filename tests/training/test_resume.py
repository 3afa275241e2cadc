"""Surviving failure (CPU, TP 2 on 2 processes): exact resume after SIGKILL, kills during a
checkpoint write, a stop signal to one rank saving on every rank and exiting 75, and resuming
at another data-parallel size."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ..distributed import launcher
from ..distributed.launcher import (
    ROOT,
    failed_launch,
    free_port,
    run_command,
    run_torchrun,
    torchrun_command,
    torchrun_env,
)
from ..utils import each_once, logged_steps

pytestmark = pytest.mark.slow


def train_args(out: Path, tokenizer, manifest, *extra: str, tp: int = 2) -> list[str]:
    """The config and its overrides; `extra`'s values replace the base's (each field once)."""
    return [
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        *each_once(
            f"data.tokenizer={tokenizer}",
            f"data.sources=[{{manifest: {manifest}}}]",
            "eval.sources=[]",
            "train.steps=20",
            "train.log_interval=5",
            f"parallel.tensor_parallel={tp}",
            "train.global_batch_size=16",
            f"output_dir={out}",
            "logging.wandb=disabled",
            *extra,
        ),
    ]


def command(out: Path, tokenizer, manifest, *extra: str, nproc: int = 2, tp: int = 2):
    return torchrun_command(
        "-m del_megatron.cli.train", nproc, *train_args(out, tokenizer, manifest, *extra, tp=tp)
    )


def env():
    return torchrun_env()


def run(cmd) -> subprocess.CompletedProcess:
    """A run to its end (on warm ranks: the subject is the run, not its processes)."""
    proc = run_command(cmd, env=env())
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, failed_launch("del-train", proc.returncode, output)
    return proc


def losses(out: Path) -> dict[int, float]:
    """step -> loss; later lines (a resumed run) override earlier ones."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def start_and_wait(cmd, out: Path, *, step: int, extra_env: dict[str, str] | None = None):
    """Start a run; return the process once metrics.jsonl shows `step`."""
    proc = subprocess.Popen(
        cmd,
        env={**env(), **(extra_env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline:
        if any(s >= step for s in logged_steps(out / "metrics.jsonl")):
            return proc
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read().decode()[-3000:])
        time.sleep(0.05)
    kill_hard(proc)  # the workers too: killing the launcher alone leaves them running
    raise AssertionError("the run did not reach the step in time")


def kill_hard(proc) -> None:
    """SIGKILL the launcher and every worker (torchrun starts workers in sessions of their
    own, so killing its process group is not enough)."""
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in family:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=30)


def cost_embeddings(checkpoint: Path) -> list[tuple]:
    """(EMO's cost embedding as the layout-free state keeps it, the output layer's weights in
    model/) of each tensor-parallel rank, as saved."""
    from safetensors.torch import load_file

    weights = sorted(checkpoint.glob("model/tp*.safetensors"))
    assert weights, f"no weights under {checkpoint}"
    out = []
    for tp, path in enumerate(weights):
        state = load_file(str(checkpoint / "optim" / f"tp{tp:02d}-dp00.safetensors"))
        out.append((state["head.emo_cost_embedding/buffer"], load_file(str(path))))
    return out


def assert_cost_embedding_checkpointed(first: Path, later: Path) -> None:
    """EMO's cost embedding is in every checkpoint's state, the same in a later one (it is
    taken once, from the weights the run starts with), while the output weights it was taken
    from have trained away from it."""
    import torch

    for (early, _), (cost, weights) in zip(
        cost_embeddings(first), cost_embeddings(later), strict=True
    ):
        assert torch.equal(cost, early)
        taken_now = torch.nn.functional.normalize(weights["output_layer.weight"].float(), dim=-1)
        assert not torch.equal(cost, taken_now[: cost.shape[0]])


# every kind whose state could differ on resume: emo's cost embedding is a buffer; del and
# ntl_was: the digit kinds, with and without place weighting. The optimizer state is the
# layout-free one, read at the saved layout too; ntl_was keeps DeepSpeed's own instead
# (train.layout_free_checkpoints=false, and how every checkpoint was written before the
# layout-free state was the one copy), read through DeepSpeed's load. del's SIGKILL and exact
# resume (layout-free) is the background-write test's below, which resumes from the
# checkpoint before a half-written one: a row of its own here added a run and a resume that
# checked nothing that test does not.
@pytest.fixture(scope="module")
def straight_losses(synth_tokenizer, synth_shards, tmp_path_factory):
    """kind -> the losses of 20 steps without a checkpoint, each kind run once for the
    module's tests."""
    found: dict[str, dict[int, float]] = {}

    def of(kind: str) -> dict[int, float]:
        if kind not in found:
            out = tmp_path_factory.mktemp(f"straight-{kind}")
            run(command(out, synth_tokenizer, synth_shards, f"loss.kind={kind}"))
            found[kind] = losses(out)
        return found[kind]

    return of


@pytest.mark.parametrize("kind,layout_free", [("emo", True), ("ntl_was", False)])
def test_exact_resume_after_sigkill(
    tmp_path, synth_tokenizer, synth_shards, straight_losses, kind, layout_free
):
    interrupted = tmp_path / "interrupted"
    cmd = command(
        interrupted,
        synth_tokenizer,
        synth_shards,
        "train.save_interval=10",
        f"loss.kind={kind}",
        f"train.layout_free_checkpoints={str(layout_free).lower()}",
    )
    kill_hard(start_and_wait(cmd, interrupted, step=13))
    saved = interrupted / "checkpoints" / "step-0000010"
    assert (saved / "meta.json").is_file()
    assert (saved / "optim").is_dir() == layout_free and (saved / "state").is_dir() != layout_free
    proc = run([*cmd, "--resume", "auto"])
    assert "resumed from" in proc.stdout and "at step 10" in proc.stdout
    a, b = straight_losses(kind), losses(interrupted)
    for step in range(11, 21):
        assert a[step] == b[step], (step, a[step], b[step])  # bit for bit
    if kind == "emo":
        saved = interrupted / "checkpoints"
        assert_cost_embedding_checkpointed(saved / "step-0000010", saved / "step-0000020")


def test_a_kill_during_a_background_write_resumes_from_the_checkpoint_before(
    tmp_path, synth_tokenizer, synth_shards, straight_losses
):
    """Issue 28: a checkpoint is written behind training and published only when every
    rank's part is on the disk. Rank 1's writer of step 10 is held (workers/held_writer.py),
    rank 0's finishes: training goes on past step 10 (the save did not stop it) to the save
    of step 15, which waits for it; step-0000010 never appears. A SIGKILL then, and
    --resume auto continues from step 5, bit for bit."""
    out = tmp_path / "run"
    args = train_args(out, synth_tokenizer, synth_shards, "train.save_interval=5", "loss.kind=del")
    marker = tmp_path / "held"
    held = torchrun_command("held_writer.py", 2, *args)
    proc = start_and_wait(held, out, step=15, extra_env={"DEL_TEST_HOLD": f"1:10:{marker}"})
    time.sleep(1)  # the run is waiting at the save of step 15 for rank 1's writer
    assert proc.poll() is None and marker.is_file()
    checkpoints = out / "checkpoints"
    (partial,) = checkpoints.glob(".tmp-step-0000010-*")  # the job's own staging name
    assert sorted(p.name for p in checkpoints.iterdir()) == [partial.name, "step-0000005"]
    assert (partial / "rng" / "rank00000.pt").is_file()  # rank 0's part was written
    assert not (partial / "rng" / "rank00001.pt").exists()
    kill_hard(proc)
    proc = run([*command(out, synth_tokenizer, synth_shards, "train.save_interval=5",
                         "loss.kind=del"), "--resume", "auto"])  # fmt: skip
    assert "at step 5" in proc.stdout, proc.stdout
    a, b = straight_losses("del"), losses(out)
    for step in range(6, 21):
        assert a[step] == b[step], (step, a[step], b[step])  # bit for bit
    kept = ["step-0000010", "step-0000015", "step-0000020"]  # train.keep_checkpoints=3
    assert sorted(p.name for p in checkpoints.iterdir()) == kept


def test_kills_during_checkpoint_writes_never_lose_the_last_good_one(
    tmp_path, synth_tokenizer, synth_shards
):
    out = tmp_path / "run"
    cmd = command(
        out, synth_tokenizer, synth_shards, "train.save_interval=1", "train.keep_checkpoints=2"
    )
    for kill_after in (3, 6, 9):  # checkpoints are written after every step: kills land in saves
        proc = start_and_wait([*cmd, "--resume", "auto"], out, step=kill_after)
        time.sleep(0.15 * (kill_after % 4))
        kill_hard(proc)
        complete = sorted((out / "checkpoints").glob("step-*"))
        assert complete, "no complete checkpoint"
        for ckpt in complete:
            assert (ckpt / "meta.json").is_file() and (ckpt / "data_state.json").is_file()
    proc = run([*cmd, "--resume", "auto"])
    assert "resumed from" in proc.stdout
    assert max(losses(out)) == 20
    assert not list((out / "checkpoints").glob(".tmp-*"))


def start_ranks(args: list[str], nproc: int, *, warm: bool = False) -> list:
    """del-train on `nproc` ranks without a launcher, as srun starts them (one process per
    rank, the rendezvous from the environment), so each rank's own exit status is seen.
    warm: forks of the warm test server (launcher.start_ranks), for a test whose subject is
    what the run trains rather than its processes; else fresh interpreters."""
    if warm:
        return launcher.start_ranks("-m del_megatron.cli.train", args, nproc, env())
    port = free_port()
    return [
        launcher.cold_rank("-m del_megatron.cli.train", args,
                           {**env(), **launcher.srun_environment(rank, nproc, port)})
        for rank in range(nproc)
    ]


def test_stop_signal_to_one_rank_stops_every_rank_with_a_checkpoint(
    tmp_path, synth_tokenizer, synth_shards
):
    from del_megatron.cli.train import EXIT_STOPPED

    out = tmp_path / "run"
    args = train_args(out, synth_tokenizer, synth_shards, "train.steps=400")
    ranks = start_ranks(args, 2)
    metrics_file = out / "metrics.jsonl"
    deadline = time.time() + 300
    while len(logged_steps(metrics_file)) < 4:
        assert time.time() < deadline and all(r.poll() is None for r in ranks)
        time.sleep(0.05)
    ranks[1].send_signal(signal.SIGUSR1)  # rank 1 only: rank 0 must follow the agreement
    outputs = [r.communicate(timeout=300)[0] for r in ranks]  # no hang
    assert [r.returncode for r in ranks] == [EXIT_STOPPED, EXIT_STOPPED], outputs
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert len(saved) == 1, saved  # the stop's checkpoint, no final-step save
    stopped_at = int(saved[0].name.split("-")[1])
    assert 4 <= stopped_at < 400
    assert json.loads((saved[0] / "meta.json").read_text())["step"] == stopped_at
    assert f"checkpoint of step {stopped_at} saved" in outputs[0]
    assert max(losses(out)) == stopped_at

    resumed = start_and_wait(
        [*command(out, synth_tokenizer, synth_shards, "train.steps=400"), "--resume", "auto"],
        out,
        step=stopped_at + 2,
    )
    kill_hard(resumed)
    steps = [json.loads(line)["step"] for line in metrics_file.read_text().splitlines()]
    assert steps[: stopped_at + 1] == list(range(1, stopped_at + 2))  # continues at the next


def test_resume_at_another_data_parallel_size(tmp_path, synth_tokenizer, synth_shards):
    out = tmp_path / "run"
    # TP 1: DP 2 on two processes, then DP 1 on one process, then DP 2 again
    run(command(out, synth_tokenizer, synth_shards, "train.steps=6", tp=1))
    proc = run(
        [
            *command(out, synth_tokenizer, synth_shards, "train.steps=10", nproc=1, tp=1),
            "--resume",
            "auto",
        ]
    )
    assert "at step 6" in proc.stdout
    proc = run(
        [*command(out, synth_tokenizer, synth_shards, "train.steps=14", tp=1), "--resume", "auto"]
    )
    assert "at step 10" in proc.stdout
    assert sorted(losses(out)) == list(range(1, 15))
    # the weights themselves, in the model and in the optimizer's copy: DP 2 -> 1 and 1 -> 2
    for saved, nproc in (("step-0000006", 1), ("step-0000010", 2)):
        args = train_args(out, synth_tokenizer, synth_shards, tp=1)[1:]  # config, overrides
        output = run_torchrun("resume_weights.py", nproc, str(out / "checkpoints" / saved), *args)
        assert f"restored at data-parallel size {nproc}" in output


def test_bad_checkpoints_give_one_line_and_exit_non_zero(
    tmp_path, synth_tokenizer, synth_shards, spm_split_digits, synth_corpus, capsys, monkeypatch
):
    """One real del-train on 2 ranks refuses a cut-short file in one line; the other refusals
    are the checks it makes before anything starts (preflight), asked of `del-train
    --dry-run` in this process at world size 2, each its exit status 2 and its one line (a
    launch each cost a start-up of 2 ranks for a check that runs before them)."""
    from data_tools.build import build_shards
    from del_megatron.cli.train import main

    out = tmp_path / "run"
    run(command(out, synth_tokenizer, synth_shards, "train.steps=2"))
    base = command(out, synth_tokenizer, synth_shards, "train.steps=4")
    saved = out / "checkpoints" / "step-0000002"

    def fails(cmd, expected):
        proc = subprocess.run(
            cmd, env=env(), capture_output=True, text=True, cwd=ROOT, timeout=600, check=False
        )
        assert proc.returncode != 0
        lines = [line for line in proc.stderr.splitlines() if line.startswith("del-train: error")]
        assert lines and expected in lines[0], proc.stderr[-2000:]

    monkeypatch.setenv("WORLD_SIZE", "2")

    def refused(tokenizer, manifest, resume, expected, *extra):
        args = train_args(out, tokenizer, manifest, "train.steps=4", *extra)
        code = main([*args, "--dry-run", "--resume", str(resume)])
        _, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert expected in err, err

    refused(
        synth_tokenizer,
        synth_shards,
        saved,
        "saved with model.ffn_hidden_size=352, this run has 256",
        "model.ffn_hidden_size=256",
    )  # another architecture
    other = tmp_path / "other-shards"
    build_shards([synth_corpus / "heldout.jsonl"], other, spm_split_digits, progress=False)
    refused(spm_split_digits, other / "manifest.json", saved, "saved with another tokenizer")
    rng = saved / "rng" / "rank00000.pt"
    original = rng.read_bytes()
    rng.write_bytes(original[:40])  # cut short
    fails([*base, "--resume", str(saved)], "rank00000.pt: unreadable")
    rng.write_bytes(original)
    for state in saved.glob("optim/*.safetensors"):
        state.write_bytes(state.read_bytes()[:100])  # corrupted
    # cut short: refused by its size in files.json before anything reads it (the start-up
    # check, checkpoint/files.py)
    refused(
        synth_tokenizer,
        synth_shards,
        saved,
        "tp00-dp00.safetensors: unreadable (100 bytes",
    )
    refused(synth_tokenizer, synth_shards, tmp_path / "nowhere", "nowhere: does not exist")
    (tmp_path / "empty").mkdir()  # a directory, but no checkpoint (no files.json)
    refused(synth_tokenizer, synth_shards, tmp_path / "empty", "not a complete checkpoint")
