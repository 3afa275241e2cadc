"""Hugging Face <-> megatron-core weights for the Llama family (Llama, Mistral, Qwen-2,
DeepSeek's Llama architecture).

Pure mapping between *full* state dicts (tensor-parallel size 1 layout); sharding to a rank
uses `sharding.shard_like`, gathering uses `gather_full`. Layouts:
* megatron's fused QKV is ordered by query group: [q of the group's heads, k, v] per group;
* megatron's linear_fc1 is [gate; up] (SwiGLU);
* the vocabulary is padded to `padded_vocab_size`: padding rows are zero on import and
  dropped on export.
Parameter names follow the layer spec: the local spec has separate norms
(`input_layernorm`, `pre_mlp_layernorm`), Transformer Engine's fuses them into the next
linear layer (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .llama import LlamaArchitecture

SUPPORTED = {"llama", "mistral", "qwen2"}


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the file or tensor."""


# ---- architecture ------------------------------------------------------------------------


def architecture_from_hf(config: dict[str, Any], *, divisible_by: int = 128) -> LlamaArchitecture:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ConversionError(
            f"config.json: model_type {model_type!r} is not one of {sorted(SUPPORTED)}"
        )
    if config.get("tie_word_embeddings"):
        raise ConversionError(
            "config.json: tied embeddings are not supported (Llama family "
            "models of this project have separate output weights)"
        )
    heads = config["num_attention_heads"]
    return LlamaArchitecture(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        max_position_embeddings=config["max_position_embeddings"],
        rope_theta=float(config.get("rope_theta", 10000.0)),
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        make_vocab_size_divisible_by=divisible_by,
    )


def hf_config(arch: LlamaArchitecture, model_type: str = "llama") -> dict[str, Any]:
    architectures = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }
    config = {
        "architectures": [architectures[model_type]],
        "model_type": model_type,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_query_groups,
        "max_position_embeddings": arch.max_position_embeddings,
        "rope_theta": arch.rope_theta,
        "rms_norm_eps": arch.norm_epsilon,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        config["attention_bias"] = arch.qkv_bias
    return config


# ---- state dicts -------------------------------------------------------------------------


def _names(layer_norms_fused: bool) -> dict[str, str]:
    """megatron names of the norms, by spec."""
    if layer_norms_fused:
        return {
            "input": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp": "mlp.linear_fc1.layer_norm_weight",
        }
    return {"input": "input_layernorm.weight", "pre_mlp": "pre_mlp_layernorm.weight"}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _fuse_qkv(q, k, v, arch: LlamaArchitecture) -> torch.Tensor:
    groups, per_group = arch.num_query_groups, arch.num_attention_heads // arch.num_query_groups
    d = arch.hidden_size // arch.num_attention_heads
    tail = q.shape[1:]
    q = q.reshape(groups, per_group * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _split_qkv(qkv, arch: LlamaArchitecture):
    groups, per_group = arch.num_query_groups, arch.num_attention_heads // arch.num_query_groups
    d = arch.hidden_size // arch.num_attention_heads
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * d, *tail)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_megatron(
    hf: dict[str, torch.Tensor],
    arch: LlamaArchitecture,
    padded_vocab: int,
    *,
    layer_norms_fused: bool = False,
) -> dict[str, torch.Tensor]:
    """Full megatron state dict from a Hugging Face one (all names checked)."""
    norms = _names(layer_norms_fused)

    def take(name: str) -> torch.Tensor:
        try:
            return hf[name]
        except KeyError:
            raise ConversionError(f"tensor {name} is missing from the checkpoint") from None

    out = {
        "embedding.word_embeddings.weight": _pad_rows(
            take("model.embed_tokens.weight"), padded_vocab
        ),
        "decoder.final_layernorm.weight": take("model.norm.weight"),
        "output_layer.weight": _pad_rows(take("lm_head.weight"), padded_vocab),
    }
    for i in range(arch.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        out[dst + norms["input"]] = take(src + "input_layernorm.weight")
        out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            take(attn + "q_proj.weight"),
            take(attn + "k_proj.weight"),
            take(attn + "v_proj.weight"),
            arch,
        )
        if arch.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                take(attn + "q_proj.bias"),
                take(attn + "k_proj.bias"),
                take(attn + "v_proj.bias"),
                arch,
            )
        out[dst + "self_attention.linear_proj.weight"] = take(attn + "o_proj.weight")
        out[dst + norms["pre_mlp"]] = take(src + "post_attention_layernorm.weight")
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")]
        )
        out[dst + "mlp.linear_fc2.weight"] = take(src + "mlp.down_proj.weight")
    return out


