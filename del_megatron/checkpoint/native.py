"""An engine's own optimizer state in a checkpoint (train.layout_free_checkpoints=false, the
deepspeed engine): where its files are and which ones a resume at the saved layout reads, so
the checks before a load need no engine. Writing and reading it is the engine's
(`adapter.NativeState`, training/engines/deepspeed_checkpoint.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TAG = "state"  # the directory (DeepSpeed's "tag") of DeepSpeed's own files


def has_native_state(path: Path) -> bool:
    """Whether the checkpoint holds DeepSpeed's own state (written before the layout-free
    state became the one copy, or with train.layout_free_checkpoints=false)."""
    return (path / TAG).is_dir()


def native_files(meta: dict[str, Any]) -> list[tuple[str, ...]]:
    """DeepSpeed's files of a checkpoint that a resume at its saved layout reads (DeepSpeed
    0.19.8's names; a bf16 run's optimizer files carry a `bf16_` prefix, either is taken)."""
    tp, dp, zero = meta.get("tensor_parallel"), meta.get("data_parallel"), meta.get("zero_stage")
    if not isinstance(tp, int) or not isinstance(dp, int) or zero is None:
        return []  # saved before the layout was recorded: DeepSpeed's own load says
    names = []
    for t in range(tp):
        if zero == 3:
            names += [f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt" for d in range(dp)]
        else:
            names.append(f"mp_rank_{t:02d}_model_states.pt")
        names += [f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for d in range(dp)]
    # each file as named, or with the prefix DeepSpeed gives a bf16 run's zero_pp_rank files
    return [
        (f"{TAG}/{n}", f"{TAG}/bf16_{n}") if n.startswith("zero_pp_rank_") else (f"{TAG}/{n}",)
        for n in names
    ]
