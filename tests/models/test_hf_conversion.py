"""Hugging Face import/export: tiny random Llama, Mistral and Qwen-2 models built offline;
imported at TP 1 and TP 2 their logits equal transformers' within 1e-5 (float32); export
reloads in transformers with identical tensors; import -> export -> import is the identity."""

from __future__ import annotations

import pytest
import torch

from del_megatron.models.hf import ConversionError, read_hf_checkpoint

from ..distributed.launcher import run_torchrun

CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
}


def tiny_hf_model(model_type: str, directory):
    import transformers

    config_cls, model_cls, extra = CONFIGS[model_type]
    config = getattr(transformers, config_cls)(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_import_export_parity(model_type, tmp_path):
    import transformers

    hf = tiny_hf_model(model_type, tmp_path / "hf")
    tokens = torch.randint(0, 120, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = hf(tokens).logits
    torch.save({"tokens": tokens, "logits": logits}, tmp_path / "expected.pt")
    for tp in (1, 2):
        out = run_torchrun(
            "hf_parity.py",
            tp,
            str(tmp_path / "hf"),
            str(tmp_path / "expected.pt"),
            str(tmp_path / f"export-tp{tp}"),
        )
        assert f"OK {model_type} at TP {tp}" in out
        reloaded = (
            getattr(transformers, CONFIGS[model_type][1])
            .from_pretrained(tmp_path / f"export-tp{tp}")
            .float()
        )
        original = dict(hf.state_dict())
        for name, tensor in reloaded.state_dict().items():
            assert torch.equal(tensor, original[name]), name


def test_bad_checkpoints_name_the_file(tmp_path):
    with pytest.raises(ConversionError, match="config.json: no such file"):
        read_hf_checkpoint(tmp_path)
    tiny_hf_model("llama", tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with pytest.raises(ConversionError, match="model.safetensors: not a readable safetensors"):
        read_hf_checkpoint(tmp_path / "hf")
