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
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .errors import UserError

Ours = Callable[[Path], bool]  # does this entry of the output directory belong to us?
PREVIOUS = "previous-"  # directories of earlier outputs, set aside inside the output


def staging_of(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial")


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


def begin_output(final: Path, is_ours: Ours, *, force: bool, flag: str = "--force") -> Path:
    """A fresh, empty staging directory beside `final`; refuses a `final` holding files that
    are not ours unless `force`."""
    if final.exists() and not final.is_dir():
        raise UserError(f"{final}: exists and is not a directory")
    foreign = _foreign(final, is_ours)
    if foreign and not force:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise UserError(
            f"{final}: holds files this command did not write ({foreign[0].name}{more}); "
            f"choose another output directory, or {flag} to write there and keep them"
        )
    staging = staging_of(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # ours: a killed run's leftovers
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
    if not final.exists():
        os.replace(staging, final)
        return None
    clash = sorted(p.name for p in _foreign(final, is_ours) if (staging / p.name).exists())
    if clash:
        raise UserError(f"{final}: your file {clash[0]} has the name of an output file; rename it")
    aside = set_aside(final, is_ours)
    new = sorted(staging.iterdir(), key=lambda p: p.name == "manifest.json")  # manifest last
    for path in new:
        os.replace(path, final / path.name)
    staging.rmdir()
    if aside is not None:
        print(f"{final}: the previous output moved to {aside}", flush=True)
    return aside


def abandon_output(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    """`path` holds the old text or the new one, never a part: written beside it, then
    renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
