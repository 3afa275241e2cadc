"""A random start (models/random_start.py) draws each tensor from (seed, global name) with
megatron's law for it: the law of every parameter checked against megatron-core's own random
initialization of the same model; the vocabulary's real rows the same at every padding and
its padding rows zero; the tensor-parallel shards those of the one full tensor. That the
layouts draw one model (TP 2 against TP 1 on the deepspeed engine, PP 2 x 2 virtual stages on
megatron's against one process) is tests/distributed/test_megatron_engine.py's
`test_a_random_start_is_one_model_at_every_layout`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from del_megatron.models.architecture import LlamaArchitecture
from del_megatron.models.hf_names import megatron_names
from del_megatron.models.random_start import drawn, tensor_seed
from del_megatron.models.sharding import merge, partition_of, split

pytestmark = pytest.mark.megatron  # megatron's laws, on every supported megatron-core

CPU = torch.device("cpu")
ARCH = {
    "vocab_size": 600,
    "hidden_size": 64,
    "ffn_hidden_size": 96,
    "num_layers": 3,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "max_position_embeddings": 64,
    "qkv_bias": True,
    "make_vocab_size_divisible_by": 64,
}
LAWS = SimpleNamespace(  # a TransformerConfig's init methods, as megatron's defaults make them
    layernorm_zero_centered_gamma=False,
    embedding_init_method=lambda t, generator: t.normal_(0.0, 0.02, generator=generator),
    init_method=lambda t, generator: t.normal_(0.0, 0.02, generator=generator),
    output_layer_init_method=lambda t, generator: t.normal_(0.0, 0.005, generator=generator),
)


def test_the_seed_of_a_tensor_is_fixed():
    """A change here changes every random start: a run no longer reproduces an older one."""
    assert tensor_seed(1234, "decoder.layers.0.mlp.linear_fc1.weight") == 7175241174716745327
    assert tensor_seed(1234, "embedding.word_embeddings.weight") != tensor_seed(
        1235, "embedding.word_embeddings.weight"
    )


def test_a_tensor_is_one_draw_at_every_padding_and_split():
    """The vocabulary's rows at 640 and 1024 padded rows: the same 600 real rows, zeros past
    them; every TP 2 and TP 4 shard of a full tensor merges back to it."""
    arch = LlamaArchitecture(**ARCH)
    for name in megatron_names(arch):
        small = drawn(name, arch, LAWS, 7, 640, CPU)
        large = drawn(name, arch, LAWS, 7, 1024, CPU)
        if "word_embeddings" in name or name.startswith("output_layer"):
            assert torch.equal(small[:600], large[:600]), name
            assert not small[600:].any() and not large[600:].any(), name
            assert small[:600].std() > 0.01, name
        else:
            assert torch.equal(small, large), name
        for world in (2, 4):
            partition = partition_of(name)
            shards = [split(small, partition, rank, world) for rank in range(world)]
            assert torch.equal(merge(shards, partition), small), (name, world)
    other = drawn("decoder.layers.1.mlp.linear_fc1.weight", arch, LAWS, 7, 640, CPU)
    assert not torch.equal(
        other, drawn("decoder.layers.0.mlp.linear_fc1.weight", arch, LAWS, 7, 640, CPU)
    )


def run_config(tokenizer: Path, tmp_path: Path, seed: int):
    from del_megatron.config import parse_run_config

    return parse_run_config(
        {
            "model": ARCH,
            "parallel": {"tensor_parallel": 1, "zero_stage": 1},
            "train": {
                "steps": 1,
                "micro_batch_size": 1,
                "global_batch_size": 1,
                "seq_len": 8,
                "seed": seed,
                "device": "cpu",
            },
            "data": {"tokenizer": str(tokenizer), "sources": [{"manifest": "unused.json"}]},
            "output_dir": str(tmp_path / "run"),
        }
    )


def test_every_parameter_follows_megatrons_law(one_process_groups, spm_split_digits, tmp_path):
    """The trainer's random start against megatron-core's own random initialization of the
    same model (`perform_initialization`), parameter by parameter: zeros where megatron's are
    zeros (biases), ones where ones (norms), else a normal draw of mean 0 and megatron's std
    (0.02; 0.02 / sqrt(2 x 3 layers) for linear_proj and fc2) within 10% (at least 4,096
    draws each: 1.1% standard error); the padding rows zero. Another seed draws other
    weights; the same seed the same."""
    from del_megatron.models import build_llama
    from del_megatron.tokenizer import Tokenizer
    from del_megatron.training.build import build_model

    tokenizer = Tokenizer(spm_split_digits)
    cfg = run_config(spm_split_digits, tmp_path, 5)
    ours = build_model(cfg, CPU, tokenizer)
    assert not ours.config.perform_initialization  # skipped: every tensor drawn by name
    megatrons = build_llama(cfg.model, tokenizer.digit_vocab, cfg.loss, CPU, seed=5)
    assert megatrons.config.perform_initialization
    theirs = dict(megatrons.named_parameters())
    scaled = 0.02 / (2 * cfg.model.num_layers) ** 0.5
    seen = set()
    for name, param in ours.named_parameters():
        mine, megatron = param.detach(), theirs[name].detach()
        if "word_embeddings" in name or name.startswith("output_layer"):
            assert not mine[600:].any(), name  # padding: zeros, as a loaded checkpoint's
            mine, megatron = mine[:600], megatron[:600]
        if not megatron.any():
            assert not mine.any(), name
            seen.add("zeros")
        elif torch.equal(megatron, torch.ones_like(megatron)):
            assert torch.equal(mine, torch.ones_like(mine)), name
            seen.add("ones")
        else:
            want = megatron.std().item()
            assert (
                abs(
                    want - (scaled if name.endswith(("linear_proj.weight", "fc2.weight")) else 0.02)
                )
                < 0.1 * want
            ), name
            assert abs(mine.std().item() - want) < 0.1 * want, (name, mine.std(), want)
            assert abs(mine.mean().item()) < 0.1 * want, name
            seen.add("normal")
    assert seen == {"zeros", "ones", "normal"}

    again = dict(build_model(cfg, CPU, tokenizer).named_parameters())
    other = dict(
        build_model(run_config(spm_split_digits, tmp_path, 6), CPU, tokenizer).named_parameters()
    )
    for name, param in ours.named_parameters():
        assert torch.equal(param, again[name]), name
        if param.std() > 0:  # the drawn ones; norms and biases are constants
            assert not torch.equal(param, other[name]), name
