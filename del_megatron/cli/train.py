"""del-train --config FILE [section.field=value ...] [--dry-run | --check]

Run under torchrun or SLURM for several processes; alone it runs one. Exit status: 0 done,
2 a mistake the user can fix (one line), 75 stopped on request (SIGTERM / SIGUSR1 / Ctrl-C
on any rank: every rank saved the checkpoint; the same command continues), 130 a second
Ctrl-C (at once; the last complete checkpoint is kept).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from ..arguments import positive_float, positive_int
from ..caches import use_writable_caches
from ..config import dump_run_config, load_run_config
from ..errors import INTERRUPTED, UserError
from ..losses import Objective
from ..rendezvous import StoppedWhileWaiting
from .groups import ended_on_return

# "Stopped on request, checkpoint saved: run me again" (sysexits.h EX_TEMPFAIL, "try again
# later"). launch/slurm/train.sbatch requeues the job on exactly this status.
EXIT_STOPPED = 75


def objective_name(loss) -> str:
    """What the training loss adds up, in words: 'CE' for mle, 'CE + 0.1·del' for the kinds
    that add a numeric term, the kind's own name for those that reshape CE (mixce, emo)."""
    kind = loss.kind_spec
    if kind.objective is not Objective.CE:
        return f"{loss.kind} objective"
    if kind.digit_term is None:
        return "CE"
    return f"CE + {loss.resolved_alpha:g}·{loss.kind}"


def final_table(
    before: dict[str, float] | None, after: dict[str, float] | None, objective: str = "CE"
) -> str:
    """Held-out metrics before and after training. Both the cross entropy (what del-eval's
    'loss (CE)' reports) and the training objective are named, since they differ."""
    if after is None:
        return "no held-out data (eval.sources) to compare"
    if before is None:  # a resumed run: the evaluation before training was its first part's
        before = {}
    rows = [("held-out CE", "ce", ".4f")]
    if objective != "CE":
        rows.append((f"held-out loss ({objective})", "loss", ".4f"))
    rows += [
        ("digit accuracy", "digit_acc", ".4f"),
        ("digit entropy", "digit_entropy", ".4f"),
        ("digit abs error", "digit_abs_error", ".3f"),
        # the digit logits' level and the digit term's share (docs/losses.md, diagnostics)
        ("digit logsumexp", "digit_logsumexp", ".3f"),
        ("numeric term share", "numeric_share", ".4f"),
    ]
    width = max(len(label) for label, _, _ in rows)
    lines = [f"{'':{width}s} {'before':>10s} {'after':>10s}"]
    for label, key, fmt in rows:
        if key in after:
            was = f"{before[key]:>10{fmt}}" if key in before else f"{'-':>10s}"
            lines.append(f"{label:{width}s} {was} {after[key]:>10{fmt}}")
    return "\n".join(lines)


def installed(program: str) -> str:
    """How to call one of our commands from here: through the environment del-train runs
    in (`.venv/bin/del-eval` from the repository), or by name when that is not below here."""
    path = Path(sys.executable).parent / program
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return program if shutil.which(program) == str(path) else str(path)


def next_steps(cfg, checkpoint: str) -> str:
    """What a user does with a finished run: evaluate it, export it, train it further."""
    heldout = "".join(f" --heldout {s.manifest}" for s in cfg.eval.sources)
    out = Path(cfg.output_dir)
    return "\n".join(
        [
            "next:",
            f"  evaluate:  {installed('del-eval')} {checkpoint}{heldout} --out {out / 'eval'}",
            f"  export:    {installed('del-convert')} megatron-to-hf --checkpoint {checkpoint} "
            f"--out {out / 'hf'}",
            f"  continue:  the same command with --resume auto and train.steps above "
            f"{cfg.train.steps}",
        ]
    )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _node_leader() -> bool:
    """The first rank of its node (parallel.first_on_node)."""
    from ..parallel import first_on_node

    return first_on_node()


