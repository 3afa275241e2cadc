"""The head inside GPTModel's forward (models/gpt.py): through megatron's own extension point,
`GPTModel.forward(..., output_processor=, output_processor_context=)`, where the installed
megatron-core has it (0.18 and later; .venv312's 0.19), after everything GPTModel does before
its own loss (muP's logit scaling, `_scale_logits`, included); through the `_postprocess`
override where it has not (.venv's 0.16), with muP refused in one line there. One process,
CPU; the reference is the single-device loss (`losses.reference`) on the model's own logits:
GPTModel called without labels, megatron's scaled logits (issue 51: objective 5.8001 against
5.8061, gradients off by up to 0.056, before)."""

from __future__ import annotations

import inspect

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, numeric_loss
from del_megatron.errors import UserError
from del_megatron.models import LlamaArchitecture, megatron_lm
from del_megatron.models.gpt import NumericLossGPTModel, loss_func
from tests.utils import assert_close

pytestmark = pytest.mark.megatron

VOCAB = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[20], vocab_size=100)
ARCH = LlamaArchitecture(
    vocab_size=100,
    hidden_size=32,
    ffn_hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    max_position_embeddings=16,
    rope_theta=10000.0,
    qkv_bias=True,
    tie_word_embeddings=False,
)
# muP's widths: hidden 32 over a base of 12, so megatron scales the logits by 12/32
MUP = {"use_mup": True, "mup_base_hidden_size": 12}


def has_output_processor() -> bool:
    """Whether the installed GPTModel.forward takes `output_processor` (read here, not from
    the package, so that the tests run on the code before it too)."""
    from megatron.core.models.gpt import GPTModel

    return "output_processor" in inspect.signature(GPTModel.forward).parameters


HOOK = pytest.mark.skipif(
    not has_output_processor(), reason="this megatron-core has no output_processor (< 0.18)"
)
NO_HOOK = pytest.mark.skipif(
    has_output_processor(), reason="this megatron-core has output_processor (0.18+)"
)


def loss_config(kind: str = "del", fused: bool = False) -> NumericLossConfig:
    # fused: chunks of 8 tokens, so that the 32 positions take several
    return NumericLossConfig(
        kind=kind, normalize="tokens", fused_output=fused, fused_chunk_tokens=8 if fused else 0
    )


def megatron_model(config):
    """megatron-core's own GPTModel of `config` (as Megatron-LM's gpt_builder makes it), with
    the CPU's layer spec and shims."""
    from megatron.core.models.gpt import GPTModel

    from del_megatron.models.spec import apply_device_shims, gpt_layer_spec

    cpu = torch.device("cpu")
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(cpu),
        vocab_size=ARCH.padded_vocab_size(1),
        max_sequence_length=ARCH.max_position_embeddings,
        share_embeddings_and_output_weights=ARCH.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=ARCH.rope_theta,
    )
    return apply_device_shims(model, cpu)


def transformer_config(**overrides):
    from del_megatron.models.llama import transformer_config

    return transformer_config(ARCH, torch.device("cpu"), calculate_per_token_loss=True, **overrides)


def numeric_model(cfg: NumericLossConfig, **overrides) -> NumericLossGPTModel:
    """The model as Megatron-LM's pre-wrap hook leaves it (`check_megatron_loop` included)."""
    torch.manual_seed(3)
    model = megatron_model(transformer_config(**overrides))
    (numeric,) = megatron_lm.numeric_loss_hook(VOCAB, cfg)([model])
    return numeric


def batch():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(21, 100, (2, 17), generator=gen)
    tokens[:, 3:9] = torch.randint(10, 20, (2, 6), generator=gen)
    tokens[:, 11:14] = torch.randint(10, 21, (2, 3), generator=gen)
    mask = (torch.rand(2, 16, generator=gen) > 0.2).float()
    positions = torch.arange(16).expand(2, 16)
    return tokens[:, :-1], tokens[:, 1:].contiguous(), mask, positions


