"""The Megatron-Bridge adapter (models/megatron_bridge.py) against Bridge's real modules
(megatron-bridge 0.6.2, in .venv312; skipped where Bridge is not installed). Only the
GPU-only libraries Bridge imports at module level are stubbed (tests/gpu_only_stubs.py).
Bridge's own train_step with the adapter is in tests/distributed/test_megatron_schedules.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, numeric_loss
from del_megatron.errors import UserError
from tests.utils import assert_close

pytestmark = pytest.mark.megatron

if importlib.util.find_spec("megatron.bridge") is None:  # installed but failing to import fails
    pytest.skip("Megatron-Bridge is not installed (.venv312 has it)", allow_module_level=True)

VOCAB = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[20], vocab_size=130)
LOSS = NumericLossConfig(kind="del", normalize="tokens")


@pytest.fixture(scope="module")
def bridge():
    from tests.gpu_only_stubs import install

    install()
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.losses import masked_next_token_loss

    from del_megatron.models import megatron_bridge

    return megatron_bridge, GPTModelProvider, masked_next_token_loss


def hf_provider(tmp_path, **config):
    """What a recipe's `AutoBridge.from_hf_pretrained(...).to_megatron_provider()` gives, for a
    tiny Qwen2 (QKV bias, tied embeddings, rope base 1e6) written here."""
    from megatron.bridge import AutoBridge
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=130,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        rope_theta=1e6,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
        **config,
    ).save_pretrained(tmp_path)
    return AutoBridge.from_hf_pretrained(str(tmp_path)).to_megatron_provider(load_weights=False)


def on_cpu(provider):
    """The settings a CPU run of Bridge's provider needs (its recipe's are for GPUs)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from del_megatron.models.spec import FUSION_FLAGS, gpt_layer_spec

    for flag in FUSION_FLAGS:
        setattr(provider, flag, False)
    provider.use_cpu_initialization = True
    provider.transformer_layer_spec = gpt_layer_spec(torch.device("cpu"))
    provider.calculate_per_token_loss = True
    provider.finalize()  # what Bridge's ConfigContainer.validate does before the build
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return provider


def batch():
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(21, 130, (2, 17), generator=gen)
    tokens[:, 4:10] = torch.randint(10, 20, (2, 6), generator=gen)
    mask = (torch.rand(2, 16, generator=gen) > 0.25).float()
    return tokens[:, :-1], tokens[:, 1:].contiguous(), mask, torch.arange(16).expand(2, 16)


def test_the_provider_keeps_bridges_fields_and_provides_the_numeric_model(
    bridge, tmp_path, one_process_groups
):
    from del_megatron.models.gpt import NumericLossGPTModel
    from del_megatron.models.spec import apply_device_shims

    megatron_bridge, _, _ = bridge
    theirs = hf_provider(tmp_path)
    ours = megatron_bridge.NumericLossGPTModelProvider.from_provider(theirs, VOCAB, LOSS)
    assert (ours.rotary_base, ours.add_qkv_bias, ours.share_embeddings_and_output_weights) == (
        1e6,
        True,
        True,
    )
    model = apply_device_shims(on_cpu(ours).provide(), torch.device("cpu"))
    assert type(model) is NumericLossGPTModel
    tokens, labels, mask, positions = batch()
    expected = numeric_loss(model(tokens, positions, None), labels, VOCAB, LOSS, mask)
    output = model(tokens, positions, None, labels=labels, loss_mask=mask)
    assert_close(output.loss, expected.loss, atol=1e-6, what="loss")


def test_the_provider_refuses_what_megatrons_schedules_cannot_sum(
    bridge, tmp_path, one_process_groups
):
    megatron_bridge, _, _ = bridge
    ours = on_cpu(
        megatron_bridge.NumericLossGPTModelProvider.from_provider(
            hf_provider(tmp_path), VOCAB, LOSS
        )
    )
    ours.calculate_per_token_loss = False
    with pytest.raises(UserError, match="calculate_per_token_loss=True"):
        ours.provide()


def test_a_provider_that_builds_its_own_model_is_refused(bridge):
    from megatron.bridge.models.gemma.gemma_provider import GemmaModelProvider

    megatron_bridge, _, _ = bridge
    with pytest.raises(UserError, match="GemmaModelProvider builds its model its own way"):
        megatron_bridge.NumericLossGPTModelProvider.from_provider(
            GemmaModelProvider(num_layers=2, hidden_size=32, num_attention_heads=4), VOCAB, LOSS
        )


