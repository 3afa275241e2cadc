"""Options of the streaming loader (one record, validated on construction)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DataSource(BaseModel):
    """One tokenized corpus: its manifest and its share of the mix."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    manifest: str
    """manifest.json: a path, file://, http(s):// URL, or a 'pipe:' command template in which
    '{name}' stands for the file name (manifest.json, then each shard)."""
    weight: float = Field(default=1.0, gt=0)
    """Share of the mix, in tokens, relative to the other sources' weights."""


class DataConfig(BaseModel):
    """How shards become batches of packed windows."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sources: tuple[DataSource, ...] = Field(min_length=1)
    seq_len: int = Field(gt=0)
    """Tokens per training sequence; windows hold seq_len + 1 tokens."""
    micro_batch_size: int = Field(gt=0)
    seed: int = 1234
    shuffle: bool = True
    """Shuffle shard order and samples within each shard, from (seed, epoch)."""
    mask_after_boundary: bool = False
    """Loss mask 0 on the first token of each document (not predicted across a boundary)."""
    on_error: Literal["skip", "fail"] = "fail"
    """A corrupt or missing shard: `skip` logs and counts it, `fail` stops naming it."""
    allow_pipe: bool = False
    """Allow 'pipe:' sources (they run commands)."""
    num_workers: int = Field(default=0, ge=0)
    """DataLoader worker processes per rank (0: read in the training process)."""
    epochs: int | None = Field(default=None, gt=0)
    """None: stream forever (epoch after epoch). A number: stop after that many epochs, every
    rank yielding the same number of batches (the last ones padded with masked windows)."""
