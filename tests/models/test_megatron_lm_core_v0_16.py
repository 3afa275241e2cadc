"""The core_v0.16.x form of the README (`partial(model_provider, numeric_builder(gpt_builder,
...))`) on megatron-core 0.16 (.venv), as far as it runs there.

megatron-core 0.16's wheel has no `megatron.training` (it ships in the wheel from 0.17 on): a
core_v0.16.x user runs Megatron-LM's checkout, whose own `megatron/training` (0.16.1) holds
the arguments, the tokenizer, `pretrain` and the argument-to-config mapping. So here:

* runs, on megatron-core 0.16.1 itself: core_v0.16.1's `model_provider.py` and
  `gpt_builders.py` (the stand-ins, tests/loop_standins.py) around `numeric_builder`, called
  as 0.16.1's `get_model` calls the provider, with the config handed in (get_model's
  `config=`, as 0.16.1 passes it for its inference model); the model called as 0.16.1's
  `pretrain_gpt.forward_step` calls it, through `megatron_lm.forward_step`, and the loss
  function it hands back, against the model's own logits;
* stands in: `megatron.training`'s accessors only (`get_args`, `print_rank_0`,
  `is_first_or_last_pipeline_stage` for one stage), the objects the checkout's package
  holds;
* cannot run: `pretrain` and `initialize_megatron` (CUDA, and not in the wheel), the
  argument parser and `core_transformer_config_from_args` (0.16.1's `get_model` is called
  with `config=None` by `setup_model_and_optimizer`, so gpt_builder maps the arguments to
  the config with it: refused here as absent), the tokenizer `get_tokenizer()` builds. The
  whole form runs on megatron.training 0.19.2 (tests/models/test_megatron_lm_cli.py,
  tests/models/test_readme_megatron.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from functools import partial
from types import ModuleType, SimpleNamespace

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, numeric_loss
from del_megatron.models import LlamaArchitecture, megatron_lm
from del_megatron.models.gpt import NumericLossGPTModel
from tests.loop_standins import write_checkout
from tests.utils import assert_close

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron.training") is not None,
        reason="megatron-core 0.16's wheel, without megatron.training (.venv)",
    ),
]

VOCAB = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[20], vocab_size=100)
LOSS = NumericLossConfig(kind="del", alpha=0.1, normalize="tokens")
ARCH = LlamaArchitecture(
    vocab_size=100,
    hidden_size=32,
    ffn_hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    max_position_embeddings=16,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
# the parsed arguments core_v0.16.1's files read
ARGS = SimpleNamespace(
    yaml_cfg=None,
    use_legacy_models=False,
    mtp_num_layers=None,
    padded_vocab_size=ARCH.padded_vocab_size(1),
    max_position_embeddings=ARCH.max_position_embeddings,
    fp16_lm_cross_entropy=False,
    untie_embeddings_and_output_weights=True,
    position_embedding_type="rope",
    rotary_percent=1.0,
    rotary_base=int(ARCH.rope_theta),
    use_rope_scaling=False,
    record_memory_history=False,
    overlap_moe_expert_parallel_comm=False,
    check_for_nan_in_loss_and_grad=True,
    check_for_spiky_loss=False,
)


def test_megatron_core_0_16_has_no_megatron_training():
    """What the README's core_v0.16.x paragraph says: the loop is the checkout's."""
    from megatron.core.package_info import __version__

    assert __version__.startswith("0.16.")
    assert importlib.util.find_spec("megatron.training") is None


def _absent(*_args, **_kwargs):
    raise NotImplementedError(
        "megatron.training's argument-to-config mapping: in Megatron-LM's core_v0.16.x "
        "checkout, not in megatron-core 0.16's wheel"
    )


@pytest.fixture
def core_v0_16_1(tmp_path, monkeypatch, one_process_groups):
    """core_v0.16.1's three files imported on megatron-core 0.16.1, with megatron.training's
    accessors standing in (module pretrain_gpt, gpt_builders, model_provider)."""
    training = ModuleType("megatron.training")
    training.get_args = lambda: ARGS
    training.print_rank_0 = lambda *a, **k: None
    training.inprocess_restart = training.pretrain = None  # __main__ only: not run here
    arguments = ModuleType("megatron.training.arguments")
    arguments.core_transformer_config_from_args = _absent
    yaml_arguments = ModuleType("megatron.training.yaml_arguments")
    yaml_arguments.core_transformer_config_from_yaml = _absent
    utils = ModuleType("megatron.training.utils")
    utils.is_first_or_last_pipeline_stage = lambda vp_stage: True  # one stage
    for module in (training, arguments, yaml_arguments, utils):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    names = ("pretrain_gpt", "gpt_builders", "model_provider")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(write_checkout(tmp_path, "core_v0.16.1")))
    yield tuple(importlib.import_module(name) for name in names)
    for name in names:  # imported here: not left for another test to find
        sys.modules.pop(name, None)


@pytest.fixture
def config():
    from del_megatron.models.llama import transformer_config

    return transformer_config(ARCH, torch.device("cpu"), calculate_per_token_loss=True)


def provided(core_v0_16_1, config, **stage):
    """The README's core_v0.16.x line, called as 0.16.1's get_model calls the provider."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from tests.loop_standins import on_cpu

    _, gpt_builders, model_provider = core_v0_16_1
    provider = partial(
        model_provider.model_provider,
        megatron_lm.numeric_builder(gpt_builders.gpt_builder, VOCAB, LOSS),
    )
    model = provider(
        **stage, config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    )
    return on_cpu([model])[0]


