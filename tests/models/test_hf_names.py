"""The Hugging Face name table drives every direction the same way, without a model: a rank's
lazy slices (`rank_shard`) are `sharding.split` of the full tensor, for every parameter,
tensor-parallel size and rank (a shard of vocabulary padding only included); the export of
the full tensors gives back the Hugging Face tensors exactly; a weights directory re-cut to
another size and padding (`MegatronWeights.rank_shard`) equals the direct import."""

from __future__ import annotations

import pytest
import torch

from del_megatron.models.architecture import LlamaArchitecture
from del_megatron.models.hf_config import ConversionError
from del_megatron.models.hf_names import TABLES, find, hf_shapes, megatron_names, partitions
from del_megatron.models.hf_tensors import hf_tensors, pad_vocab, rank_shard, reader_of
from del_megatron.models.sharding import PARTITIONS, partition_of, split
from del_megatron.models.weight_files import MegatronWeights, write_weights

ARCHS = {
    "llama-gqa": LlamaArchitecture(
        vocab_size=120,
        hidden_size=64,
        ffn_hidden_size=96,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        max_position_embeddings=64,
        make_vocab_size_divisible_by=64,
    ),
    # 33 tokens padded to 64 at TP 4: rank 3's 16 rows are all padding
    "mistral-padding-shard": LlamaArchitecture(
        family="mistral",
        vocab_size=33,
        hidden_size=64,
        ffn_hidden_size=32,
        num_layers=1,
        num_attention_heads=8,
        num_query_groups=4,
        max_position_embeddings=64,
        sliding_window=64,
        make_vocab_size_divisible_by=16,
    ),
    "qwen2-tied-bias-head-dim": LlamaArchitecture(
        family="qwen2",
        qkv_bias=True,
        tie_word_embeddings=True,
        vocab_size=130,
        hidden_size=48,
        head_dim=16,
        ffn_hidden_size=64,
        num_layers=1,
        num_attention_heads=4,
        num_query_groups=4,
        max_position_embeddings=64,
        make_vocab_size_divisible_by=8,
    ),
}


def hf_state(arch: LlamaArchitecture) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen) for n, s in sorted(hf_shapes(arch).items())}


@pytest.mark.parametrize("variant", sorted(ARCHS))
def test_lazy_slices_are_the_split_of_the_full_tensor_and_export_inverts(variant):
    arch = ARCHS[variant]
    state = hf_state(arch)
    read = reader_of(state)
    exported = {}
    for name in megatron_names(arch):
        full = rank_shard(read, name, arch, arch.padded_vocab_size(1))
        exported.update(hf_tensors(name, full, arch))
        for tp in (t for t in (2, 4) if arch.num_query_groups % t == 0):
            padded = arch.padded_vocab_size(tp)
            whole = pad_vocab(name, full, arch, padded)
            for rank in range(tp):
                got = rank_shard(read, name, arch, padded, rank, tp)
                assert torch.equal(got, split(whole, partition_of(name), rank, tp)), (name, rank)
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name


def test_a_shard_of_padding_only_is_zeros():
    arch = ARCHS["mistral-padding-shard"]
    read = reader_of(hf_state(arch))
    shard = rank_shard(read, "embedding.word_embeddings.weight", arch, 64, rank=3, world=4)
    assert shard.shape == (16, 64) and not shard.any()


def test_weights_recut_to_another_size_equal_the_direct_import(tmp_path):
    arch = ARCHS["llama-gqa"]
    read = reader_of(hf_state(arch))
    names = megatron_names(arch)
    padded = arch.padded_vocab_size(2)
    shards = ({n: rank_shard(read, n, arch, padded, r, 2) for n in names} for r in range(2))
    write_weights(tmp_path, shards, arch, None)
    weights = MegatronWeights(tmp_path)
    for tp in (1, 2):
        for padded in (arch.padded_vocab_size(tp), arch.padded_vocab_size(tp) + 8 * tp):
            for rank in range(tp):
                for name in names:
                    direct = rank_shard(read, name, arch, padded, rank, tp)
                    assert torch.equal(weights.rank_shard(name, rank, tp, padded), direct), name


def test_the_partition_lookup_is_the_table():
    assert PARTITIONS == partitions()
    for table in set(TABLES.values()):
        for entry in table.entries:
            assert partition_of(entry.megatron) == entry.partition, entry.megatron


def test_names_outside_the_table_are_refused():
    arch = ARCHS["qwen2-tied-bias-head-dim"]
    for name in ("output_layer.weight", "decoder.layers.1.mlp.linear_fc1.weight", "nope"):
        with pytest.raises(ConversionError, match="has no Hugging Face counterpart"):
            find(name, arch)


def test_a_pipelined_runs_weight_files_read_as_one_model(tmp_path):
    """model/ of a run at pipeline parallel 2 (tpNN-ppKK.safetensors: each stage's layers by
    their global number, the embedding on the first, the output layer on the last) reads as
    the same weights as one stage's files; a stage file missing is refused in one line."""
    from safetensors.torch import save_file

    from del_megatron.models.weight_files import WEIGHTS, rank_file, write_files_list

    arch = ARCHS["llama-gqa"]
    read = reader_of(hf_state(arch))
    names = megatron_names(arch)
    padded = arch.padded_vocab_size(2)
    shards = [
        {n: rank_shard(read, n, arch, padded, r, 2).contiguous() for n in names} for r in range(2)
    ]
    write_weights(tmp_path / "one", iter(shards), arch, None)
    staged = tmp_path / "staged"
    write_weights(staged, iter(shards), arch, None)
    root = staged / WEIGHTS
    for rank, shard in enumerate(shards):
        (root / rank_file(rank)).unlink()
        first = {n: t for n, t in shard.items() if n.startswith("embedding") or ".layers.0." in n}
        save_file(first, str(root / rank_file(rank, 0)))
        last = {n: t for n, t in shard.items() if n not in first}
        save_file(last, str(root / rank_file(rank, 1)))
    (root / "files.json").unlink()
    write_files_list(root)
    one, pipelined = MegatronWeights(tmp_path / "one"), MegatronWeights(staged)
    assert pipelined.tensor_parallel == 2 and pipelined.padded_vocab == one.padded_vocab
    for name in names:
        assert torch.equal(pipelined.full(name), one.full(name)), name
    (root / rank_file(1, 1)).unlink()
    (root / "files.json").unlink()
    write_files_list(root)
    with pytest.raises(ConversionError, match="the weight files are not tp00 to tp01-ppKK"):
        MegatronWeights(staged)
