"""The weights a run starts from (init.hf, init.megatron), opened and checked against the run
config before anything is built (preflight and --dry-run read only headers), then loaded
into each rank's shards; without them, a random start drawn into them."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError, RunConfig
from ..inputs import missing
from ..models.architecture import LlamaArchitecture
from ..models.conversion import open_hf
from ..models.hf_config import ConversionError
from ..models.weight_files import HFCheckpoint, MegatronWeights

Initial = tuple[HFCheckpoint | MegatronWeights, LlamaArchitecture]


def open_initial_weights(cfg: RunConfig) -> Initial | None:
    """The initial weights and their architecture, or None for a random start. Raises
    ConfigError with one line: a missing directory (with what to download), a checkpoint
    that cannot be reproduced exactly, another architecture than `model`."""
    field, where = ("init.hf", cfg.init.hf) if cfg.init.hf else ("init.megatron", cfg.init.megatron)
    if not where:
        return None
    if not Path(where).is_dir():
        hint = ""
        if cfg.init.hf and cfg.init.hf_hub_id:
            # `hf`: the command huggingface_hub 2.x installs (its older name is gone)
            hint = f"; download it: hf download {cfg.init.hf_hub_id} --local-dir {where}"
        raise ConfigError(f"{missing(Path(where), field)}{hint}")
    try:
        if cfg.init.hf:
            source, arch = open_hf(where, divisible_by=cfg.model.make_vocab_size_divisible_by)
        else:
            source = MegatronWeights(where)
            arch = source.arch
    except ConversionError as err:
        raise ConfigError(f"{field}: {where}: {err}") from None
    check_architecture(cfg.model, arch, where)
    return source, arch


def check_architecture(model: LlamaArchitecture, found: LlamaArchitecture, where: str) -> None:
    """`model` of the run config equals the weights' architecture, field by field."""
    for name, value in found.model_dump().items():
        if name != "make_vocab_size_divisible_by" and getattr(model, name) != value:
            raise ConfigError(
                f"model.{name}={getattr(model, name)} but {where} has {value} "
                "(another model? copy the architecture from its config)"
            )


def initialize_weights(cfg: RunConfig, model: torch.nn.Module, opened: Initial | None) -> None:
    """Every parameter of this rank's shards, so the build skipped megatron's random init:
    the initial weights `opened` (`open_initial_weights`) loaded, or for a random start
    (None) each tensor drawn from train.seed and its global name
    (`models/random_start.draw_random_start`), one model at any layout and engine."""
    from ..models.random_start import draw_random_start
    from ..models.weights import load_hf, load_megatron

    padded_vocab = cfg.model.padded_vocab_size(cfg.parallel.tensor_parallel)
    if opened is None:
        draw_random_start(model, cfg.model, cfg.train.seed, padded_vocab)
        return
    source, arch = opened
    try:
        if isinstance(source, HFCheckpoint):
            load_hf(model, source, arch)
        else:
            load_megatron(model, source, padded_vocab)
    except ConversionError as err:
        raise ConfigError(f"initial weights: {err}") from None