def megatron_to_hf(
    full: dict[str, torch.Tensor], arch: LlamaArchitecture, *, layer_norms_fused: bool = False
) -> dict[str, torch.Tensor]:
    """Hugging Face state dict from a full megatron one (padding removed)."""
    norms = _names(layer_norms_fused)
    v = arch.vocab_size
    out = {
        "model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:v],
        "model.norm.weight": full["decoder.final_layernorm.weight"],
        "lm_head.weight": full["output_layer.weight"][:v],
    }
    for i in range(arch.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = dst + "self_attn."
        out[dst + "input_layernorm.weight"] = full[src + norms["input"]]
        q, k, vv = _split_qkv(full[src + "self_attention.linear_qkv.weight"], arch)
        out[attn + "q_proj.weight"], out[attn + "k_proj.weight"], out[attn + "v_proj.weight"] = (
            q,
            k,
            vv,
        )
        if arch.qkv_bias:
            qb, kb, vb = _split_qkv(full[src + "self_attention.linear_qkv.bias"], arch)
            out[attn + "q_proj.bias"], out[attn + "k_proj.bias"], out[attn + "v_proj.bias"] = (
                qb,
                kb,
                vb,
            )
        out[attn + "o_proj.weight"] = full[src + "self_attention.linear_proj.weight"]
        out[dst + "post_attention_layernorm.weight"] = full[src + norms["pre_mlp"]]
        gate, up = full[src + "mlp.linear_fc1.weight"].chunk(2)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        out[dst + "mlp.down_proj.weight"] = full[src + "mlp.linear_fc2.weight"]
    return {k: t.contiguous() for k, t in out.items()}


# ---- files -------------------------------------------------------------------------------


def read_hf_checkpoint(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and every tensor of model.safetensors or its sharded index."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{config_path}: no such file (not a Hugging Face checkpoint)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{config_path}: not JSON ({err.msg})") from None
    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise ConversionError(f"{path}: no such file")
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError) as err:
            raise ConversionError(f"{path}: not a readable safetensors file ({err})") from None
    return config, tensors


def write_hf_checkpoint(
    directory: str | Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    *,
    tokenizer_dir: str | Path | None = None,
    shard_bytes: int = 4 << 30,
) -> None:
    """safetensors shards with an index, config.json, and the tokenizer's files; written to
    a temporary directory and renamed when complete."""
    import shutil

    from safetensors.torch import save_file

    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if size and size + t.numel() * t.element_size() > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * t.element_size()
    weight_map = {}
    for i, shard in enumerate(shards):
        name = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps(
                {
                    "metadata": {
                        "total_size": sum(t.numel() * t.element_size() for t in tensors.values())
                    },
                    "weight_map": weight_map,
                },
                indent=1,
            )
        )
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer_dir is not None:
        for pattern in ("tokenizer*", "special_tokens_map.json", "*.model"):
            for f in Path(tokenizer_dir).glob(pattern):
                if f.is_file():
                    shutil.copy(f, tmp / f.name)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def tokenizer_in(directory: str | Path) -> Path | None:
    """The tokenizer a Hugging Face checkpoint ships: tokenizer.json, else tokenizer.model."""
    directory = Path(directory)
    for name in ("tokenizer.json", "tokenizer.model"):
        if (directory / name).is_file():
            return directory / name
    return None


# ---- tensor-parallel shards without a model (offline conversion) -------------------------

# (partition dim, stride) of megatron-core's tensor-parallel parameters by name suffix; all
# other parameters (norms) are replicated. tests/models check this against the attributes
# megatron-core sets on a built model.
PARTITIONS = {
    "embedding.word_embeddings.weight": (0, 1),
    "output_layer.weight": (0, 1),
    "self_attention.linear_qkv.weight": (0, 1),
    "self_attention.linear_qkv.bias": (0, 1),
    "self_attention.linear_proj.weight": (1, 1),
    "mlp.linear_fc1.weight": (0, 2),
    "mlp.linear_fc2.weight": (1, 1),
}


def partition_of(name: str) -> tuple[int, int] | None:
    for suffix, partition in PARTITIONS.items():
        if name.endswith(suffix):
            return partition
    return None


