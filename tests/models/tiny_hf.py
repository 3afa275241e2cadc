"""Tiny random Hugging Face models of every supported variant, built and saved offline by the
installed transformers (its own config layout: transformers 5 writes rope_parameters)."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=120,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
VARIANTS = {
    "llama-mha": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 4}),
    "codellama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 4, "rope_theta": 1e6}),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "max_position_embeddings": 16384,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    # Llama-3.2 1B/3B: tied embeddings, llama3 RoPE with factor 32
    "llama3.2-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "max_position_embeddings": 16384,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    "llama-head-dim": ("LlamaConfig", "LlamaForCausalLM", {"head_dim": 32}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1e6}),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
}


def tiny_hf_model(variant: str, directory: Path | None = None, **overrides):
    """The model (float32, eval mode, non-trivial norms and biases), saved to `directory`."""
    import transformers

    config_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    if directory is not None:
        model.save_pretrained(directory)
    return model
