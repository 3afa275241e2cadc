"""What an autograd op of the losses keeps for backward, as one named record: the op declares
its saved tensors once, as the fields of a NamedTuple (a field may itself be such a record,
one that two ops share), and `save` / `load` pack and unpack it in field order.

The tensors go through `ctx.save_for_backward`, not onto `ctx` as attributes: autograd then
checks in backward that none was modified in place since (its version counters), and frees
them once backward has run.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Iterator
from typing import Any, TypeVar

import torch

Record = TypeVar("Record", bound=tuple)
_END = object()


def save(ctx: Any, record: tuple) -> None:
    """ctx.save_for_backward of every tensor (or None) of `record`, nested records flattened,
    in field order."""
    ctx.save_for_backward(*_flat(record))


def load(ctx: Any, kind: type[Record]) -> Record:
    """The record of type `kind` that `save` was given, rebuilt from ctx.saved_tensors."""
    tensors = iter(ctx.saved_tensors)
    record = _build(kind, tensors)
    if next(tensors, _END) is not _END:
        raise RuntimeError(f"more tensors were saved than {kind.__name__} has fields")
    return record


@functools.cache
def _nested(kind: type) -> tuple[type | None, ...]:
    """Per field of the record type `kind`: the record type nested there, or None for a
    tensor (or None). Read from the annotations, once per type."""
    hints = typing.get_type_hints(kind)
    return tuple(
        hint if isinstance(hint, type) and issubclass(hint, tuple) else None
        for hint in (hints[name] for name in kind._fields)
    )


def _flat(record: tuple) -> Iterator[torch.Tensor | None]:
    for value, nested in zip(record, _nested(type(record)), strict=True):
        if nested is None:
            yield value
        else:
            yield from _flat(value)


def _build(kind: type[Record], tensors: Iterator[torch.Tensor | None]) -> Record:
    fields = (next(tensors) if part is None else _build(part, tensors) for part in _nested(kind))
    return kind(*fields)