def shard_state(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """One tensor-parallel rank's part of a full state dict."""
    out = {}
    for name, tensor in full.items():
        partition = partition_of(name)
        if partition is None or world == 1:
            out[name] = tensor
            continue
        dim, stride = partition
        chunk = tensor.shape[dim] // (world * stride)
        out[name] = torch.cat(torch.split(tensor, chunk, dim=dim)[rank::world], dim=dim)
    return {k: v.contiguous() for k, v in out.items()}


def unshard_state(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full state dict from every tensor-parallel rank's part (inverse of shard_state)."""
    world = len(shards)
    out = {}
    for name in shards[0]:
        partition = partition_of(name)
        if partition is None or world == 1:
            out[name] = shards[0][name]
            continue
        dim, stride = partition
        chunks = [s[name].chunk(stride, dim=dim) for s in shards]
        out[name] = torch.cat([chunks[r][k] for k in range(stride) for r in range(world)], dim=dim)
    return out


# ---- with a built model --------------------------------------------------------------------


def renamed_for(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Norm names of `state` as `model`'s layer spec has them (local <-> Transformer Engine)."""
    fused = layer_norms_fused(model)
    pairs = [
        ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ]
    out = {}
    for name, tensor in state.items():
        for local, te in pairs:
            if fused and name.endswith(local):
                name = name[: -len(local)] + te
            elif not fused and name.endswith(te):
                name = name[: -len(te)] + local
        out[name] = tensor
    return out


def load_into(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shard of each full tensor into the model's parameters."""
    from megatron.core import parallel_state

    from .sharding import shard_like

    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    full = renamed_for(model, full)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(full))
    if missing:
        raise ConversionError(f"no weights for {missing[0]} (and {len(missing) - 1} more)")
    with torch.no_grad():
        for name, param in params.items():
            shard = shard_like(full[name], param, rank, world)
            if shard.shape != param.shape:
                raise ConversionError(
                    f"{name}: checkpoint shard {tuple(shard.shape)} does not fit the model's "
                    f"{tuple(param.shape)} (another architecture?)"
                )
            param.copy_(shard.to(param.dtype))


def gather_full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (TP 1 layout) state of a tensor-parallel model, on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    world = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name, param in model.named_parameters():
        data = param.detach().float().contiguous()
        if world == 1 or not getattr(param, "tensor_model_parallel", False):
            out[name] = data.cpu()
            continue
        parts = [torch.empty_like(data) for _ in range(world)]
        dist.all_gather(parts, data, group=group)
        dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
        # undo shard_like: each rank holds `stride` chunks, rank-major within each stride slot
        chunks = [p.chunk(stride, dim=dim) for p in parts]
        out[name] = torch.cat(
            [chunks[r][s] for s in range(stride) for r in range(world)], dim=dim
        ).cpu()
    return out


def layer_norms_fused(model: torch.nn.Module) -> bool:
    return any(n.endswith("linear_qkv.layer_norm_weight") for n, _ in model.named_parameters())


# ---- the weights directory: per tensor-parallel rank safetensors -----------------------------

WEIGHTS = "model"


def write_weights(
    directory: str | Path,
    shards: list[dict[str, torch.Tensor]],
    arch: LlamaArchitecture,
    tokenizer: str | Path | None,
) -> None:
    """<directory>/model/tpNN.safetensors (one per tensor-parallel rank, megatron names,
    local-spec norm names), arch.json, and the tokenizer file."""
    import shutil

    from safetensors.torch import save_file

    out = Path(directory) / WEIGHTS
    out.mkdir(parents=True, exist_ok=True)
    for rank, shard in enumerate(shards):
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in shard.items()},
            str(out / f"tp{rank:02d}.safetensors"),
        )
    (out / "arch.json").write_text(arch.model_dump_json(indent=1))
    if tokenizer is not None:
        shutil.copy(tokenizer, out / Path(tokenizer).name)


def read_weights(directory: str | Path) -> tuple[LlamaArchitecture, list[dict[str, torch.Tensor]]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(directory) / WEIGHTS
    arch_path = root / "arch.json"
    if not arch_path.is_file():
        raise ConversionError(f"{arch_path}: no such file (not a del-megatron weights directory)")
    arch = LlamaArchitecture.model_validate_json(arch_path.read_text())
    files = sorted(root.glob("tp*.safetensors"))
    if not files:
        raise ConversionError(f"{root}: no tpNN.safetensors files")
    shards = []
    for f in files:
        try:
            shards.append(load_file(str(f)))
        except (SafetensorError, OSError) as err:
            raise ConversionError(f"{f}: not a readable safetensors file ({err})") from None
    return arch, shards


def weights_tokenizer(directory: str | Path) -> Path | None:
    root = Path(directory) / WEIGHTS
    for pattern in ("tokenizer.json", "*.model"):
        found = sorted(root.glob(pattern))
        if found:
            return found[0]
    return None
