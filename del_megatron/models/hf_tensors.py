"""Hugging Face tensors <-> megatron-core tensors of the Llama family, one tensor at a time.

Layouts:
* megatron's fused QKV is ordered by query group: [q of the group's heads, k, v] per group,
  so a tensor-parallel rank's rows are its groups' q, k and v rows, each contiguous;
* megatron's linear_fc1 is [gate; up] (SwiGLU), a rank holding [gate_r; up_r];
* the vocabulary is padded to a multiple for tensor parallelism: padding rows are zero on
  import and dropped on export; with tied embeddings there is no output_layer.
Megatron names here are canonical: the local spec's separate norms. Transformer Engine's
spec fuses them into the next linear layer; `canonical` and `spec_name` translate.

`rank_shard` reads, through a `SliceReader`, only the rows or columns of each Hugging Face
tensor that a rank holds: a rank never needs the whole checkpoint in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .hf_config import ConversionError
from .llama import LlamaArchitecture

# (hf_name, dim, start, stop) -> that slice of the tensor (dim None: the whole tensor)
SliceReader = Callable[[str, int | None, int | None, int | None], torch.Tensor]

TE_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
# Buffers some checkpoints carry that follow from the config (not weights).
DERIVED = (".rotary_emb.inv_freq",)


def canonical(name: str) -> str:
    """A megatron parameter name with Transformer Engine's fused norm names made local."""
    for local, te in TE_NORMS.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def spec_name(name: str, layer_norms_fused: bool) -> str:
    """A canonical name as a model with (or without) Transformer Engine's spec has it."""
    if layer_norms_fused:
        for local, te in TE_NORMS.items():
            if name.endswith(local):
                return name[: -len(local)] + te
    return name


def megatron_names(arch: LlamaArchitecture) -> list[str]:
    """Every canonical megatron parameter name of `arch`, in model order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        if arch.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        names += [
            p + "self_attention.linear_proj.weight",
            p + "pre_mlp_layernorm.weight",
            p + "mlp.linear_fc1.weight",
            p + "mlp.linear_fc2.weight",
        ]
    names.append("decoder.final_layernorm.weight")
    if not arch.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def hf_shapes(arch: LlamaArchitecture) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `arch` holds, with its shape."""
    h, d = arch.hidden_size, arch.kv_channels
    q, kv, f = arch.num_attention_heads * d, arch.num_query_groups * d, arch.ffn_hidden_size
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        )
        if arch.qkv_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


def check_hf_tensors(found: dict[str, tuple[int, ...]], arch: LlamaArchitecture) -> None:
    """Every tensor `arch` needs is there with its shape, and nothing else is (a tensor we
    would not read changes the model's math): ConversionError naming the first mismatch."""
    expected = hf_shapes(arch)
    for name, shape in expected.items():
        if name not in found:
            raise ConversionError(f"tensor {name} is missing from the checkpoint")
        if tuple(found[name]) != shape:
            raise ConversionError(
                f"tensor {name} has shape {tuple(found[name])}, config.json implies {shape}"
            )
    tied_head = "lm_head.weight" if arch.tie_word_embeddings else None
    extra = sorted(
        n for n in found if n not in expected and n != tied_head and not n.endswith(DERIVED)
    )
    if extra:
        raise ConversionError(
            f"tensor {extra[0]} (and {len(extra) - 1} more) has no place in the model: "
            "the checkpoint has parts that config.json does not describe"
        )


