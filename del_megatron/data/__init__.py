"""Streaming tokenized shards to every rank: shard format, resumable streams, the loader."""

from .config import DataConfig, DataSource
from .format import (
    DataError,
    Document,
    Manifest,
    ShardEntry,
    TokenizerInfo,
    load_manifests,
    read_manifest,
)
from .loader import StreamingLoader

__all__ = [
    "DataConfig",
    "DataError",
    "DataSource",
    "Document",
    "Manifest",
    "ShardEntry",
    "StreamingLoader",
    "TokenizerInfo",
    "load_manifests",
    "read_manifest",
]
