"""The Megatron-LM adapter (models/megatron_lm.py) called the way Megatron-LM's loop calls it:
the builder with pretrain_gpt.py's signature, the pre-wrap hook of the config-container form,
the loss function's return contract, report and checks, and the head's output as megatron's
wrappers hand it on. One process; megatron's schedules at TP 2, PP 2 and virtual PP, and a
real megatron.training step, are in tests/distributed/test_megatron_schedules.py."""

from __future__ import annotations

import inspect
import logging
from dataclasses import replace
from functools import partial

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, numeric_loss
from del_megatron.errors import UserError
from del_megatron.models import LlamaArchitecture, megatron_lm
from del_megatron.models.gpt import NumericLossGPTModel
from tests.utils import assert_close

pytestmark = pytest.mark.megatron

VOCAB = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[20], vocab_size=100)
LOSS = NumericLossConfig(kind="del", normalize="tokens")
ARCH = LlamaArchitecture(
    vocab_size=100,
    hidden_size=32,
    ffn_hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    max_position_embeddings=16,
    rope_theta=500000.0,
    qkv_bias=True,
    tie_word_embeddings=True,
)
# Megatron-LM's gpt_builders.gpt_builder (core_v0.16.1 and today's): the builder that
# `partial(model_provider, builder)` calls as builder(args, pre_process, post_process,
# vp_stage, config=config, pg_collection=pg_collection)
GPT_BUILDER_SIGNATURE = [
    ("args", inspect.Parameter.empty),
    ("pre_process", inspect.Parameter.empty),
    ("post_process", inspect.Parameter.empty),
    ("vp_stage", None),
    ("config", None),
    ("pg_collection", None),
]


def megatron_gpt_builder(
    args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None
):
    """What Megatron-LM's gpt_builder does with its arguments (the file is not in the wheel):
    megatron-core's own GPTModel from the config and the architecture flags, here with the
    CPU's layer spec and shims."""
    from megatron.core.models.gpt import GPTModel

    from del_megatron.models.spec import apply_device_shims, gpt_layer_spec

    cpu = torch.device("cpu")
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(cpu),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=args.rotary_base,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    return apply_device_shims(model, cpu)


class Args:
    """The Megatron-LM arguments gpt_builder reads."""

    padded_vocab_size = ARCH.padded_vocab_size(1)
    max_position_embeddings = ARCH.max_position_embeddings
    untie_embeddings_and_output_weights = False
    rotary_base = ARCH.rope_theta
    fp16_lm_cross_entropy = False


@pytest.fixture
def config(one_process_groups):
    from del_megatron.models.llama import transformer_config

    return transformer_config(ARCH, torch.device("cpu"), calculate_per_token_loss=True)


def batch(digits: bool = True):
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(21, 100, (2, 17), generator=gen)
    if digits:
        tokens[:, 3:9] = torch.randint(10, 20, (2, 6), generator=gen)
    mask = (torch.rand(2, 16, generator=gen) > 0.2).float()
    positions = torch.arange(16).expand(2, 16)
    return tokens[:, :-1], tokens[:, 1:].contiguous(), mask, positions


def test_the_builder_has_megatron_lms_builder_signature():
    builder = megatron_lm.numeric_builder(megatron_gpt_builder, VOCAB, LOSS)
    found = [(p.name, p.default) for p in inspect.signature(builder).parameters.values()]
    assert found == GPT_BUILDER_SIGNATURE
    theirs = inspect.signature(megatron_gpt_builder).parameters.values()
    assert [(p.name, p.default) for p in theirs] == GPT_BUILDER_SIGNATURE


