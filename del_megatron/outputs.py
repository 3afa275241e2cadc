"""Output directories written whole: a command builds into a fresh sibling directory and
replaces the old output only once the new one is complete, so a failure leaves the previous
output as it was. Files in the output directory that the command did not write are the
user's: the command refuses to touch such a directory unless forced, and then keeps them.
The previous output is never replaced without a word: its files move aside into
`previous-<UTC time>-XXXX/` inside the output directory (as launch/quickstart.sh does with a
run's checkpoints), and one line says where (`set_aside`). Every command that writes an
output directory (data-tools build, del-convert, del-eval --out) follows this one policy.

    staging = begin_output(out, is_ours, force=args.force, flag="--force")
    ... write everything into `staging` ...
    commit_output(staging, out, is_ours)      # or abandon_output(staging) on failure

One writer at a time: `begin_output` takes the output's lock (`output_lock`, a file beside
the output naming its holder, del_megatron/locks.py) and `commit_output` / `abandon_output`
give it back, so a second command into the same output is refused in one line (or waits,
`wait=True`) instead of sharing the first one's staging directory. Staging is named after
its writer. A writer whose lock was taken over meanwhile (its lease ran out while it was
stopped) writes nothing more: every write under an output asks `fence` first ("Fencing",
below).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from . import locks
from .errors import UserError

Ours = Callable[[Path], bool]  # does this entry of the output directory belong to us?
PREVIOUS = "previous-"  # directories of earlier outputs, set aside inside the output


def staging_of(final: Path) -> Path:
    """This writer's own staging directory (host and pid: two writers never share one)."""
    return final.with_name(f".{final.name}.partial-{socket.gethostname()}-{os.getpid()}")


def _leftover_staging(final: Path) -> list[Path]:
    """Staging directories of earlier writers of `final` (killed ones: the lock is ours)."""
    return sorted(final.parent.glob(f".{final.name}.partial*"))


def _foreign(final: Path, is_ours: Ours) -> list[Path]:
    if not final.is_dir():
        return []
    return sorted(p for p in final.iterdir() if not (is_ours(p) or _set_aside_dir(p)))


def _set_aside_dir(path: Path) -> bool:
    return path.name.startswith(PREVIOUS) and path.is_dir()


def set_aside(final: Path, is_ours: Ours) -> Path | None:
    """The files of the output in `final` that are ours (earlier set-aside directories
    excepted) moved into a new `final/previous-<UTC time>-XXXX/`, the user's umask applied;
    returns it, or None when there was nothing to move. Each move is a rename."""
    if not final.is_dir():
        return None
    ours = sorted(p for p in final.iterdir() if is_ours(p) and not _set_aside_dir(p))
    if not ours:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = Path(tempfile.mkdtemp(prefix=f"{PREVIOUS}{stamp}-", dir=final))
    umask = os.umask(0)
    os.umask(umask)
    aside.chmod(0o777 & ~umask)  # mkdtemp's 0700 would hide the user's own results
    for path in ours:
        os.replace(path, aside / path.name)
    return aside


def begin_output(
    final: Path, is_ours: Ours, *, force: bool, flag: str = "--force", wait: bool = False
) -> Path:
    """A fresh, empty staging directory beside `final`, with `final`'s lock held (until
    `commit_output` or `abandon_output`); refuses a `final` holding files that are not ours
    unless `force`, and a `final` another process is writing unless `wait`."""
    if final.exists() and not final.is_dir():
        raise UserError(f"{final}: exists and is not a directory")
    acquire_output_lock(final, wait=wait)
    try:
        return _fresh_staging(final, is_ours, force=force, flag=flag)
    except BaseException:
        release_output_lock(final)
        raise


def _fresh_staging(final: Path, is_ours: Ours, *, force: bool, flag: str) -> Path:
    foreign = _foreign(final, is_ours)
    if foreign and not force:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise UserError(
            f"{final}: holds files this command did not write ({foreign[0].name}{more}); "
            f"choose another output directory, or {flag} to write there and keep them"
        )
    staging = staging_of(final)
    try:
        for leftover in _leftover_staging(final):  # killed writers': we hold the lock
            shutil.rmtree(leftover, ignore_errors=True)
        staging.mkdir()
    except OSError as err:
        raise UserError(f"{final}: cannot write there ({err.strerror or err})") from None
    return staging


