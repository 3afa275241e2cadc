"""Where the libraries a command starts keep their caches when HOME cannot hold them.

torch's extension builds (DeepSpeed's ops), Triton's kernels, wandb, Hugging Face and
matplotlib keep caches under HOME (~/.cache, ~/.triton, ~/.config). Where HOME is not
writable (a container started with another user id, a full or read-only home, a compute node
without /home) the first of them to write failed deep inside a library, a FileNotFoundError
traceback from DeepSpeed's build for one. `use_writable_caches` runs first in every command:
each cache whose default location cannot be written, and that no variable already places,
goes under one writable directory, said once (by the first rank of a node); where no such
directory exists the command refuses in one line before it starts.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

from .errors import UserError
from .parallel import local_rank

# (variable that places it, its default under HOME, what it is for the line)
CACHES = (
    ("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions", "torch extensions"),
    ("TRITON_CACHE_DIR", "~/.triton/cache", "Triton"),
    ("WANDB_CACHE_DIR", "~/.cache/wandb", "wandb"),
    ("WANDB_CONFIG_DIR", "~/.config/wandb", "wandb"),
    ("WANDB_DATA_DIR", "~/.local/share/wandb", "wandb"),
    ("HF_HOME", "~/.cache/huggingface", "Hugging Face"),
    ("MPLCONFIGDIR", "~/.config/matplotlib", "matplotlib"),
)


def writable(path: Path) -> bool:
    """Whether `path` can be created and written: a directory can be made and removed in
    its nearest existing ancestor, as the library's makedirs will. Tried, not predicted:
    access() says yes to root wherever the mode bits allow, where the filesystem still
    refuses (HOME=/proc/nonexistent: DeepSpeed's build died in makedirs)."""
    if not path.is_absolute():  # "~" that nothing expands: no home at all
        return False
    existing = path
    while not existing.exists():
        if existing == existing.parent:
            return False
        existing = existing.parent
    if not existing.is_dir():
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".del-megatron-probe-", dir=existing))
    except OSError:
        return False
    return True


def _default(template: str, env) -> Path:
    """Where a library puts the cache of `template` ("~/...") in environment `env`."""
    cache_home = env.get("XDG_CACHE_HOME")
    if cache_home and template.startswith("~/.cache/"):  # where torch and HF look first
        return Path(cache_home) / template.removeprefix("~/.cache/")
    home = env.get("HOME")
    if home is None:  # as os.path.expanduser: the password database's, if any
        home = os.path.expanduser("~") if "HOME" not in os.environ else ""
    return Path(home or "~") / template.removeprefix("~/")


def use_writable_caches(program: str, env: dict[str, str] | None = None) -> Path | None:
    """Place every cache that cannot be written where it is under one writable directory
    (setting its variable in `env`, the process environment by default), saying so once;
    returns that directory (None: nothing moved). UserError when there is none."""
    env = os.environ if env is None else env
    unwritable = [
        (variable, what)
        for variable, template, what in CACHES
        if variable not in env and not writable(_default(template, env))
    ]
    if not unwritable:
        return None
    home = env.get("HOME", "(unset)")
    try:
        temporary = tempfile.gettempdir()
    except FileNotFoundError:  # no usable temporary directory at all
        temporary = env.get("TMPDIR", "/tmp")
    base = _private_directory(Path(temporary) / f"del-megatron-cache-{os.getuid()}")
    if base is None:
        raise UserError(
            f"HOME={home} is not writable and neither is {temporary}: set HOME (or "
            "XDG_CACHE_HOME and TMPDIR) to a writable directory"
        )
    for variable, _ in unwritable:
        env[variable] = str(base / variable.lower())
    if local_rank(env) == 0:
        names = ", ".join(dict.fromkeys(what for _, what in unwritable))
        print(
            f"{program}: HOME={home} is not writable: caches ({names}) go under {base}",
            file=sys.stderr,
            flush=True,
        )
    return base


def _private_directory(wanted: Path) -> Path | None:
    """`wanted`, made 0700 if need be and used when it is this user's own directory (a
    cache of built extensions is code that runs: never one another user could have put
    there), else a fresh private one beside it; None when neither can be made."""
    try:
        wanted.mkdir(mode=0o700, exist_ok=True)
        found = wanted.lstat()
        if stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid():
            if not found.st_mode & 0o022:
                return wanted
        return Path(tempfile.mkdtemp(prefix=f"{wanted.name}-", dir=wanted.parent))
    except OSError:
        return None