def test_the_builder_keeps_the_model_megatron_built_and_ends_it_in_the_head(config):
    """The GPTModel of Megatron-LM's builder (tied embeddings, rope base 500000, QKV bias:
    fields the builder read) becomes a NumericLossGPTModel in place, parameters untouched;
    with labels its forward is the head's loss on that model's own logits."""
    builder = megatron_lm.numeric_builder(megatron_gpt_builder, VOCAB, LOSS)
    model = builder(Args(), True, True, None, config=config, pg_collection=None)
    assert type(model) is NumericLossGPTModel and model.share_embeddings_and_output_weights
    assert model.rotary_pos_emb.inv_freq[1].item() == pytest.approx(500000.0 ** (-2 / 8))
    tokens, labels, mask, positions = batch()
    logits = model(tokens, positions, None)  # megatron's own forward: [b, s, V]
    expected = numeric_loss(logits, labels, VOCAB, LOSS, mask)
    output = model(tokens, positions, None, labels=labels, loss_mask=mask)
    assert_close(output.loss, expected.loss, atol=1e-6, what="loss")
    assert_close(output.per_token, expected.per_token, atol=1e-6, what="per-token losses")


def test_the_pre_wrap_hook_makes_every_stage_end_in_the_head(config):
    hook = megatron_lm.numeric_loss_hook(VOCAB, LOSS)
    stages = [megatron_gpt_builder(Args(), True, True, config=config) for _ in range(2)]
    assert [type(m) for m in hook(stages)] == [NumericLossGPTModel] * 2


def test_another_model_class_is_refused(config):
    """A GPTModel subclass of the user's may compute its loss itself: not converted."""
    from megatron.core.models.gpt import GPTModel

    from del_megatron.models.spec import gpt_layer_spec

    class Custom(GPTModel):
        pass

    model = Custom(config, gpt_layer_spec(torch.device("cpu")), 128, 16)
    with pytest.raises(TypeError, match="Custom"):
        NumericLossGPTModel.from_gpt_model(model, VOCAB, LOSS)


def test_a_refused_model_is_left_as_it_was(config):
    from megatron.core.models.gpt import GPTModel

    model = megatron_gpt_builder(Args(), True, True, config=config)
    model.parallel_output = False  # its logits gathered: no vocabulary shard to work on
    with pytest.raises(ValueError, match="parallel_output=True"):
        NumericLossGPTModel.from_gpt_model(model, VOCAB, LOSS)
    assert type(model) is GPTModel and not hasattr(model, "head")


def test_emo_builds_on_a_pipeline_stage_without_the_output_layer(config):
    """EMO's cost embedding is taken from the output weights, which only the last stage
    holds: the other stages have no head (before: 'kind='emo' needs the output weights')."""
    emo = NumericLossConfig(kind="emo", normalize="tokens")
    hook = megatron_lm.numeric_loss_hook(VOCAB, emo)
    first, last = hook(
        [megatron_gpt_builder(Args(), True, post, config=config) for post in (False, True)]
    )
    assert first.head is None and last.head.emo_cost_embedding is not None
    first.freeze_emo_cost_embedding()  # nothing to take there


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"calculate_per_token_loss": False}, "--calculate-per-token-loss"),
        ({"context_parallel_size": 2}, "context_parallel_size=1"),
        # read by megatron's loops for their own loss, which the head replaces (issue 51)
        ({"cross_entropy_loss_fusion": True}, "--cross-entropy-loss-fusion"),
        ({"overlap_moe_expert_parallel_comm": True}, "--overlap-moe-expert-parallel-comm"),
    ],
)
def test_settings_megatron_cannot_sum_exactly_are_refused_in_one_line(config, change, named):
    changed = replace(config)
    for name, value in change.items():  # set after __post_init__'s own checks (MoE's)
        setattr(changed, name, value)
    with pytest.raises(UserError, match=named) as refused:
        megatron_lm.check_megatron_loop(changed, LOSS)
    assert "\n" not in str(refused.value)


def test_fp16_lm_cross_entropy_is_refused_in_one_line(config):
    """Megatron-LM's gpt_builder passes --fp16-lm-cross-entropy to GPTModel, whose own loss
    it changes; the head computes in float32 (before: built, the flag ignored)."""
    args = Args()
    args.fp16_lm_cross_entropy = True
    builder = megatron_lm.numeric_builder(megatron_gpt_builder, VOCAB, LOSS)
    with pytest.raises(UserError, match="--fp16-lm-cross-entropy") as refused:
        builder(args, True, True, config=config)
    assert "\n" not in str(refused.value)


