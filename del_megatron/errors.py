"""The one base of every mistake a user can fix (a config field, an input file, a checkpoint,
a tokenizer): its message is one line naming the field or file and, where known, the offset.
Each command line catches `UserError` alone, prints that line and exits with status 2;
anything else is a bug of ours and keeps its traceback."""

from __future__ import annotations

INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C (the shell's 128 + SIGINT)


class UserError(Exception):
    """A mistake the user can fix; the message is one line naming where."""


def one_line(text: str) -> str:
    """A message as one line (third-party messages can span several)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())