# Set by our launchers (launch/torchrun.sh): a directory where a rank that stops on a user's
# mistake leaves its one line, so that the launcher can end with that line and status 2
# where torchrun would report any failing rank as its own failure with status 1.
USER_ERROR_DIR = "DEL_USER_ERROR_DIR"


def say_error(line: str) -> None:
    """A rank's one line for the mistake it stops on. Our launchers collect each rank's
    (DEL_USER_ERROR_DIR): there the first rank of each node prints it. Otherwise (plain
    srun, torchrun, another launcher) every rank says it on its own stderr, once a node for
    a line several of its ranks share."""
    if os.environ.get(USER_ERROR_DIR):
        if _node_leader():
            print(line, file=sys.stderr)
        leave_user_error(line)
    elif not _said_on_this_node(line):
        print(line, file=sys.stderr)


def _job_key() -> str | None:
    """The job this process is a rank of, on this node (None: no launcher to tell): its
    SLURM step or torchrun launch, and the process that started this node's ranks of it
    (slurmstepd, torchrun's agent), so that no other run ever shares the key."""
    env = os.environ
    if "SLURM_JOB_ID" in env:
        parts = [env["SLURM_JOB_ID"], env.get("SLURM_STEP_ID", ""), env.get("SLURM_RESTART_COUNT")]
    elif "TORCHELASTIC_RUN_ID" in env:
        parts = [env["TORCHELASTIC_RUN_ID"], env.get("TORCHELASTIC_RESTART_COUNT")]
    else:
        return None
    parts.append(str(os.getppid()))
    return "-".join("".join(c if c.isalnum() else "_" for c in str(p or "")) for p in parts)


def _said_on_this_node(line: str) -> bool:
    """Whether another rank of this job on this node said `line` already (a small file per
    job in the node's temporary directory lists the lines said, by hash)."""
    import fcntl
    import hashlib
    import tempfile

    job = _job_key()
    if job is None:
        return False
    digest = hashlib.sha256(line.encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"del-train-said-{os.getuid()}-{job}")
    try:
        with open(path, "a+", encoding="ascii") as said:
            fcntl.flock(said, fcntl.LOCK_EX)
            said.seek(0)
            if digest in said.read().split():
                return True
            said.write(digest + "\n")
    except OSError:
        return False
    return False


def leave_user_error(message: str) -> None:
    directory = os.environ.get(USER_ERROR_DIR)
    if not directory:
        return
    from ..parallel import launch_rank

    rank = launch_rank()
    path = os.path.join(directory, f"rank-{rank}")
    try:  # written whole (rename), so the launcher never reads half a line
        with open(path + ".tmp", "w", encoding="utf-8") as file:
            file.write(message + "\n")
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the line is on stderr already; the launcher then reports torchrun's status


