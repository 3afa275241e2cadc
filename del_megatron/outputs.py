"""Output directories written whole: a command builds into a fresh sibling directory and
replaces the old output only once the new one is complete, so a failure leaves the previous
output as it was. Files in the output directory that the command did not write are the
user's: the command refuses to touch such a directory unless forced, and then keeps them.

    staging = begin_output(out, is_ours, force=args.force, flag="--force")
    ... write everything into `staging` ...
    commit_output(staging, out, is_ours)      # or abandon_output(staging) on failure
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from .errors import UserError

Ours = Callable[[Path], bool]  # does this entry of the output directory belong to us?


def staging_of(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial")


def _foreign(final: Path, is_ours: Ours) -> list[Path]:
    if not final.is_dir():
        return []
    return sorted(p for p in final.iterdir() if not is_ours(p))


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


def commit_output(staging: Path, final: Path, is_ours: Ours) -> None:
    """Put the complete `staging` in place of `final`. Without foreign files: one directory
    rename (atomic: readers see the old output or the new). With them (forced): our old
    files leave first, then the new ones move in, so the user's files never move."""
    foreign = _foreign(final, is_ours)
    if not foreign:
        previous = final.with_name(f".{final.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        if final.exists():
            os.replace(final, previous)
        os.replace(staging, final)
        shutil.rmtree(previous, ignore_errors=True)
        return
    clash = sorted(p.name for p in foreign if (staging / p.name).exists())
    if clash:
        raise UserError(f"{final}: your file {clash[0]} has the name of an output file; rename it")
    for old in sorted(final.iterdir()):
        if is_ours(old):
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    new = sorted(staging.iterdir(), key=lambda p: p.name == "manifest.json")  # manifest last
    for path in new:
        os.replace(path, final / path.name)
    staging.rmdir()


def abandon_output(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    """`path` holds the old text or the new one, never a part: written beside it, then
    renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
