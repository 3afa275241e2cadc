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


def test_convert_cli_round_trip_is_identity(tmp_path):
    from del_megatron.cli.convert import main as convert

    hf = tiny_hf_model("qwen2", tmp_path / "hf")
    assert (
        convert(
            [
                "hf-to-megatron",
                "--hf",
                str(tmp_path / "hf"),
                "--out",
                str(tmp_path / "m"),
                "--tp",
                "2",
                "--divisible-by",
                "64",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "m" / "model").glob("*.safetensors")) == [
        "tp00.safetensors",
        "tp01.safetensors",
    ]
    assert (
        convert(
            [
                "megatron-to-hf",
                "--checkpoint",
                str(tmp_path / "m"),
                "--out",
                str(tmp_path / "back"),
                "--model-type",
                "qwen2",
            ]
        )
        == 0
    )
    _, back = read_hf_checkpoint(tmp_path / "back")
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back[name], tensor), name
    assert (
        convert(
            ["megatron-to-hf", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]
        )
        == 2
    )


@pytest.mark.slow
def test_training_from_hf_weights_and_export(tmp_path, synth_tokenizer, synth_shards):
    """init.hf: a transformers model (vocabulary of the run's tokenizer, which it ships)
    trains 2 steps at TP 2 with a vanishing learning rate; the checkpoint's weights exported
    with del-convert reload in transformers equal to the start."""
    import shutil

    import transformers

    from del_megatron.cli.convert import main as convert

    from ..distributed.launcher import ROOT

    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    start = transformers.LlamaForCausalLM(config).float()
    start.save_pretrained(tmp_path / "hf", safe_serialization=True)
    shutil.copy(synth_tokenizer, tmp_path / "hf" / "tokenizer.model")
    out = run_torchrun(
        "-m del_megatron.cli.train",
        2,
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        "data.tokenizer=null",
        f"init.hf={tmp_path / 'hf'}",
        f"data.sources=[{{manifest: {synth_shards}}}]",
        "eval.sources=[]",
        "train.steps=2",
        "optim.lr=1e-12",
        "optim.min_lr=0",
        "logging.wandb=disabled",
        f"output_dir={tmp_path / 'run'}",
    )
    assert "checkpoint:" in out
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000002"
    assert (
        convert(
            ["megatron-to-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "export")]
        )
        == 0
    )
    assert (tmp_path / "export" / "tokenizer.model").is_file()
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export").float()
    original = start.state_dict()
    for name, tensor in reloaded.state_dict().items():
        assert torch.allclose(tensor, original[name], atol=1e-6), name