def commit_output(staging: Path, final: Path, is_ours: Ours) -> Path | None:
    """Put the complete `staging` in place of `final`. A previous output's files are set
    aside first (`set_aside`; one line says where, and its path is returned), the user's
    files never move. Into a new directory: one rename (atomic). Into an existing one: each
    new file is renamed in whole, a manifest last, so a reader of it sees a complete
    output."""
    fence(final)
    if not final.exists():
        os.replace(staging, final)
        release_output_lock(final)
        return None
    clash = sorted(p.name for p in _foreign(final, is_ours) if (staging / p.name).exists())
    if clash:
        raise UserError(f"{final}: your file {clash[0]} has the name of an output file; rename it")
    fence(final)
    aside = set_aside(final, is_ours)
    # the list of the files last (a manifest, files.json): a reader who finds it finds them
    new = sorted(staging.iterdir(), key=lambda p: p.name in ("manifest.json", "files.json"))
    for path in new:
        fence(final)  # each rename: a stall between two of them may have cost the lock
        os.replace(path, final / path.name)
    staging.rmdir()
    release_output_lock(final)
    if aside is not None:
        print(f"{final}: the previous output moved to {aside}", flush=True)
    return aside


def abandon_output(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)
    final = staging.with_name(staging.name[1:].rsplit(".partial-", 1)[0])
    release_output_lock(final)


def write_text_atomic(path: Path, text: str) -> None:
    """`path` holds the old text or the new one, never a part: written beside it, then
    renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ---- one writer per output --------------------------------------------------------------
#
# The lock is del_megatron/locks.py's: a file beside the output naming its holder, renewed
# while held, and taken over without a person once its holder is provably gone (a dead pid
# on this host, an earlier run of the same SLURM job, a holder elsewhere that stopped
# renewing it for longer than its lease), with one line naming it. A live holder's lock is
# never taken over: a second writer is refused naming it, or waits for it.


class OutputLocked(UserError):
    """Another process holds the output's lock; the message names its host and pid."""


def lock_of(final: Path) -> Path:
    final = Path(os.path.abspath(final))  # "." and "run/.." have a name this way
    return final.with_name(f".{final.name}.lock")


