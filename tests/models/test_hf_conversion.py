"""Hugging Face import/export against tiny random models saved by the installed transformers:
every supported variant (MHA, CodeLlama's rope theta, Llama-3 rope scaling, Llama-3.2's
tied embeddings with rope factor 32, a head_dim of its own, Mistral, Qwen-2 with QKV bias,
Qwen-2 with tied embeddings) imported at TP 1 and
TP 2 gives transformers' logits within 1e-5 (float32) and exports to a checkpoint that
transformers loads as the same class with the same logits; fields that would change the
math are refused with one line naming them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from del_megatron.cli.convert import main as convert
from del_megatron.models.hf_tensors import spec_name
from del_megatron.models.weight_files import HFCheckpoint, write_files_list

from ..distributed.launcher import run_torchrun
from .tiny_hf import VARIANTS, tiny_hf_model


def logits_of(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_import_export_parity_for_every_variant(tp, tmp_path):
    import transformers

    tokens = torch.randint(0, 120, (2, 17), generator=torch.Generator().manual_seed(1))
    args, originals = [], {}
    for variant in VARIANTS:
        model = tiny_hf_model(variant, tmp_path / variant)
        originals[variant] = (type(model), logits_of(model, tokens))
        torch.save({"tokens": tokens, "logits": originals[variant][1]}, tmp_path / f"{variant}.pt")
        args += [
            str(tmp_path / variant),
            str(tmp_path / f"{variant}.pt"),
            str(tmp_path / f"{variant}-out"),
        ]
    output = run_torchrun("hf_parity.py", tp, *args)
    for variant, (cls, expected) in originals.items():
        assert f"at TP {tp} {tmp_path / variant}" in output, variant
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{variant}-out")
        assert type(reloaded) is cls, variant
        got = logits_of(reloaded.float().eval(), tokens)
        assert torch.allclose(got, expected, atol=1e-5), variant


def write_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 10000.0,
}


@pytest.mark.parametrize(
    ("variant", "changes", "expected"),
    [
        ("llama-mha", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("llama-mha", {"mlp_bias": True}, "mlp_bias=True is not supported"),
        ("llama-mha", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ("llama-mha", {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
        (
            "llama-mha",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "rope_type='dynamic' is not supported",
        ),
        (
            "llama-mha",
            {"rope_parameters": LLAMA3, "max_position_embeddings": 16384},
            "rope high_freq_factor=2.0 is not supported",
        ),
        (
            "llama-mha",
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor=0.5 is not supported",
        ),
        ("llama-mha", {"model_type": "gemma"}, "model_type 'gemma' is not one of"),
        (
            "llama-mha",
            {"num_hidden_layers": 3},
            "tensor model.layers.2.input_layernorm.weight is missing",
        ),
        (
            "llama-mha",
            {"intermediate_size": 80},
            "has shape (96, 64), config.json implies (80, 64)",
        ),
    ],
)
def test_fields_that_change_the_math_are_refused(variant, changes, expected, tmp_path, capsys):
    tiny_hf_model(variant, tmp_path / "hf")
    write_config(tmp_path / "hf", **changes)
    capsys.readouterr()  # transformers' own output while saving
    status = convert(["hf-to-megatron", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("del-convert hf-to-megatron: error:"), err
    assert expected in err, err
    assert not (tmp_path / "m").exists()


def test_legacy_config_layout_is_read(tmp_path, capsys):
    """transformers 4.x layout: rope_theta and rope_scaling at the top level."""
    model = tiny_hf_model("codellama", tmp_path / "hf")
    write_config(tmp_path / "hf", rope_parameters=None, rope_theta=1e6, rope_scaling=None)
    assert (
        convert(
            [
                "hf-to-megatron",
                "--hf",
                str(tmp_path / "hf"),
                "--out",
                str(tmp_path / "m"),
                "--divisible-by",
                "64",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "m" / "model" / "arch.json").read_text())["rope_theta"] == 1e6
    del model


def test_extra_tensors_are_refused(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    tiny_hf_model("llama-mha", tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(path))
    assert (
        convert(["hf-to-megatron", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m")]) == 2
    )
    assert "o_proj.bias (and 0 more) has no place in the model" in capsys.readouterr().err


def test_bad_checkpoints_name_the_file(tmp_path, capsys):
    from del_megatron.models.hf_config import ConversionError

    with pytest.raises(ConversionError, match="config.json: no such file"):
        HFCheckpoint(tmp_path)
    tiny_hf_model("llama-mha", tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with pytest.raises(ConversionError, match="model.safetensors: not a readable safetensors"):
        HFCheckpoint(tmp_path / "hf")


def round_trip(tmp_path, variant: str, *export_args: str):
    import transformers

    model = tiny_hf_model(variant, tmp_path / "hf")
    args = ["--divisible-by", "64"]
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
                *args,
            ]
        )
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "m" / "model").glob("*.safetensors")) == [
        "tp00.safetensors",
        "tp01.safetensors",
    ]
    return model, transformers


def test_export_writes_the_original_model_type_and_training_dtype(tmp_path, capsys):
    model, transformers = round_trip(tmp_path, "qwen2-tied")
    out = tmp_path / "back"
    capsys.readouterr()
    assert convert(["megatron-to-hf", "--checkpoint", str(tmp_path / "m"), "--out", str(out)]) == 0
    said = capsys.readouterr()
    lines = said.out.splitlines()
    assert lines[0] == f"del-convert: exporting {tmp_path / 'm'} to {out}"  # before the work
    assert lines[-1].startswith(f"next: transformers.AutoModelForCausalLM.from_pretrained('{out}')")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is True
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(back) is type(model)
    assert next(back.parameters()).dtype == torch.float32  # as stored (float32 weights)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert "lm_head.weight" not in HFCheckpoint(out).shapes  # tied: stored once

    half = tmp_path / "bf16"
    assert (
        convert(
            [
                "megatron-to-hf",
                "--checkpoint",
                str(tmp_path / "m"),
                "--out",
                str(half),
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    assert json.loads((half / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    stored = HFCheckpoint(half).read("model.norm.weight", None, None, None)
    assert stored.dtype == torch.bfloat16
    assert torch.equal(stored, model.state_dict()["model.norm.weight"].bfloat16())


def test_transformer_engine_norm_names_export(tmp_path):
    """Weights saved on GPU carry Transformer Engine's fused norm names."""
    from safetensors.torch import load_file, save_file

    model, transformers = round_trip(tmp_path, "mistral")
    for path in (tmp_path / "m" / "model").glob("tp*.safetensors"):
        tensors = load_file(str(path))
        renamed = {spec_name(n, layer_norms_fused=True): t for n, t in tensors.items()}
        assert any(n.endswith("linear_qkv.layer_norm_weight") for n in renamed)
        save_file(renamed, str(path))
    write_files_list(tmp_path / "m" / "model")  # the files as the GPU run wrote them
    out = tmp_path / "back"
    assert convert(["megatron-to-hf", "--checkpoint", str(tmp_path / "m"), "--out", str(out)]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_convert_mistakes_are_one_line(tmp_path, capsys):
    assert (
        convert(
            ["megatron-to-hf", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]
        )
        == 2
    )
    assert f"{tmp_path / 'nope'}: does not exist" in capsys.readouterr().err
    tiny_hf_model("llama-mha", tmp_path / "hf")
    assert (
        convert(
            [
                "hf-to-megatron",
                "--hf",
                str(tmp_path / "hf"),
                "--out",
                str(tmp_path / "m"),
                "--tp",
                "3",
            ]
        )
        == 2
    )
    assert "--tp 3: num_attention_heads=4 is not divisible" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        convert(
            [
                "hf-to-megatron",
                "--hf",
                str(tmp_path / "hf"),
                "--out",
                str(tmp_path / "m"),
                "--tp",
                "0",
            ]
        )
    assert exit_info.value.code == 2
    assert "--tp: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_init_hf_first_step_loss_equals_transformers(tmp_path, synth_tokenizer):
    """init.hf of a tied-embedding Qwen2 model at TP 2: the first step's loss (before any
    update) equals transformers' loss on the same batch."""
    model = tiny_hf_model("qwen2-tied", tmp_path / "hf", vocab_size=800, max_position_embeddings=64)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 800, (2, 17), generator=gen)
    with torch.no_grad():
        loss = model(tokens, labels=tokens).loss  # mean CE of next-token predictions
    torch.save({"tokens": tokens, "loss": loss}, tmp_path / "batch.pt")
    output = run_torchrun(
        "init_hf_loss.py", 2, str(tmp_path / "hf"), str(synth_tokenizer), str(tmp_path / "batch.pt")
    )
    assert "OK first-step loss" in output


@pytest.mark.slow
def test_training_from_hf_weights_and_export(tmp_path, synth_tokenizer, synth_shards):
    """init.hf: a transformers model (vocabulary of the run's tokenizer, which it ships)
    trains 2 steps at TP 2 with a vanishing learning rate; the checkpoint's weights exported
    with del-convert reload in transformers equal to the start."""
    import transformers

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
    start.save_pretrained(tmp_path / "hf")
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
