"""The model under evaluation: a del-megatron checkpoint (run by megatron-core, one process)
or a Hugging Face directory (run by transformers), each giving logits [b, s, V] for token
windows, and greedy continuations for prompts.

The two paths are independent implementations of the same network, so their teacher-forced
metrics on the same windows agree to float32 rounding (tested within 1e-4).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..models.weight_files import WEIGHTS, tokenizer_in
from ..tokenizer import Tokenizer


@dataclass
class Loaded:
    kind: str  # "checkpoint" or "hf"
    path: Path
    tokenizer: Tokenizer
    forward: Any  # tokens [b, s] long -> logits [b, s, V] float32 (V: the tokenizer's size)
    device: torch.device  # where forward's logits are
    hf_model: Any = None  # the transformers model, for generation (Hugging Face directories)


def max_positions(path: Path) -> int:
    """The model's max_position_embeddings, read before the model loads (the architecture
    record of a checkpoint, config.json of a Hugging Face directory): the longest window and
    the longest prompt plus generation the model can take."""
    if model_kind(path) == "checkpoint":
        from ..models.weight_files import MegatronWeights

        return MegatronWeights(path).arch.max_position_embeddings
    try:
        return int(json.loads((path / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path}/config.json: no max_position_embeddings ({err})") from None


def model_kind(path: Path) -> str:
    from ..inputs import being_written, check_whole, missing

    if not path.exists():
        raise missing(path)
    if being_written(path) or (path / "meta.json").is_file():  # a training checkpoint's
        check_whole(path)
    if (path / WEIGHTS / "arch.json").is_file():
        return "checkpoint"
    if (path / "config.json").is_file():
        return "hf"
    raise UserError(
        f"{path}: neither a del-megatron checkpoint (model/arch.json) nor a Hugging Face "
        "model directory (config.json)"
    )


def check_vocabulary(model_rows: int, tokenizer: Tokenizer, where: str) -> None:
    """A model must have an embedding row for every token id its tokenizer can produce
    (read before the weights load: otherwise an IndexError deep inside the forward)."""
    if model_rows < tokenizer.vocab_size:
        raise UserError(
            f"{where}: vocab_size={model_rows} is smaller than its tokenizer's "
            f"{tokenizer.vocab_size} tokens ({tokenizer.path}): the model and the tokenizer "
            "do not belong together"
        )


def _hf_vocab_size(path: Path) -> int:
    try:
        return int(json.loads((path / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path}/config.json: no vocab_size ({err})") from None


def _single_process_groups(device: torch.device) -> None:
    """The groups of a one-process run on `device`, made as a training run makes them: the
    backend that takes this device's tensors (NCCL on CUDA: the model's probes and every
    statistic live there) and megatron's groups at TP 1 without gloo groups of their own."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..parallel import init_model_parallel
    from ..runtime import process_group_backend

    if not dist.is_initialized():
        backend = process_group_backend(device)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        init_model_parallel(1, timeout_minutes=60)


def load_model(path: Path, device: torch.device) -> Loaded:
    kind = model_kind(path)
    if kind == "checkpoint":
        return _load_checkpoint(path, device)
    return _load_hf(path, device)


def _load_checkpoint(path: Path, device: torch.device) -> Loaded:
    from ..losses import NumericLossConfig
    from ..models.llama import build_llama
    from ..models.weight_files import MegatronWeights
    from ..models.weights import load_megatron
    from ..runtime import select_accelerator

    select_accelerator(device)
    weights = MegatronWeights(path)
    weights.verify()
    tokenizer_path = weights.tokenizer()
    if tokenizer_path is None:
        raise UserError(f"{path}/{WEIGHTS}: no tokenizer file beside the weights")
    tokenizer = Tokenizer(tokenizer_path)
    arch = weights.arch
    check_vocabulary(arch.vocab_size, tokenizer, f"{path}/{WEIGHTS}/arch.json")
    _single_process_groups(device)
    model = build_llama(
        arch,
        tokenizer.digit_vocab,
        NumericLossConfig(kind="mle"),
        device,
        seed=0,  # nothing is drawn: every weight is loaded, no dropout in evaluation
        weights_follow=True,
    )
    load_megatron(model, weights, arch.padded_vocab_size(1))
    model.eval()
    vocab = tokenizer.vocab_size  # columns past the tokenizer's are padding, as in training

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(device)
        positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        with torch.no_grad():
            return model(tokens, positions, None)[..., :vocab].float()

    return Loaded("checkpoint", path, tokenizer, forward, device)


def _load_hf(path: Path, device: torch.device) -> Loaded:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" of a few tensors
    tokenizer_path = tokenizer_in(path)
    if tokenizer_path is None:
        raise UserError(f"{path}: no tokenizer.json or tokenizer.model")
    tokenizer = Tokenizer(tokenizer_path)
    check_vocabulary(_hf_vocab_size(path), tokenizer, f"{path}/config.json")
    from ..models.spec import model_dtype

    dtype = model_dtype(device)
    # transformers >= 4.56 names the argument dtype, earlier releases torch_dtype
    legacy = tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (4, 56)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, **{"torch_dtype" if legacy else "dtype": dtype}
    )
    model = model.to(device).eval()
    vocab = tokenizer.vocab_size  # columns past the tokenizer's are padding, as in training

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(tokens.to(device)).logits[..., :vocab].float()

    return Loaded("hf", path, tokenizer, forward, device, model)


def hf_directory(loaded: Loaded, scratch: Path) -> Path:
    """A Hugging Face directory of the model: its own, or the checkpoint exported once into
    `scratch` (generation and lm-evaluation-harness run on transformers)."""
    if loaded.kind == "hf":
        return loaded.path
    out = scratch / "hf-export"
    if not (out / "config.json").is_file():
        from ..models.conversion import export_hf

        export_hf(loaded.path, out, dtype="float32")
    return out
