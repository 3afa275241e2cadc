"""Hugging Face config.json <-> LlamaArchitecture: every field that changes the computation is
read, in the layouts of transformers 4.x (`rope_theta`, `rope_scaling`) and 5.x
(`rope_parameters`), or refused with one line naming the field and its value.

The dict is interpreted by the installed transformers' own config class (AutoConfig), so a
field the file leaves out takes the default transformers itself would run the model with.
Export builds the config through the same class: the installed version writes its own
layout, and `from_pretrained` gets back the same class.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..errors import UserError
from .architecture import LlamaArchitecture

CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# The only Llama-3-style RoPE scaling megatron-core implements: these three are fixed there.
LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class ConversionError(UserError, ValueError):
    """A checkpoint that cannot be converted exactly; the message names the file, field or
    tensor."""


@contextlib.contextmanager
def _quiet_transformers():
    """transformers logs notices about configs it normalizes; the caller decides what to say."""
    from transformers.utils import logging

    previous = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(previous)


def _config_object(config: dict[str, Any]):
    import transformers

    fields = dict(config)
    family = fields.pop("model_type", None)
    if family not in CLASSES:
        raise ConversionError(f"config.json: model_type {family!r} is not one of {sorted(CLASSES)}")
    try:
        with _quiet_transformers():
            return family, transformers.AutoConfig.for_model(family, **fields)
    except (TypeError, ValueError, KeyError) as err:
        raise ConversionError(f"config.json: transformers rejects it ({err})") from None


def _rope(hf) -> tuple[float, dict[str, Any]]:
    """(theta, the scaling fields) from either layout."""
    parameters = getattr(hf, "rope_parameters", None)
    if isinstance(parameters, dict) and parameters:  # transformers 5
        if not isinstance(parameters.get("rope_theta"), int | float):
            raise ConversionError(f"config.json: rope_parameters {parameters} has no rope_theta")
        return float(parameters["rope_theta"]), parameters
    scaling = getattr(hf, "rope_scaling", None) or {}
    return float(getattr(hf, "rope_theta", 10000.0)), scaling


def _refuse(field: str, value: Any, why: str) -> ConversionError:
    return ConversionError(f"config.json: {field}={value!r} is not supported ({why})")


def _sliding_window(family: str, hf) -> int | None:
    """The attention window any layer uses, None if every layer attends to everything."""
    window = getattr(hf, "sliding_window", None)
    if family == "mistral" or window is None:
        return window
    layer_types = getattr(hf, "layer_types", None)  # transformers 5 (Qwen2)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    uses = getattr(hf, "use_sliding_window", False)
    return window if uses and hf.max_window_layers < hf.num_hidden_layers else None


def architecture_from_hf(config: dict[str, Any], *, divisible_by: int = 128) -> LlamaArchitecture:
    """The architecture of a config.json, or ConversionError naming the field it cannot
    reproduce exactly."""
    family, hf = _config_object(config)
    theta, scaling = _rope(hf)
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    factor = None
    if rope_type == "llama3":
        for key, fixed in LLAMA3_FIXED.items():
            if float(scaling.get(key, -1)) != fixed:
                raise _refuse(
                    f"rope {key}", scaling.get(key), f"megatron-core's llama3 scaling fixes {fixed}"
                )
        factor = float(scaling["factor"])
    elif rope_type != "default":
        raise _refuse("rope_type", rope_type, "only default and llama3 RoPE are reproduced")
    partial = scaling.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise _refuse("partial_rotary_factor", partial, "rotary embedding on every channel only")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", hf.hidden_act, "Llama-family SwiGLU uses silu")
    if getattr(hf, "mlp_bias", False):
        raise _refuse("mlp_bias", True, "the MLP has no biases in this project's models")
    if getattr(hf, "attention_bias", False):
        raise _refuse(
            "attention_bias",
            True,
            "Llama's attention bias includes o_proj, which megatron-core "
            "can only add together with biases on every linear layer",
        )
    for field in ("attention_dropout", "hidden_dropout"):
        if float(getattr(hf, field, 0.0) or 0.0) != 0.0:
            raise _refuse(field, getattr(hf, field), "training runs without dropout")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None)
    if head_dim == hf.hidden_size // heads and hf.hidden_size % heads == 0:
        head_dim = None
    try:
        return LlamaArchitecture(
            family=family,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            ffn_hidden_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_attention_heads=heads,
            num_query_groups=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            max_position_embeddings=hf.max_position_embeddings,
            rope_theta=theta,
            rope_scaling_factor=factor,
            sliding_window=_sliding_window(family, hf),
            norm_epsilon=float(hf.rms_norm_eps),
            qkv_bias=family == "qwen2",
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            make_vocab_size_divisible_by=divisible_by,
        )
    except ValueError as err:  # pydantic: a value out of range
        raise ConversionError(f"config.json: {str(err).splitlines()[-2].strip()}") from None


def hf_config(arch: LlamaArchitecture, dtype: str = "bfloat16"):
    """The transformers config object of `arch` (its class writes config.json); refuses what
    the family's transformers class cannot express."""
    import transformers

    if arch.qkv_bias != (arch.family == "qwen2"):
        raise ConversionError(
            f"model.qkv_bias={arch.qkv_bias} with family={arch.family}: transformers' Qwen-2 "
            "always has a QKV bias, Llama and Mistral have none (set model.family)"
        )
    if arch.sliding_window is not None and arch.family == "llama":
        raise ConversionError("model.sliding_window is set but family=llama has none")

    fields: dict[str, Any] = {
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_query_groups,
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.norm_epsilon,
        "hidden_act": "silu",
        "tie_word_embeddings": arch.tie_word_embeddings,
        "rope_theta": arch.rope_theta,
        "rope_scaling": (
            {"rope_type": "llama3", "factor": arch.rope_scaling_factor, **LLAMA3_FIXED}
            if arch.rope_scaling_factor is not None
            else None
        ),
    }
    if arch.head_dim is not None:
        fields["head_dim"] = arch.head_dim
    if arch.family == "llama":
        fields.update(attention_bias=False, mlp_bias=False)
    elif arch.family == "mistral":
        fields["sliding_window"] = arch.sliding_window
    else:  # qwen2: the window, if any, on every layer
        fields.update(
            use_sliding_window=arch.sliding_window is not None,
            sliding_window=arch.sliding_window,
            max_window_layers=0,
        )
    with _quiet_transformers():
        config = transformers.AutoConfig.for_model(arch.family, **fields)
        config.architectures = [CLASSES[arch.family]]
        if hasattr(config, "dtype"):  # transformers >= 4.56; `torch_dtype` before
            config.dtype = dtype
        else:
            config.torch_dtype = dtype
    return config