def test_bridges_loss_function_fails_loudly_on_the_heads_output(
    bridge, tmp_path, one_process_groups
):
    """masked_next_token_loss reads any tuple as (losses, loss_mask): on the head's output it
    returned loss 21.13 over 4 'tokens' (the scalar loss times the scalar CE) without a word.
    Now it raises, also on the plain tuple Float16Module makes of the output."""
    from megatron.core.transformer.module import float16_to_fp32

    from del_megatron.models.spec import apply_device_shims

    megatron_bridge, _, masked_next_token_loss = bridge
    ours = megatron_bridge.NumericLossGPTModelProvider.from_provider(
        hf_provider(tmp_path), VOCAB, LOSS
    )
    model = apply_device_shims(on_cpu(ours).provide(), torch.device("cpu"))
    tokens, labels, mask, positions = batch()
    output = model(tokens, positions, None, labels=labels, loss_mask=mask)
    for handed in (output, float16_to_fp32(output)):
        with pytest.raises(TypeError, match="megatron_bridge.forward_step"):
            masked_next_token_loss(mask, handed)


def test_the_provider_keeps_autobridges_weight_loading(bridge, tmp_path, one_process_groups):
    """AutoBridge's provider loads the Hugging Face weights in a pre-wrap hook (and skips the
    random init): the numeric provider keeps the hook (before: dropped with the provider, the
    model started from uninitialized memory; the README example's first loss was nan)."""
    from megatron.bridge import AutoBridge

    from .tiny_hf import tiny_hf_model

    megatron_bridge, _, _ = bridge
    hf = tiny_hf_model("qwen2-tied", tmp_path, vocab_size=130, max_position_embeddings=16)
    theirs = AutoBridge.from_hf_pretrained(str(tmp_path)).to_megatron_provider()
    ours = on_cpu(megatron_bridge.NumericLossGPTModelProvider.from_provider(theirs, VOCAB, LOSS))
    (model,) = ours.pre_wrap_hook([ours.provide()])
    assert torch.equal(model.embedding.word_embeddings.weight, hf.model.embed_tokens.weight)


def test_the_readme_example_runs(
    bridge, tmp_path, monkeypatch, capsys, bpe_split_digits, one_process_groups
):
    """The README's Bridge example as a user writes it, with Bridge's pretrain (CUDA from its
    first line) replaced by tests/loop_standins.py's: the config validated, the model provided
    on the CPU with the checkpoint's weights, one step of the example's forward step."""
    import megatron.bridge.training.pretrain as bridge_pretrain
    from transformers import PreTrainedTokenizerFast

    from tests.loop_standins import examples, megatron_bridge_pretrain

    from .tiny_hf import tiny_hf_model

    checkpoint = tmp_path / "models" / "qwen2.5_1.5b"
    PreTrainedTokenizerFast(tokenizer_object=bpe_split_digits).save_pretrained(checkpoint)
    # a checkpoint's vocabulary holds every token id of its tokenizer, and often more
    vocab = bpe_split_digits.get_vocab_size() + 16
    tiny_hf_model("qwen2-tied", checkpoint, vocab_size=vocab, max_position_embeddings=16)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bridge_pretrain, "pretrain", megatron_bridge_pretrain)
    exec(examples()["Megatron-Bridge 0.6.2"], {"__name__": "__main__"})
    assert "OK NumericLossGPTModel: lm loss, objective, numeric" in capsys.readouterr().out


# ---- the forward step, as Bridge's train_step calls it (issue 51) ----------------------------


def bridge_state(provider, **dataset):
    """Bridge's GlobalState with the parts of a ConfigContainer its forward step reads (the
    model's provider, the rerun state machine's checks, the dataset's batch settings, the
    logger's timer levels)."""
    from types import SimpleNamespace

    from megatron.bridge.training.config import LoggerConfig, RerunStateMachineConfig
    from megatron.bridge.training.state import GlobalState

    state = GlobalState()
    state.cfg = SimpleNamespace(
        model=provider,
        rerun_state_machine=RerunStateMachineConfig(check_for_spiky_loss=True),
        dataset=SimpleNamespace(**dataset),
        logger=LoggerConfig(),
        train=None,  # the setter reads its signal handler setting
    )
    return state


@pytest.fixture
def numeric_model(bridge, tmp_path, one_process_groups):
    from del_megatron.models.spec import apply_device_shims

    megatron_bridge, _, _ = bridge
    provider = on_cpu(
        megatron_bridge.NumericLossGPTModelProvider.from_provider(
            hf_provider(tmp_path), VOCAB, LOSS
        )
    )
    return provider, apply_device_shims(provider.provide(), torch.device("cpu"))


