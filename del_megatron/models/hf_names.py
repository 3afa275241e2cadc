"""The one table of Hugging Face names of the Llama family: for every canonical megatron-core
parameter, the Hugging Face tensors it holds, their shapes, how several are fused into it, its
tensor-parallel split, whether its rows are the (padded) vocabulary, and megatron's random
initialization of it (`Init`, drawn by models/random_start.py).

Import (`hf_tensors.rank_shard`, lazy per-rank slices), export (`hf_tensors.hf_tensors`), the
offline conversion (models/conversion.py), the shape check of a checkpoint (`hf_shapes`) and
the partition lookup without a model (`sharding.PARTITIONS`) all read this table; nothing
else spells a name, a split or a fusion.

Layouts the table names:
* `qkv`: megatron's fused QKV is ordered by query group: [q of the group's heads, k, v] per
  group, so a tensor-parallel rank's rows are its groups' q, k and v rows, each contiguous;
* `concat`: SwiGLU's linear_fc1 is [gate; up], split with stride 2 so that rank r holds
  [gate_r; up_r] (megatron-core's own split of a strided parameter);
* `padded`: the vocabulary is padded to a multiple for tensor parallelism: padding rows are
  zero on import and dropped on export; with tied embeddings there is no output_layer.
Megatron names are canonical: the local spec's separate norms (Transformer Engine's fused
norm names are translated by `hf_tensors.canonical`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .architecture import Family, LlamaArchitecture
from .hf_config import ConversionError

Partition = tuple[int, int] | None
"""(dim, stride) of a tensor-parallel split; None: replicated on every rank."""
Fusion = Literal["qkv", "concat"] | None
Init = Literal["embedding", "hidden", "scaled", "ones", "zeros"]
"""megatron-core's random initialization of a parameter: normal draws of its TransformerConfig's
`embedding_init_method` (the word embeddings), `init_method` (std init_method_std: QKV, fc1,
the output layer) or `output_layer_init_method` ("scaled": std / sqrt(2 x num_layers), the
projections back into the residual stream, linear_proj and fc2); norm weights ones, biases
zeros."""

HF_LAYER = "model.layers.{}."
MEGATRON_LAYER = "decoder.layers.{}."


@dataclass(frozen=True)
class HFPart:
    """One Hugging Face tensor: its name (relative to `model.layers.{i}.` in a layer) and its
    shape in symbols: v vocabulary, h hidden, q query rows, kv key/value rows, f ffn (`dims`)."""

    name: str
    shape: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Entry:
    """A canonical megatron parameter (relative to `decoder.layers.{i}.` in a layer) and the
    Hugging Face tensors it holds, in fused order."""

    megatron: str
    hf: tuple[HFPart, ...]
    init: Init  # megatron's random initialization
    partition: Partition = None
    fusion: Fusion = None
    padded: bool = False  # rows are the vocabulary, padded to the tensor-parallel multiple
    only_if: Literal["qkv_bias", "untied"] | None = None  # present only when the arch says so


@dataclass(frozen=True)
class FamilyTable:
    """Entries before the layers, in every layer, and after them, in megatron's model order."""

    before: tuple[Entry, ...]
    layer: tuple[Entry, ...]
    after: tuple[Entry, ...]

    @property
    def entries(self) -> tuple[Entry, ...]:
        return self.before + self.layer + self.after


def _parts(*parts: tuple[str, str]) -> tuple[HFPart, ...]:
    """HFParts from (name, "space-separated shape symbols") pairs."""
    return tuple(HFPart(name, tuple(shape.split())) for name, shape in parts)


LLAMA = FamilyTable(
    before=(
        Entry(
            megatron="embedding.word_embeddings.weight",
            init="embedding",
            hf=_parts(("model.embed_tokens.weight", "v h")),
            partition=(0, 1),
            padded=True,
        ),
    ),
    layer=(
        Entry(
            megatron="input_layernorm.weight",
            init="ones",
            hf=_parts(("input_layernorm.weight", "h")),
        ),
        Entry(
            megatron="self_attention.linear_qkv.weight",
            init="hidden",
            hf=_parts(
                ("self_attn.q_proj.weight", "q h"),
                ("self_attn.k_proj.weight", "kv h"),
                ("self_attn.v_proj.weight", "kv h"),
            ),
            partition=(0, 1),
            fusion="qkv",
        ),
        Entry(
            megatron="self_attention.linear_qkv.bias",
            init="zeros",
            hf=_parts(
                ("self_attn.q_proj.bias", "q"),
                ("self_attn.k_proj.bias", "kv"),
                ("self_attn.v_proj.bias", "kv"),
            ),
            partition=(0, 1),
            fusion="qkv",
            only_if="qkv_bias",
        ),
        Entry(
            megatron="self_attention.linear_proj.weight",
            init="scaled",
            hf=_parts(("self_attn.o_proj.weight", "h q")),
            partition=(1, 1),
        ),
        Entry(
            megatron="pre_mlp_layernorm.weight",
            init="ones",
            hf=_parts(("post_attention_layernorm.weight", "h")),
        ),
        Entry(
            megatron="mlp.linear_fc1.weight",
            init="hidden",
            hf=_parts(("mlp.gate_proj.weight", "f h"), ("mlp.up_proj.weight", "f h")),
            partition=(0, 2),
            fusion="concat",
        ),
        Entry(
            megatron="mlp.linear_fc2.weight",
            init="scaled",
            hf=_parts(("mlp.down_proj.weight", "h f")),
            partition=(1, 1),
        ),
    ),
    after=(
        Entry(
            megatron="decoder.final_layernorm.weight",
            init="ones",
            hf=_parts(("model.norm.weight", "h")),
        ),
        Entry(
            megatron="output_layer.weight",
            init="hidden",
            hf=_parts(("lm_head.weight", "v h")),
            partition=(0, 1),
            padded=True,
            only_if="untied",
        ),
    ),
)
# Mistral adds a sliding window and Qwen-2 a QKV bias (the arch's qkv_bias): the same tensors.
TABLES: dict[Family, FamilyTable] = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA}