def _layer(name: str) -> tuple[str, str]:
    """('model.layers.{i}.', the rest) of a canonical megatron layer parameter name."""
    _, _, index, rest = name.split(".", 3)
    return f"model.layers.{index}.", rest


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _fuse_qkv(q, k, v, groups: int, d: int) -> torch.Tensor:
    tail = q.shape[1:]
    q = q.reshape(groups, -1, *tail)
    k, v = k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def rank_shard(
    read: SliceReader,
    name: str,
    arch: LlamaArchitecture,
    padded_vocab: int,
    rank: int = 0,
    world: int = 1,
) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s shard of the canonical megatron tensor `name` (the whole
    tensor at world 1), read slice by slice from the Hugging Face tensors."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        source = "model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"
        rows = padded_vocab // world
        start, stop = rank * rows, min((rank + 1) * rows, arch.vocab_size)
        if start >= stop:
            return torch.zeros(rows, arch.hidden_size, dtype=read(source, 0, 0, 1).dtype)
        return _pad_rows(read(source, 0, start, stop), rows)
    if name == "decoder.final_layernorm.weight":
        return read("model.norm.weight", None, None, None)
    layer, rest = _layer(name)
    attn, d = layer + "self_attn.", arch.kv_channels
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        groups = arch.num_query_groups // world
        first = rank * groups
        per_group = arch.num_attention_heads // arch.num_query_groups * d
        q = read(f"{attn}q_proj.{kind}", 0, first * per_group, (first + groups) * per_group)
        k = read(f"{attn}k_proj.{kind}", 0, first * d, (first + groups) * d)
        v = read(f"{attn}v_proj.{kind}", 0, first * d, (first + groups) * d)
        return _fuse_qkv(q, k, v, groups, d)
    if rest == "self_attention.linear_proj.weight":
        columns = arch.num_attention_heads * d // world
        return read(attn + "o_proj.weight", 1, rank * columns, (rank + 1) * columns)
    ffn = arch.ffn_hidden_size // world
    if rest == "mlp.linear_fc1.weight":
        gate = read(layer + "mlp.gate_proj.weight", 0, rank * ffn, (rank + 1) * ffn)
        up = read(layer + "mlp.up_proj.weight", 0, rank * ffn, (rank + 1) * ffn)
        return torch.cat([gate, up])
    if rest == "mlp.linear_fc2.weight":
        return read(layer + "mlp.down_proj.weight", 1, rank * ffn, (rank + 1) * ffn)
    if rest == "input_layernorm.weight":
        return read(layer + "input_layernorm.weight", None, None, None)
    if rest == "pre_mlp_layernorm.weight":
        return read(layer + "post_attention_layernorm.weight", None, None, None)
    raise ConversionError(f"no Hugging Face tensor maps to {name}")


def reader_of(tensors: dict[str, torch.Tensor]) -> SliceReader:
    """A SliceReader over tensors in memory."""

    def read(name, dim, start, stop):
        try:
            t = tensors[name]
        except KeyError:
            raise ConversionError(f"tensor {name} is missing from the checkpoint") from None
        return t if dim is None else t.narrow(dim, start, stop - start)

    return read


def hf_tensors(
    name: str, full: torch.Tensor, arch: LlamaArchitecture
) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of one full (TP 1) canonical megatron tensor."""
    v = arch.vocab_size
    if name == "embedding.word_embeddings.weight":
        yield "model.embed_tokens.weight", full[:v]
        return
    if name == "output_layer.weight":
        yield "lm_head.weight", full[:v]
        return
    if name == "decoder.final_layernorm.weight":
        yield "model.norm.weight", full
        return
    layer, rest = _layer(name)
    attn, d = layer + "self_attn.", arch.kv_channels
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        groups = arch.num_query_groups
        per_group = arch.num_attention_heads // groups * d
        tail = full.shape[1:]
        q, k, vv = full.reshape(groups, per_group + 2 * d, *tail).split([per_group, d, d], dim=1)
        for proj, t in (("q_proj", q), ("k_proj", k), ("v_proj", vv)):
            yield f"{attn}{proj}.{kind}", t.reshape(-1, *tail)
        return
    simple = {
        "self_attention.linear_proj.weight": attn + "o_proj.weight",
        "mlp.linear_fc2.weight": layer + "mlp.down_proj.weight",
        "input_layernorm.weight": layer + "input_layernorm.weight",
        "pre_mlp_layernorm.weight": layer + "post_attention_layernorm.weight",
    }
    if rest in simple:
        yield simple[rest], full
    elif rest == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2)
        yield layer + "mlp.gate_proj.weight", gate
        yield layer + "mlp.up_proj.weight", up
    else:
        raise ConversionError(f"{name} has no Hugging Face counterpart")