def sample():
    tokens, labels, mask, positions = batch()
    return {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": positions}


def test_the_forward_step_reads_the_spiky_loss_factor_from_bridges_config(bridge, numeric_model):
    """Before: always 10 (Megatron-LM's constant), whatever rerun_state_machine said."""
    from tests.megatron_cpu import tensor_cuda_stays

    megatron_bridge, _, _ = bridge
    provider, model = numeric_model
    state = bridge_state(provider)
    state.cfg.rerun_state_machine.spiky_loss_factor = 3.0
    with tensor_cuda_stays():
        output, loss_function = megatron_bridge.forward_step(state, iter([sample()]), model)
    assert loss_function.keywords["spiky_loss_factor"] == 3.0
    assert loss_function.keywords["check_for_spiky_loss"] is True
    tokens, labels, mask, positions = batch()
    expected = model(tokens, positions, None, labels=labels, loss_mask=mask)
    assert_close(output.loss, expected.loss, atol=1e-6, what="loss through Bridge's step")


def test_the_forward_step_refuses_a_schedule_plan(bridge, numeric_model):
    """MoE's overlapped all-to-all asks for model.build_schedule_plan, whose last node is
    megatron's own loss: refused in one line."""
    megatron_bridge, _, _ = bridge
    provider, model = numeric_model
    with pytest.raises(UserError, match="return_schedule_plan=True") as refused:
        megatron_bridge.forward_step(bridge_state(provider), iter([sample()]), model, True)
    assert "\n" not in str(refused.value)


def test_the_forward_step_refuses_bridges_distillation(bridge, numeric_model):
    from megatron.bridge.models.distillation_provider import DistillationProvider

    megatron_bridge, _, _ = bridge
    _, model = numeric_model

    class Distilling(DistillationProvider):  # what convert_to_distillation_provider makes
        def __init__(self):
            pass

    with pytest.raises(UserError, match="knowledge distillation") as refused:
        megatron_bridge.forward_step(bridge_state(Distilling()), iter([sample()]), model)
    assert "\n" not in str(refused.value)


def test_bridges_default_cross_entropy_fusion_is_off_and_refused_when_set(
    bridge, tmp_path, one_process_groups
):
    """GPTModelProvider fuses megatron's own cross entropy by default; the head replaces that
    loss: off in the numeric provider, refused in one line if set on it."""
    megatron_bridge, _, _ = bridge
    theirs = hf_provider(tmp_path)
    assert theirs.cross_entropy_loss_fusion
    ours = on_cpu(megatron_bridge.NumericLossGPTModelProvider.from_provider(theirs, VOCAB, LOSS))
    assert not ours.cross_entropy_loss_fusion
    ours.cross_entropy_loss_fusion = True
    with pytest.raises(UserError, match="cross_entropy_loss_fusion"):
        ours.provide()


@pytest.mark.parametrize(
    ("pp_rank", "vp_stage"), [(1, None), (0, 1)], ids=["pp3-middle", "vpp2-first-rank-chunk1"]
)
def test_a_stage_without_the_head_given_the_full_batch(
    bridge, pp_rank, vp_stage, one_process_groups
):
    """Bridge's get_batch gives middle stages (and virtual chunks that are neither first nor
    last) the full batch where the dataset gives attention masks or packed sequences; such a
    stage has no head (ignore_index None). Before: masked_fill(..., None) raised."""
    from types import SimpleNamespace

    from megatron.core.process_groups_config import ProcessGroupCollection

    from tests.megatron_cpu import tensor_cuda_stays

    megatron_bridge, _, _ = bridge
    group = SimpleNamespace(rank=lambda: pp_rank, size=lambda: 3 if vp_stage is None else 2)
    # this process's pipeline rank and size told as a stage of PP 3 (or of PP 2 x VP 3)
    cp = ProcessGroupCollection.use_mpu_process_groups().cp
    groups = SimpleNamespace(pp=group, cp=cp)
    vp = 3 if vp_stage is not None else None
    cfg = SimpleNamespace(
        model=SimpleNamespace(virtual_pipeline_model_parallel_size=vp),
        dataset=SimpleNamespace(skip_getting_attention_mask_from_dataset=False),
    )
    full = {**sample(), "attention_mask": torch.ones(2, 1, 16, 16, dtype=torch.bool)}
    with tensor_cuda_stays():
        _, labels, mask, *_ = megatron_bridge._batch_with_mask_in_labels(
            None, iter([full]), cfg, pg_collection=groups, vp_stage=vp_stage
        )
    assert torch.equal(labels, full["labels"]) and torch.equal(mask, full["loss_mask"])