def acquire_output_lock(final: Path, *, wait: bool = False, poll_s: float = 0.5) -> None:
    """Hold `final`'s lock, or raise OutputLocked naming the holder (wait=True: wait for it,
    saying so once)."""
    lock = lock_of(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        holder = locks.try_take(lock, str(final))
    except OSError as err:
        raise write_error(final, err) from None
    said = False
    while holder is not None:
        where = locks.describe(holder)
        if not wait:
            raise OutputLocked(
                f"{final}: being written by another process ({where}); wait for it "
                f"(--wait-for-lock) or choose another output (its lock {lock} is taken over "
                f"once that process is gone, or {locks.lease_s():.0f} s after it stopped "
                f"renewing it: {locks.LEASE_ENV})"
            )
        if not said:
            print(f"{final}: waiting for the process writing it ({where})", file=sys.stderr)
            said = True
        time.sleep(poll_s)
        holder = locks.try_take(lock, str(final))


def release_output_lock(final: Path) -> None:
    """Give `final`'s lock back if this process holds it (never another's)."""
    locks.release(lock_of(final))


# ---- fencing ----------------------------------------------------------------------------
#
# A holder whose lease ran out while it did not run (a stalled node, a paused container, a
# hung network filesystem) wakes up after another job took its lock over. Noticing is not
# enough: every write under an output asks `fence` right before it is made (one read of the
# lock: its record must carry this holding's token, locks.check), and a holder that lost
# its lock stops in one line (locks.LockLost, exit status 2), writing nothing more. In
# del-train every rank's writes go through it: rank 0 holds the lock and asks, and the
# ranks agree on its answer (`agreed_fence`) before a metrics line, at the start of a save
# and before its publication (checkpoint/save.py, publish.py). The steps:
#
# * staging names carry the holder's token (`.tmp-step-N-<token>`, `.NAME.partial-HOST-PID`):
#   a writer never writes into, publishes or removes another's staging;
# * a new holder's first write moves every other holder's staging out of the namespace (a
#   rename, then the delete: checkpoint/directory.remove_partial), and so does its choice of
#   checkpoint to resume from: checkpoints newer than it are an old holder's late
#   publication, removed. A staging made before the takeover is moved away, and the old
#   holder's writes into it then fail (its path no longer resolves); one made after the
#   takeover is caught by the check the old holder makes right after making it;
# * publication is check, rename, check again: the rename of a staging the new holder moved
#   away fails; the second check stops an old holder whose rename came through before the
#   move (a complete checkpoint, which the new holder removes as above).
#
# What no check on a POSIX filesystem closes: rename(2) cannot be made conditional on
# another file's content, so a stall longer than the lease between a check and the write it
# guards lets that one write through: a metrics line (a step twice in metrics.jsonl), or,
# at a publication, the move aside of a checkpoint of the same step or of old checkpoints
# being pruned (the new holder's, then). The window is the few instructions between the
# check and the call, not the save. On NFS, a client may also go on resolving a moved-away
# staging path from its cache for up to its attribute-cache time (acdirmax, 60 s by
# default). Closing these needs a store that compares the token at the write itself (an
# object store's conditional put, a lock service), which a filesystem is not.


def fence(final: Path) -> str | None:
    """This holding's token if this process still holds `final`'s lock (None if it never
    took it); else LockLost, the one line a writer that lost it stops with. Ask right
    before each write."""
    return locks.check(lock_of(final), str(final))


def lock_lost(final: Path) -> bool:
    """Whether this process held `final`'s lock and lost it (`fence`, as a flag): what rank 0
    adds to a training step's agreement (`signals.agree`), so every rank stops on it within
    the step's one host read, with no collective of its own."""
    try:
        fence(final)
    except locks.LockLost:
        return True
    return False


def lost_lock_line(final: Path, *, leader: bool) -> str:
    """The line every rank stops with once the step's agreement says the lock was lost
    (`fence`'s on the leader, which held it; the same, from the lock's record, elsewhere)."""
    if leader:
        try:
            fence(final)
        except locks.LockLost as err:
            return str(err)
    lock = lock_of(final)
    return locks.taken_over_line(lock, str(final), locks.read_holder(lock))


def agreed_fence(final: Path, *, leader: bool) -> str | None:
    """`fence` for a job of several processes: the `leader` (the lock's holder) asks, every
    process gets its answer (the leader's token, or its LockLost line, raised on every
    process, so that no rank waits in a collective for one that stopped). Collective."""
    from . import collectives

    answer: tuple[str, str | None] | None = None
    if leader:
        try:
            answer = ("held", fence(final))
        except locks.LockLost as err:
            answer = ("lost", str(err))
    answers = [a for a in collectives.all_gather_object(answer) if a is not None]
    if not answers:  # no leader among the processes (a library call outside a job)
        return None
    kind, text = answers[0]
    if kind == "lost":
        raise locks.LockLost(text)
    return text


@contextlib.contextmanager
def output_lock(final: Path, *, wait: bool = False) -> Iterator[None]:
    """`final`'s lock held for the block: for outputs not written through begin_output
    (del-eval --out, del-train's output_dir)."""
    acquire_output_lock(final, wait=wait)
    try:
        yield
    finally:
        release_output_lock(final)


def check_output_dir(directory: Path, flag: str) -> None:
    """A file can be written in `directory` (or, when it does not exist yet, in the nearest
    directory above it, where it will be made): checked before long work, so that the work
    is not lost at its last step, and without creating anything."""
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{flag} {directory}: exists and is not a directory")
    existing = directory
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{flag} {directory}: {existing} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise write_error(directory, err, flag) from None


def write_error(directory: Path, err: OSError, flag: str = "") -> UserError:
    """The one line for an output that cannot be written: a full disk says what it needs."""
    if is_no_space(err):
        return no_space(directory)
    where = f"{flag} {directory}" if flag else str(directory)
    return UserError(f"{where}: cannot write there ({err.strerror or err})")


def free_bytes(path: Path) -> int:
    """Free bytes of the filesystem `path` is (or would be created) on."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def no_space(directory: Path, needed: int | None = None) -> UserError:
    """The one line for a full disk: the directory, what is free, what is needed."""
    need = f", {needed} needed" if needed is not None else ""
    return UserError(
        f"{directory}: no space left on the device ({free_bytes(directory)} bytes free{need}); "
        "free some space or choose another location, then run again"
    )


@contextlib.contextmanager
def agreed_output_lock(final: Path, *, leader: bool) -> Iterator[None]:
    """`final`'s lock for a job of several processes: the `leader` alone takes it, and every
    process raises the leader's refusal (a decision agreed over the processes, so a second
    job's ranks all stop, none waits in a collective for one that left)."""
    from . import collectives

    refusal = None
    if leader:
        try:
            acquire_output_lock(final)
        except UserError as err:
            refusal = str(err)
    refusals = [r for r in collectives.all_gather_object(refusal) if r]
    if refusals:
        raise OutputLocked(refusals[0])
    try:
        yield
    finally:
        if leader:
            release_output_lock(final)


def close_on_the_way_out(close: Callable[[], None], where: Path, *, failing: bool) -> None:
    """Run `close` (what a run opened: wandb, log files) on its way out. When the run is
    `failing` (an error is being raised), an error of `close` is dropped: the first error
    says what is wrong, and a full disk fails every writer on it (wandb's log handler's
    flush, for one), each adding a traceback of its own. Otherwise a write `close` cannot
    make is the one line of an output that cannot be written (`write_error`)."""
    try:
        close()
    except Exception as err:
        if failing:
            return
        if isinstance(err, OSError):
            raise write_error(where, err) from None
        if is_no_space(err):
            raise no_space(where) from None
        raise


def is_no_space(err: BaseException) -> bool:
    """A full disk or quota, however deep a library wrapped it (torch.save raises
    RuntimeError around the ENOSPC of its writer)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(err) or "Disk quota exceeded" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False