def test_the_provider_builds_the_numeric_model_on_megatron_core_0_16(core_v0_16_1, config):
    model = provided(core_v0_16_1, config, pre_process=True, post_process=True)
    assert type(model) is NumericLossGPTModel and model.head is not None
    assert not model.share_embeddings_and_output_weights  # --untie-embeddings-and-output-weights
    # a virtual stage without the output layer (get_model's vp_stage= call): no head
    first = provided(core_v0_16_1, config, pre_process=True, post_process=False, vp_stage=0)
    assert type(first) is NumericLossGPTModel and first.head is None


def test_the_config_from_the_arguments_is_not_in_the_wheel(core_v0_16_1):
    """config=None, as 0.16.1's setup_model_and_optimizer leaves it: gpt_builder maps the
    arguments itself, with megatron.training's function (absent from the wheel)."""
    with pytest.raises(NotImplementedError, match="not in megatron-core 0.16's wheel"):
        provided(core_v0_16_1, None, pre_process=True, post_process=True)


def test_a_forward_step_of_core_v0_16_1_on_megatron_core_0_16(core_v0_16_1, config):
    """0.16.1's forward_step through megatron_lm.forward_step: the model gets the loss mask,
    the loss function is ours, its report the head's on the model's own logits."""
    pretrain_gpt = core_v0_16_1[0]
    model = provided(core_v0_16_1, config, pre_process=True, post_process=True)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(21, 100, (2, 17), generator=gen)
    tokens[:, 4:10] = torch.randint(10, 20, (2, 6), generator=gen)
    mask = (torch.rand(2, 16, generator=gen) > 0.2).float()
    sample = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": mask,
        "position_ids": torch.arange(16).expand(2, 16),
    }
    step = megatron_lm.forward_step(pretrain_gpt.forward_step)
    output, loss_function = step(iter([sample]), model)
    loss, num_tokens, report = loss_function(output)
    assert num_tokens.item() == mask.sum().item()
    with torch.no_grad():
        logits = model(sample["tokens"], sample["position_ids"], None)  # [b, s, V]
    expected = numeric_loss(logits, sample["labels"], VOCAB, LOSS, mask)
    objective = report["objective"][0] / report["objective"][1]
    assert_close(objective, expected.loss, atol=1e-5, what="objective")
    assert_close(loss / num_tokens, expected.loss, atol=1e-5, what="loss sum / tokens")
    loss.backward()
    assert model.output_layer.weight.grad is not None