def _check_table(table: FamilyTable) -> None:
    """A fusion splits along its partition dim 0; `concat` of n parts has stride n (rank r
    holds the r-th slice of each part); replicated tensors are one part."""
    for e in table.entries:
        if e.partition is None:
            assert e.fusion is None and len(e.hf) == 1, e
        elif e.fusion is not None:
            assert e.partition[0] == 0, e
            assert e.partition[1] == (len(e.hf) if e.fusion == "concat" else 1), e
        else:
            assert e.partition[1] == 1 and len(e.hf) == 1, e


for _table in set(TABLES.values()):
    _check_table(_table)


def partitions() -> dict[str, tuple[int, int]]:
    """{canonical megatron name (suffix): (dim, stride)} of every partitioned parameter, one
    split per name across families."""
    found: dict[str, tuple[int, int]] = {}
    for table in TABLES.values():
        for e in table.entries:
            if e.partition is not None:
                assert found.setdefault(e.megatron, e.partition) == e.partition, e.megatron
    return found


def padded_names() -> tuple[str, ...]:
    """Canonical megatron names (suffixes) of the parameters whose rows are the padded
    vocabulary, across families."""
    return tuple(sorted({e.megatron for t in TABLES.values() for e in t.entries if e.padded}))


def present(entry: Entry, arch: LlamaArchitecture) -> bool:
    if entry.only_if == "qkv_bias":
        return arch.qkv_bias
    if entry.only_if == "untied":
        return not arch.tie_word_embeddings
    return True


def dims(arch: LlamaArchitecture) -> dict[str, int]:
    """The sizes the table's shape symbols stand for."""
    d = arch.kv_channels
    return {
        "v": arch.vocab_size,
        "h": arch.hidden_size,
        "q": arch.num_attention_heads * d,
        "kv": arch.num_query_groups * d,
        "f": arch.ffn_hidden_size,
    }


@dataclass(frozen=True)
class Bound:
    """A table entry at a place in a model: full names and Hugging Face shapes."""

    entry: Entry
    megatron: str
    hf: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


def _bind(entry: Entry, layer: int | None, sizes: dict[str, int]) -> Bound:
    m_prefix = "" if layer is None else MEGATRON_LAYER.format(layer)
    hf_prefix = "" if layer is None else HF_LAYER.format(layer)
    return Bound(
        entry,
        m_prefix + entry.megatron,
        tuple(hf_prefix + p.name for p in entry.hf),
        tuple(tuple(sizes[s] for s in p.shape) for p in entry.hf),
    )


def bound_entries(arch: LlamaArchitecture) -> list[Bound]:
    """Every parameter of `arch`, in model order."""
    table, sizes = TABLES[arch.family], dims(arch)
    out = [_bind(e, None, sizes) for e in table.before if present(e, arch)]
    for i in range(arch.num_layers):
        out += [_bind(e, i, sizes) for e in table.layer if present(e, arch)]
    out += [_bind(e, None, sizes) for e in table.after if present(e, arch)]
    return out


def find(name: str, arch: LlamaArchitecture) -> Bound:
    """The table entry of the canonical megatron name `name` in `arch`."""
    table, layer, rest = TABLES[arch.family], None, name
    if name.startswith("decoder.layers."):
        index, _, rest = name[len("decoder.layers.") :].partition(".")
        if index.isdigit() and int(index) < arch.num_layers:
            layer = int(index)
    candidates = table.layer if layer is not None else table.before + table.after
    for e in candidates:
        if e.megatron == rest and present(e, arch):
            return _bind(e, layer, dims(arch))
    raise ConversionError(f"{name} has no Hugging Face counterpart in a {arch.family} model")


def megatron_names(arch: LlamaArchitecture) -> list[str]:
    """Every canonical megatron parameter name of `arch`, in model order."""
    return [b.megatron for b in bound_entries(arch)]


def hf_shapes(arch: LlamaArchitecture) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `arch` holds, with its shape."""
    return {n: s for b in bound_entries(arch) for n, s in zip(b.hf, b.shapes, strict=True)}
