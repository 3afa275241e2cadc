"""A parameter read outside its owning module's forward (the fused head reads the output
layer's weight without calling the layer): the owner's forward pre-hooks run first, as a
call would run them. Hook-driven gathering waits in such a hook: megatron's
DistributedDataParallel with overlap_param_gather finishes the weight's bucket all-gather
there (`finish_param_sync`), so the fused head read the weight mid-gather and megatron's
next step asserted `param_gather_handle is None` (issue 50, item 1).

Failed on the code before: the fused head ran no hook of the output layer (0 calls)."""

from __future__ import annotations

import pytest
import torch

from del_megatron.config import parse_run_config
from del_megatron.tokenizer import Tokenizer

CPU = torch.device("cpu")
VOCAB = 512  # at least the split-digit tokenizer's


def config(tokenizer, tmp_path, fused: bool, tied: bool):
    return parse_run_config(
        {
            "model": {
                "vocab_size": VOCAB,
                "hidden_size": 32,
                "ffn_hidden_size": 64,
                "num_layers": 1,
                "num_attention_heads": 4,
                "num_query_groups": 4,
                "max_position_embeddings": 16,
                "tie_word_embeddings": tied,
                "make_vocab_size_divisible_by": 64,
            },
            "loss": {"kind": "del", "fused_output": fused},
            "parallel": {"tensor_parallel": 1},
            "train": {
                "steps": 1,
                "micro_batch_size": 2,
                "global_batch_size": 2,
                "seq_len": 8,
                "device": "cpu",
            },
            "data": {"tokenizer": str(tokenizer), "sources": [{"manifest": "unused.json"}]},
            "output_dir": str(tmp_path / "run"),
        }
    )


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_the_output_layers_pre_hooks_run_before_its_weight_is_read(
    fused, one_process_groups, spm_split_digits, tmp_path
):
    from del_megatron.training.build import build_model

    tokenizer = Tokenizer(spm_split_digits)
    cfg = config(spm_split_digits, tmp_path, fused, tied=False)
    model = build_model(cfg, CPU, tokenizer)
    calls = []
    model.output_layer.register_forward_pre_hook(lambda module, args: calls.append(module))
    model.output_layer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(module), with_kwargs=True
    )
    tokens = torch.randint(0, tokenizer.vocab_size, (2, 8))
    positions = torch.arange(8).expand_as(tokens)
    output = model(tokens, positions, None, labels=tokens, loss_mask=torch.ones(2, 8))
    assert output is not None
    assert calls == [model.output_layer, model.output_layer]  # each hook once, as a call


def test_a_tied_weight_on_the_first_stage_is_the_embeddings(
    one_process_groups, spm_split_digits, tmp_path
):
    """At one stage a tied output weight is the embedding's, gathered by the embedding's
    own forward in the same pass: the output layer (which holds no weight) runs no hook."""
    from del_megatron.training.build import build_model

    tokenizer = Tokenizer(spm_split_digits)
    model = build_model(config(spm_split_digits, tmp_path, True, tied=True), CPU, tokenizer)
    seen = []
    model.embedding.word_embeddings.register_forward_pre_hook(lambda m, a: seen.append("emb"))
    tokens = torch.randint(0, tokenizer.vocab_size, (2, 8))
    positions = torch.arange(8).expand_as(tokens)
    model(tokens, positions, None, labels=tokens, loss_mask=torch.ones(2, 8))
    assert seen == ["emb"]