def test_normalize_digits_is_refused_in_one_line(config):
    """normalize="digits" divides each micro-batch by its own digit count: no sum over
    micro-batches gives the global batch's loss (the schedules test shows the difference)."""
    builder = megatron_lm.numeric_builder(megatron_gpt_builder, VOCAB, NumericLossConfig())
    with pytest.raises(UserError, match="normalize='tokens'"):
        builder(Args(), True, True, config=config)


@pytest.fixture
def model(config):
    builder = megatron_lm.numeric_builder(megatron_gpt_builder, VOCAB, LOSS)
    return builder(Args(), True, True, config=config)


def test_the_loss_function_follows_megatrons_contract(model):
    """(loss sum, token count int, report of 2-element [sum, count] pairs), as Megatron-LM's
    loss_func returns; 'lm loss' is the cross entropy (its PPL the perplexity), 'objective'
    the loss trained on."""
    tokens, labels, mask, positions = batch()
    output = model(tokens, positions, None, labels=labels, loss_mask=mask)
    loss, num_tokens, report = megatron_lm.loss_func(mask, output, model=model)
    assert num_tokens.dtype == torch.int and num_tokens.item() == mask.sum().item()
    assert_close(loss, (output.per_token * mask).sum(), atol=1e-5, what="loss sum")
    assert list(report)[:2] == ["lm loss", "objective"]
    assert all(pair.shape == (2,) and pair.dtype == torch.float32 for pair in report.values())
    assert_close(report["lm loss"][0] / report["lm loss"][1], output.ce, atol=1e-6, what="ce")
    objective = report["objective"][0] / report["objective"][1]
    assert_close(objective, output.loss, atol=1e-6, what="objective")
    assert report["lm loss"][1].item() == mask.sum().item()  # the count kept exactly


def test_a_batch_without_digits_reports_zero_not_nan(model):
    tokens, labels, mask, positions = batch(digits=False)
    output = model(tokens, positions, None, labels=labels, loss_mask=mask)
    _, _, report = megatron_lm.loss_func(mask, output)
    for key in ("digit_acc", "digit_cond_acc", "digit_entropy", "digit_abs_error"):
        pair = torch.stack([report[key], report[key]]).sum(0)  # two micro-batches, summed
        assert (pair[0] / pair[1]).item() == 0.0, key


def test_the_output_after_megatrons_float16_wrapper_is_read(model):
    """Float16Module (every bf16 run of Megatron-LM and Bridge) returns the last stage's
    output through float16_to_fp32, which makes a named tuple a plain tuple."""
    from megatron.core.transformer.module import float16_to_fp32

    tokens, labels, mask, positions = batch()
    output = model(tokens, positions, None, labels=labels, loss_mask=mask)
    plain = float16_to_fp32(output)
    assert type(plain) is tuple
    expected = megatron_lm.loss_func(mask, output)
    found = megatron_lm.loss_func(mask, plain)
    assert_close(found[0], expected[0], atol=0, what="loss")


def test_a_tensor_instead_of_the_heads_output_is_refused(model):
    """megatron's own GPTModel returns per-token CE [b, s]: read as the head's five fields it
    would be silently wrong."""
    mask = batch()[2]
    per_token = torch.zeros(5, 16)
    with pytest.raises(TypeError, match=r"a tensor \(5, 16\)"):
        megatron_lm.loss_func(mask[:1].expand(5, 16), per_token)


@pytest.fixture
def megatron_on_cpu():
    from tests.megatron_cpu import run_megatron_on_cpu

    run_megatron_on_cpu()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_stops_as_megatrons_check_stops_it(model, megatron_on_cpu, bad):
    tokens, labels, mask, positions = batch()
    output = model(tokens, positions, None, labels=labels, loss_mask=mask)
    poisoned = output._replace(per_token=output.per_token.detach().clone())
    poisoned.per_token[0, 0] = bad
    mask[0, 0] = 1.0
    what = "NaN" if bad != bad else "Inf"
    with pytest.raises(RuntimeError, match=f"found {what} in local forward loss calculation"):
        megatron_lm.loss_func(mask, poisoned)
    megatron_lm.loss_func(mask, poisoned, check_for_nan_in_loss=False)  # not asked: no check