def main(argv: list[str] | None = None) -> int:
    """del-train: its exit status, the run's process groups ended (cli/groups.py)."""
    with ended_on_return():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="del-train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="run config (YAML)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check, print the resolved config, memory plan and layout, exit",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="run every start-up check quietly (one line when they pass), exit; the "
        "launchers run it once before starting the ranks",
    )
    parser.add_argument(
        "--gpu-memory",
        type=positive_float,
        metavar="GIB",
        help="GPU memory for the --dry-run plan (default: the visible GPU's, else 80)",
    )
    parser.add_argument(
        "--deepspeed-json",
        type=positive_int,
        metavar="WORLD_SIZE",
        help="print the DeepSpeed config generated for this world size, exit",
    )
    parser.add_argument(
        "--resume",
        default="same",
        help="'same' (the default: the newest complete checkpoint in output_dir, if any, for "
        "a run of the same config only, so the same command continues a stopped run), 'auto' "
        "(as same, with the changes docs/checkpoints.md allows), a checkpoint directory, or "
        "'none' (a fresh start; refused where checkpoints are)",
    )
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args(argv)
    # a log file on a full disk (wandb's, a library's) must not print a traceback for every
    # record it cannot write: the run's own one line says what is wrong
    logging.raiseExceptions = False
    try:
        use_writable_caches("del-train")
        cfg = load_run_config(args.config, args.overrides)
        if args.deepspeed_json is not None:
            from ..training.engines.deepspeed import deepspeed_config

            gpu = cfg.train.device != "cpu"
            print(json.dumps(deepspeed_config(cfg, args.deepspeed_json, gpu=gpu), indent=2))
            return 0
        from ..training.plan import plan_run
        from ..training.preflight import launch_world_size, preflight

        world = launch_world_size()
        plan = plan_run(cfg, world, gpu_memory_gib=args.gpu_memory)
        plan_lines = plan.lines(cfg.parallel.zero_stage, cfg.train.activation_checkpointing)
        if cfg.train.device == "cpu" and args.gpu_memory is None:
            # a CPU run uses host memory: a plan against an assumed GPU would be no answer
            plan_lines = [
                plan_lines[0],
                "train.device=cpu: no GPU memory to plan (--gpu-memory GIB plans it for a GPU)",
            ]
        if args.dry_run:  # the config and the plan first: they help also when a check fails
            print(dump_run_config(cfg), end="")
            print("\n".join(f"# plan: {line}" for line in plan_lines), flush=True)
            from ..models.spec import planned_fusions

            print("\n".join(f"# fusions: {line}" for line in planned_fusions(cfg.train.device)))
            device_here = cfg.train.device == "cpu" or _cuda_available()
            if not device_here:
                device = cfg.train.device
                print(f"# note: no CUDA device here; train.device={device} is checked at launch")
            layout = preflight(cfg, world, device_here=device_here, resume=args.resume)
            changes = layout.pop("resume_changes")
            print("# layout: " + json.dumps(layout))
            print("".join(f"# {line}\n" for line in changes), end="", flush=True)
            return 0
        if args.check:
            layout = preflight(cfg, world, resume=args.resume)
            start, changes = layout["resume_step"], len(layout["resume_changes"])
            print(
                f"del-train: checks passed: {world} rank(s), {cfg.layout_text(world)}, "
                + (f"resuming at step {start}" if start is not None else "starting at step 0")
                + (f" ({changes} change(s), said at the start)" if changes else ""),
                flush=True,
            )
            return 0
        preflight(cfg, world, resume=args.resume)
        if not plan.fits and cfg.train.device != "cpu" and _node_leader():
            print(f"del-train: {plan_lines[-1]}", file=sys.stderr, flush=True)
        from ..training import progress
        from ..training.trainer import train

        progress.building(cfg, world)
        result = train(cfg, resume=args.resume)
    except UserError as err:
        say_error(f"del-train: error: {err}")
        return 2
    except StoppedWhileWaiting as stop:  # its one line, on the rank that waited
        print(f"del-train: {stop}", file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:  # before the run's own handlers, or after them: no traceback
        print("del-train: interrupted (Ctrl-C), outside the training loop", file=sys.stderr)
        return INTERRUPTED
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        if result.eval_after is not None:
            print(final_table(result.eval_before, result.eval_after, objective_name(cfg.loss)))
        if result.checkpoint:
            stopped = "stopped on request (the same command continues); " if result.stopped else ""
            print(f"{stopped}checkpoint: {result.checkpoint}", flush=True)
            if not result.stopped:
                print(next_steps(cfg, result.checkpoint), flush=True)
        elif result.stopped:
            print("stopped on request; train.checkpoints=false: nothing to continue from")
    if result.stopped and not result.checkpoint:
        return 1  # not EXIT_STOPPED: a requeue would start the run again from step 0
    return EXIT_STOPPED if result.stopped else 0


if __name__ == "__main__":
    sys.exit(main())