def loss_and_gradients(model, loss_of) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss_of(model) and the gradients of every parameter of the model by it."""
    model.zero_grad(set_to_none=True)
    loss = loss_of(model)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return loss.detach(), grads


@pytest.fixture
def groups(one_process_groups):
    yield


@HOOK
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("kind", ["del", "emo"])
def test_mup_objective_and_gradients_equal_the_reference_on_megatrons_own_logits(
    groups, kind, fused
):
    """--use-mup: megatron scales its logits by mup_output_mult (here 12/32) before its own
    loss; the head, fused (the logits never formed) or not, gives the reference's objective
    and gradients of every weight on the logits megatron returns without labels."""
    cfg = loss_config(kind, fused)
    model = numeric_model(cfg, **MUP)
    assert model.config.mup_output_mult == pytest.approx(12 / 32)
    tokens, labels, mask, positions = batch()

    def reference(m):
        logits = m(tokens, positions, None)  # megatron's own: [b, s, V], scaled
        out = numeric_loss(
            logits, labels, VOCAB, cfg, mask, cost_embedding=m.head.emo_cost_embedding
        )
        return (out.per_token * mask).sum() / mask.sum()

    def head(m):
        loss_sum, num_tokens, _ = loss_func(
            mask, m(tokens, positions, None, labels=labels, loss_mask=mask)
        )
        return loss_sum / num_tokens

    expected, expected_grads = loss_and_gradients(model, reference)
    found, grads = loss_and_gradients(model, head)
    assert_close(found, expected, atol=1e-6, what="objective")
    for name, grad in expected_grads.items():
        assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, what=f"grad {name}")
    assert expected_grads["output_layer.weight"].abs().max() > 1e-3  # a gradient to compare


@HOOK
def test_mup_gradient_probe_reads_megatrons_own_logits(groups):
    """The gradient probe (`numeric_grad_probe`) of a muP model: the same loss and gradients
    as the unprobed forward, its share that of megatron's scaled logits."""
    from del_megatron.losses.diagnostics import output_gradient_probe, probe_pairs

    cfg = loss_config()
    model = numeric_model(cfg, **MUP)
    tokens, labels, mask, positions = batch()
    with torch.no_grad():
        logits = model(tokens, positions, None)
    expected = probe_pairs(
        output_gradient_probe(
            lambda z: numeric_loss(z, labels, VOCAB, cfg, mask), logits, cfg.resolved_alpha
        )
    )

    def probed(m):
        output = m(tokens, positions, None, labels=labels, loss_mask=mask, numeric_grad_probe=True)
        probed.pairs = probe_pairs(output.stats)
        return (output.per_token * mask).sum()

    def plain(m):
        return (m(tokens, positions, None, labels=labels, loss_mask=mask).per_token * mask).sum()

    found, grads = loss_and_gradients(model, probed)
    unprobed, unprobed_grads = loss_and_gradients(model, plain)
    assert_close(found, unprobed, atol=0, what="loss")
    for name, grad in unprobed_grads.items():
        assert_close(grads[name], grad, atol=0, what=f"grad {name}")
    assert set(probed.pairs) == set(expected)
    for key, (total, count) in expected.items():
        assert_close(probed.pairs[key][0], total, atol=1e-6, what=f"{key} sum")
        assert probed.pairs[key][1].item() == count.item()


@HOOK
def test_the_head_goes_through_megatrons_output_processor(groups, monkeypatch):
    """megatron-core 0.18+: GPTModel's own forward runs to its hook, which receives the head;
    the private `_postprocess` is megatron's, not overridden."""
    from megatron.core.models.gpt import GPTModel

    seen = []
    theirs = GPTModel._postprocess

    def spy(self, *args, **kwargs):
        seen.append((kwargs.get("output_processor"), kwargs.get("labels") is not None))
        return theirs(self, *args, **kwargs)

    monkeypatch.setattr(GPTModel, "_postprocess", spy)
    model = numeric_model(loss_config())
    assert "_postprocess" not in NumericLossGPTModel.__dict__
    tokens, labels, mask, positions = batch()
    model(tokens, positions, None, labels=labels, loss_mask=mask)
    model(tokens, positions, None)  # no labels: megatron's own logits, no processor
    (processor, with_labels), (none, without_labels) = seen
    assert with_labels and not without_labels and none is None
    assert processor is not None and getattr(processor, "__self__", None) is model