def test_a_spiky_loss_is_reported_as_megatron_reports_it(model, megatron_on_cpu, caplog):
    """megatron's rerun state machine learns the largest of the first 100 losses, then flags
    one 10x above it (non-fatal: logged in its default mode)."""
    tokens, labels, mask, positions = batch()
    with torch.no_grad():
        output = model(tokens, positions, None, labels=labels, loss_mask=mask)
    check = partial(megatron_lm.loss_func, mask, check_for_spiky_loss=True)
    for _ in range(100):
        check(output)
    with caplog.at_level(logging.WARNING):
        check(output)
        assert "Spiky loss" not in caplog.text
        check(output._replace(per_token=output.per_token * 20))
    assert "Spiky loss" in caplog.text


def test_the_forward_step_needs_megatron_lms_loss_partial():
    with pytest.raises(TypeError, match="partial"):
        megatron_lm._loss_mask_of(lambda output: output)


# ---- nothing the loop asks for silently dropped (issue 51) --------------------------------


def test_a_model_called_without_loss_mask_is_refused_in_one_line(model):
    """A forward step of the user's own (or an older Bridge's) that passes labels but not
    the mask: before, the head counted every position (logged lm loss 4.87201 against
    4.87531 on the issue's run)."""
    from del_megatron.models.gpt import labels_carry_the_mask

    tokens, labels, mask, positions = batch()
    with pytest.raises(
        UserError, match=r"model\(\.\.\., labels=labels, loss_mask=loss_mask\)"
    ) as refused:
        model(tokens, positions, None, labels=labels)
    assert "\n" not in str(refused.value)
    with labels_carry_the_mask():  # the Bridge adapter's labels, ignore_index where masked
        masked = labels.masked_fill(mask == 0, model.head.cfg.ignore_index)
        found = model(tokens, positions, None, labels=masked)
    expected = model(tokens, positions, None, labels=labels, loss_mask=mask)
    assert_close(found.loss, expected.loss, atol=1e-6, what="loss with the mask in the labels")


def test_packed_documents_without_the_loops_label_layout_are_refused(model, monkeypatch):
    """Packed documents (packed_seq_params) are read where the model knows where its loop
    puts their labels (`packed_labels`: Megatron-LM's builders set "row", Bridge's provider
    "document"; tests/models/test_megatron_packed.py); a model built without it (this
    project's trainer never packs) refuses them in one line, and unpacked rows train."""
    from megatron.core.packed_seq_params import PackedSeqParams

    assert model.packed_labels == "row"  # numeric_builder's
    monkeypatch.setattr(model, "packed_labels", None)
    tokens, labels, mask, positions = batch()
    seqlens = torch.tensor([0, 5, tokens.shape[1]], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=seqlens, cu_seqlens_kv=seqlens)
    with pytest.raises(UserError, match="packed documents") as refused:
        model(tokens, positions, None, labels=labels, loss_mask=mask, packed_seq_params=packed)
    assert "\n" not in str(refused.value)
    model(tokens, positions, None, labels=labels, loss_mask=mask, packed_seq_params=None)


def pretrain_gpt_loss_func(loss_mask, output_tensor, model=None):
    """Megatron-LM's pretrain_gpt.loss_func as it reads the model's output (core_v0.16.1 and
    main, after its ModelOpt and offline-distillation branches): a tensor of per-token
    losses, `output_tensor.view(-1).float()`."""
    losses = output_tensor.view(-1).float()
    return torch.sum(losses * loss_mask.view(-1).float())


def test_megatrons_own_loss_function_says_which_line_is_missing(model):
    """The builder used without megatron_lm.forward_step: before, "'NumericLossOutput'
    object has no attribute 'view'" and nothing else."""
    tokens, labels, mask, positions = batch()
    output = model(tokens, positions, None, labels=labels, loss_mask=mask)
    with pytest.raises(AttributeError, match=r"megatron_lm\.forward_step\(pretrain_gpt") as raised:
        pretrain_gpt_loss_func(mask, output)
    assert "\n" not in str(raised.value)


