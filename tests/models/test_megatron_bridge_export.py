"""Megatron-Bridge's Hugging Face export of a model built by NumericLossGPTModelProvider
(megatron-bridge 0.6.2, in .venv312; skipped where Bridge is not installed).

Bridge's export takes each mapping's config from the model (`model.config`, the provider
itself) and walks it with `remove_non_pickleables` (models/conversion/utils.py), which
copies every object with a `__dict__` and sets each attribute again. Before: that walk set
the fields of the frozen NumericLossConfig and the export failed for every loss kind
(pydantic ValidationError 'Instance is frozen', from the QKV mapping). The export is what a
Bridge user runs after training: `AutoBridge.save_hf_pretrained`, then transformers'
`from_pretrained`, the loss config in no part of it."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from pydantic import ValidationError

from del_megatron import DigitVocab, NumericLossConfig

pytestmark = pytest.mark.megatron

if importlib.util.find_spec("megatron.bridge") is None:  # installed but failing to import fails
    pytest.skip("Megatron-Bridge is not installed (.venv312 has it)", allow_module_level=True)


@pytest.fixture(scope="module")
def bridge():
    from tests.gpu_only_stubs import install

    install()
    from del_megatron.models import megatron_bridge

    return megatron_bridge


@pytest.mark.parametrize("kind", ["del", "emo"])
def test_save_hf_pretrained_loads_in_transformers_with_the_megatron_weights(
    bridge, tmp_path, one_process_groups, bpe_split_digits, kind
):
    """A tiny HF Llama imported by AutoBridge into the numeric provider, built by Bridge's own
    provide_distributed_model, its weights moved off the imported ones (a trained model),
    saved by Bridge's save_hf_pretrained and loaded by transformers: every exported weight
    equals the Megatron model's (QKV and gate/up split back), and the config holds no loss."""
    from megatron.bridge import AutoBridge
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import unwrap_model
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from del_megatron.models.spec import apply_device_shims

    from .test_megatron_bridge import on_cpu
    from .tiny_hf import tiny_hf_model

    source, exported = tmp_path / "hf", tmp_path / "exported"
    # a checkpoint with its tokenizer (Bridge's export copies it); its vocabulary holds every
    # token id of the tokenizer, and often more
    PreTrainedTokenizerFast(tokenizer_object=bpe_split_digits).save_pretrained(source)
    vocab = bpe_split_digits.get_vocab_size() + 16
    hf = tiny_hf_model("llama-mha", source, vocab_size=vocab, max_position_embeddings=16)
    auto = AutoBridge.from_hf_pretrained(str(source))
    loss = NumericLossConfig(kind=kind, normalize="tokens")
    provider = on_cpu(
        bridge.NumericLossGPTModelProvider.from_provider(
            auto.to_megatron_provider(), DigitVocab.from_hf(str(source)), loss
        )
    )
    provider.register_pre_wrap_hook(
        lambda ms: [apply_device_shims(m, torch.device("cpu")) for m in ms]
    )
    (built,) = provider.provide_distributed_model(
        wrap_with_ddp=False,
        use_cpu_initialization=True,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    (model,) = unwrap_model([built])
    torch.manual_seed(7)
    with torch.no_grad():  # so that equal weights are the export's, not the import's
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert model.config.numeric_loss == loss  # the provider is the model's config

    auto.save_hf_pretrained([built], str(exported), show_progress=False)

    loaded = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    exported_weights = dict(loaded.state_dict())
    streamed = dict(auto.export_hf_weights([built], cpu=True, show_progress=False))
    assert streamed.keys() == exported_weights.keys() == hf.state_dict().keys()
    megatron = dict(model.named_parameters())
    compared = set()
    heads, dim = hf.config.num_attention_heads, hf.config.head_dim
    for i in range(hf.config.num_hidden_layers):
        layer = f"decoder.layers.{i}."
        # Megatron's QKV rows are grouped per query group: [q_g, k_g, v_g] for each group g
        # (MHA: one head each), [heads * 3 * dim, h]
        qkv = megatron[layer + "self_attention.linear_qkv.weight"]
        q, k, v = qkv.view(heads, 3, dim, -1).unbind(1)
        gate, up = megatron[layer + "mlp.linear_fc1.weight"].chunk(2)
        expected = {
            "self_attn.q_proj.weight": q.reshape(heads * dim, -1),
            "self_attn.k_proj.weight": k.reshape(heads * dim, -1),
            "self_attn.v_proj.weight": v.reshape(heads * dim, -1),
            "self_attn.o_proj.weight": megatron[layer + "self_attention.linear_proj.weight"],
            "mlp.gate_proj.weight": gate,
            "mlp.up_proj.weight": up,
            "mlp.down_proj.weight": megatron[layer + "mlp.linear_fc2.weight"],
            "input_layernorm.weight": megatron[layer + "input_layernorm.weight"],
            "post_attention_layernorm.weight": megatron[layer + "pre_mlp_layernorm.weight"],
        }
        for name, weight in expected.items():
            name = f"model.layers.{i}.{name}"
            assert torch.equal(exported_weights[name], weight), name
            compared.add(name)
    for name, weight in {
        "model.embed_tokens.weight": megatron["embedding.word_embeddings.weight"][:vocab],
        "lm_head.weight": megatron["output_layer.weight"][:vocab],
        "model.norm.weight": megatron["decoder.final_layernorm.weight"],
    }.items():
        assert torch.equal(exported_weights[name], weight), name
        compared.add(name)
    assert compared == exported_weights.keys()
    for name, weight in streamed.items():
        assert torch.equal(exported_weights[name], weight), name
    # the export is of the Llama alone: no loss option, no EMO cost embedding
    config = json.loads((exported / "config.json").read_text())
    assert not any("numeric" in key or "loss" in key for key in config)
    assert not any("emo_cost" in name for name in exported_weights)
    # the provider's own loss config was not touched by the export's walk, and stays frozen
    assert provider.numeric_loss == loss
    assert model.head.cfg == loss
    with pytest.raises(ValidationError, match="frozen"):
        provider.numeric_loss.kind = "mle"