@HOOK
def test_a_callers_output_processor_runs_in_place_of_the_head(groups):
    """GPTModel's contract: a caller's `output_processor` replaces the logits-and-loss path,
    labels or not; here that path is the head's. It gets megatron's helpers (scale_logits)
    and its context, and its result is the model's output (before: silently ignored, the
    head's output returned)."""
    model = numeric_model(loss_config(), **MUP)
    tokens, labels, mask, positions = batch()
    context = object()
    seen = {}

    def output_processor(**kwargs):
        seen.update(kwargs)
        logits, _ = kwargs["output_layer"](kwargs["hidden_states"])
        return kwargs["scale_logits"](logits).transpose(0, 1)

    found = model(
        tokens,
        positions,
        None,
        labels=labels,
        loss_mask=mask,
        output_processor=output_processor,
        output_processor_context=context,
    )
    assert seen["context"] is context and seen["labels"] is labels
    assert_close(found, model(tokens, positions, None), atol=0, what="the caller's logits")
    with pytest.raises(ValueError, match="numeric_grad_probe"):
        model(
            tokens,
            positions,
            None,
            labels=labels,
            loss_mask=mask,
            output_processor=output_processor,
            numeric_grad_probe=True,
        )


@HOOK
def test_mup_is_accepted_where_the_hook_applies_megatrons_scaling(groups):
    """check_megatron_loop (the builder's and pre-wrap hook's check) no longer refuses
    --use-mup where the head runs after megatron's scaling (before: refused on 0.19)."""
    config = transformer_config(**MUP)
    megatron_lm.check_megatron_loop(config, loss_config())


@NO_HOOK
def test_mup_is_refused_in_one_line_where_the_hook_is_absent(groups):
    """megatron-core 0.17 has muP but no output_processor: the `_postprocess` override would
    read the logits before `_scale_logits`. Refused when the loop builds the model and when a
    model built directly is called (0.16 has no muP field: set here after construction)."""
    from dataclasses import replace

    config = transformer_config()
    changed = replace(config)
    changed.use_mup = True
    with pytest.raises(UserError, match="--use-mup") as refused:
        megatron_lm.check_megatron_loop(changed, loss_config())
    assert "\n" not in str(refused.value)

    model = numeric_model(loss_config())
    tokens, labels, mask, positions = batch()
    model.config.use_mup = True
    with pytest.raises(UserError, match="--use-mup") as refused:
        model(tokens, positions, None, labels=labels, loss_mask=mask)
    assert "\n" not in str(refused.value)


@NO_HOOK
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_without_the_hook_the_head_overrides_postprocess(groups, monkeypatch, fused):
    """megatron-core < 0.18: the head runs in the `_postprocess` override, and equals the
    reference on megatron's own logits, gradients included."""
    cfg = loss_config(fused=fused)
    model = numeric_model(cfg)
    assert "_postprocess" in NumericLossGPTModel.__dict__
    called = []
    ours = NumericLossGPTModel._postprocess

    def spy(self, *args, **kwargs):
        called.append(True)
        return ours(self, *args, **kwargs)

    monkeypatch.setattr(NumericLossGPTModel, "_postprocess", spy)
    tokens, labels, mask, positions = batch()

    def reference(m):
        out = numeric_loss(m(tokens, positions, None), labels, VOCAB, cfg, mask)
        return (out.per_token * mask).sum()

    def head(m):
        return (m(tokens, positions, None, labels=labels, loss_mask=mask).per_token * mask).sum()

    expected, expected_grads = loss_and_gradients(model, reference)
    called.clear()
    found, grads = loss_and_gradients(model, head)
    assert called
    assert_close(found, expected, atol=1e-5, what="loss")
    for name, grad in expected_grads.items():
        assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, what=f"grad {name}")
