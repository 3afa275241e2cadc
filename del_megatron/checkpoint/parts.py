"""What a save or a load is handed instead of a trainer: the layout and this rank's place in
it (layout.py), the engine's adapter and native state (adapter.py), the learning-rate
scheduler, the device whose generators are kept, and, for a save, rank 0's record (meta.json,
the text files, the model's record). training/checkpointing.py makes them from a run; a test
makes them from tensors (tests/checkpoint/test_package_alone.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .adapter import Adapter, NativeState
from .layout import Layout, Place


@dataclass(frozen=True)
class Parts:
    """The state a checkpoint saves or loads. scheduler: LambdaLR's interface (`last_epoch`,
    `state_dict`, `load_state_dict`, `step`); device: whose generators rng/ keeps;
    vocab_size: the model's unpadded vocabulary rows (the ones kept of its vocabulary
    tensors); native: the engine's own state (None: the engine has none)."""

    layout: Layout
    place: Place
    adapter: Adapter
    scheduler: Any
    device: torch.device
    vocab_size: int
    native: NativeState | None = None


@dataclass(frozen=True)
class Record:
    """What rank 0 writes beside the state. meta: meta.json's fields after the step, the
    world size and the layout (`Layout.meta`); texts: {file name: text} (the run config, the
    schedule); architecture: the model's record for model/arch.json (a pydantic model:
    `models.weight_files.write_weights_record`); tokenizer: the file copied into model/."""

    meta: dict[str, Any] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    architecture: Any = None
    tokenizer: str | None = None