def pretrain_gpt_forward_step(data_iterator, model, return_schedule_plan=False):
    """Megatron-LM's pretrain_gpt.forward_step, its contract: the model called with labels,
    loss_mask and packed_seq_params, (output, partial(loss_func, loss_mask, model=model))."""
    tokens, labels, loss_mask, positions = next(data_iterator)
    output = model(
        tokens, positions, None, labels=labels, loss_mask=loss_mask, packed_seq_params=None
    )
    return output, partial(pretrain_gpt_loss_func, loss_mask, model=model)


@pytest.fixture
def megatron_args(monkeypatch):
    """Megatron-LM's parsed arguments as `get_args()` gives them inside its loop (defaults of
    the flags the forward step reads)."""
    training = pytest.importorskip("megatron.training", reason="megatron-core 0.16 has none")
    from types import SimpleNamespace

    args = SimpleNamespace(
        check_for_nan_in_loss_and_grad=True,
        check_for_spiky_loss=False,
        logits_load_dir=None,
        export_kd_teacher_load=None,
    )
    monkeypatch.setattr(training, "get_args", lambda: args)
    return args


def test_the_forward_step_runs_pretrain_gpts_with_its_arguments(model, megatron_args):
    step = megatron_lm.forward_step(pretrain_gpt_forward_step)
    tokens, labels, mask, positions = batch()
    output, loss_function = step(iter([batch()]), model)
    loss, num_tokens, _ = loss_function(output)
    expected = model(tokens, positions, None, labels=labels, loss_mask=mask)
    assert num_tokens.item() == mask.sum().item()
    assert_close(loss, (expected.per_token * mask).sum(), atol=1e-5, what="loss sum")


def train_step_report(reports: list[dict]) -> dict[str, float]:
    """What megatron.training's train_step (0.19.2, and Bridge 0.6.2's) does with the loss
    function's reports of one iteration's micro-batches: each [sum, count] pair summed over
    micro-batches (and all-reduced over data-parallel ranks, one here), then sum / count."""
    summed = {k: torch.vstack([r[k].view(-1) for r in reports]).sum(dim=0) for k in reports[0]}
    return {k: (v[0] / v[1]).item() for k, v in summed.items()}


def test_a_micro_batch_without_digits_does_not_pull_the_iterations_accuracy_down(model):
    """megatron sums each pair over an iteration's micro-batches: a micro-batch with no
    digit adds (0, tiny) to digit_acc's pair, and the logged accuracy is the digit-weighted
    accuracy of the micro-batches with digits."""
    reports = []
    for digits in (False, True):
        tokens, labels, mask, positions = batch(digits)
        output = model(tokens, positions, None, labels=labels, loss_mask=mask)
        reports.append(megatron_lm.loss_func(mask, output)[2])
    logged = train_step_report(reports)
    alone = train_step_report(reports[1:])
    for key in ("digit_acc", "digit_cond_acc", "digit_abs_error", "digit_entropy"):
        assert logged[key] == alone[key] and reports[0][key][0] == 0, key
    assert 0 < logged["digit_acc"] < 1


@pytest.mark.parametrize(
    ("name", "value", "flag"),
    [
        ("logits_load_dir", "/teacher/logits", "--logits-load-dir"),
        ("export_kd_teacher_load", "/teacher", "--export-kd-teacher-load"),
    ],
)
def test_the_forward_step_refuses_distillation_in_one_line(model, megatron_args, name, value, flag):
    """pretrain_gpt.loss_func's distillation branches, which this loss function replaces:
    before, the teacher was ignored without a word."""
    setattr(megatron_args, name, value)
    step = megatron_lm.forward_step(pretrain_gpt_forward_step)
    with pytest.raises(UserError, match=flag) as refused:
        step(iter([batch()]), model)
    assert "\n" not in str(refused.value)


def test_the_forward_step_refuses_a_schedule_plan(model, megatron_args):
    """MoE's overlapped all-to-all (megatron-core's combined 1F1B) calls the forward step with
    return_schedule_plan=True; the plan's last node is megatron's own loss."""
    step = megatron_lm.forward_step(pretrain_gpt_forward_step)
    with pytest.raises(UserError, match="return_schedule_plan=True") as refused:
        step(iter([batch()]), model, True)
    assert "\n" not in str(refused.value)
