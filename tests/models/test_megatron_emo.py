"""EMO's cost embedding in megatron's loops (issue 51): taken from the weights the loop loads
(Megatron-Bridge's AutoBridge import, a pre-wrap hook after the build; Megatron-LM's checkpoint
load, after the builder), float32 under megatron's Float16Module, in no Hugging Face mapping,
and a checkpoint without it continued with one line.

Against the real libraries, called the way their loops call them: Bridge's own build
(`provide_distributed_model`: its pre-wrap hooks, its Float16Module) and forward step
(megatron-bridge 0.6.2); Megatron-LM's own `save_checkpoint` and `load_checkpoint` on its
parsed arguments (megatron.training 0.19.2), both in .venv312 and skipped where absent. The
model-level checks run on megatron-core 0.16.1 too."""

from __future__ import annotations

import importlib.util
import logging
import sys

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, numeric_loss
from del_megatron.losses import emo_cost_embedding
from del_megatron.models import megatron_lm
from tests.utils import assert_close

pytestmark = pytest.mark.megatron

VOCAB = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[20], vocab_size=130)
EMO = NumericLossConfig(kind="emo", normalize="tokens")
COST = "head.emo_cost_embedding"


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cost embedding" in r.getMessage()]


def batch():
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(21, 130, (2, 17), generator=gen)
    tokens[:, 4:10] = torch.randint(10, 20, (2, 6), generator=gen)
    mask = (torch.rand(2, 16, generator=gen) > 0.25).float()
    return tokens[:, :-1], tokens[:, 1:].contiguous(), mask, torch.arange(16).expand(2, 16)


def expected_loss(model, cost: torch.Tensor):
    """The single-device reference on the model's own logits, with `cost` as EMO's cost
    embedding."""
    tokens, labels, mask, positions = batch()
    with torch.no_grad():
        logits = model(tokens, positions, None).float()
    return numeric_loss(logits, labels, VOCAB, EMO, mask, cost_embedding=cost).loss


# ---- the model (megatron-core 0.16.1 and 0.19.2) --------------------------------------------


@pytest.fixture
def megatron_lm_model(one_process_groups):
    """An EMO model of Megatron-LM's builder (tied embeddings) and another model's weights."""
    from del_megatron.models.llama import transformer_config

    from .test_megatron_lm import ARCH, Args, megatron_gpt_builder

    class Args130(Args):
        padded_vocab_size = 192  # this file's vocabulary, 130, padded to 64's multiple

    config = transformer_config(ARCH, torch.device("cpu"), calculate_per_token_loss=True)
    builder = megatron_lm.numeric_builder(megatron_gpt_builder, VOCAB, EMO)
    torch.manual_seed(1)
    model = builder(Args130(), True, True, config=config)
    torch.manual_seed(2)
    other = megatron_gpt_builder(Args130(), True, True, config=config)
    return config, model, other


def test_the_cost_embedding_stays_float32_under_megatrons_float16_module(megatron_lm_model):
    """Float16Module (every bf16 run of Megatron-LM and Bridge) casts the model it wraps;
    before, the cost embedding became bf16 (up to 0.4% off per element)."""
    from dataclasses import replace

    from megatron.core.transformer.module import Float16Module

    config, model, _ = megatron_lm_model
    taken = model.head.emo_cost_embedding.clone()
    wrapped = Float16Module(replace(config, bf16=True), model)
    assert model.output_layer.weight is None or model.output_weight().dtype == torch.bfloat16
    assert model.head.emo_cost_embedding.dtype == torch.float32
    assert_close(model.head.emo_cost_embedding, taken, atol=0, what="cost embedding")
    tokens, labels, mask, positions = batch()
    output = wrapped(tokens, positions, None, labels=labels, loss_mask=mask)
    assert torch.isfinite(output[0]).all()


def test_a_state_dict_without_it_takes_it_from_the_weights_it_loads(megatron_lm_model, caplog):
    """A checkpoint of another loss (or megatron's own GPTModel) loaded with torch's
    load_state_dict, strict: before, a missing key (and, not strict, the cost embedding of the
    weights at construction); now taken from the output weights loaded (the tied embedding
    here), said in one line."""
    _, model, other = megatron_lm_model
    state = other.state_dict()
    assert COST not in state
    with caplog.at_level(logging.WARNING):
        model.load_state_dict(state)
    expected = emo_cost_embedding(other.embedding.word_embeddings.weight)
    assert_close(model.head.emo_cost_embedding, expected, atol=0, what="cost embedding")
    (line,) = said(caplog)
    assert COST in line and "\n" not in line
    # a state dict with it (a resume) restores it as saved, whatever the weights
    saved = model.state_dict()
    assert COST in saved
    saved[COST] = saved[COST] * 0.5
    model.load_state_dict(saved)
    assert_close(model.head.emo_cost_embedding, saved[COST], atol=0, what="restored")


# ---- Megatron-Bridge (megatron-bridge 0.6.2) -------------------------------------------------


@pytest.fixture(scope="module")
def bridge():
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("Megatron-Bridge is not installed (.venv312 has it)")
    from tests.gpu_only_stubs import install

    install()
    from del_megatron.models import megatron_bridge

    return megatron_bridge


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_bridge_emo_takes_the_cost_embedding_from_the_hf_weights_it_loads(
    bridge, tmp_path, one_process_groups, bf16
):
    """The README's Bridge flow with kind="emo": AutoBridge's provider (its pre-wrap hook
    loads the Hugging Face weights), built by Bridge's own provide_distributed_model (bf16: a
    recipe's bf16 parameters and Float16Module). Before: Bridge's loader failed ('NoneType'
    object has no attribute 'megatron_module': the buffer had no HF mapping), and the cost
    embedding was taken at the build, from uninitialised memory."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion.utils import persistent_buffers
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import unwrap_model

    from del_megatron.models.spec import apply_device_shims
    from tests.megatron_cpu import tensor_cuda_stays

    from .test_megatron_bridge import bridge_state, on_cpu
    from .tiny_hf import tiny_hf_model

    hf = tiny_hf_model("llama-mha", tmp_path, vocab_size=130, max_position_embeddings=16)
    auto = AutoBridge.from_hf_pretrained(str(tmp_path))
    provider = bridge.NumericLossGPTModelProvider.from_provider(
        auto.to_megatron_provider(), VOCAB, EMO
    )
    provider = on_cpu(provider)
    provider.register_pre_wrap_hook(
        lambda ms: [apply_device_shims(m, torch.device("cpu")) for m in ms]
    )
    (built,) = provider.provide_distributed_model(
        wrap_with_ddp=False,
        use_cpu_initialization=True,
        bf16=bf16,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    (model,) = unwrap_model([built])
    assert (type(built).__name__ == "Float16Module") == bf16
    cost = model.head.emo_cost_embedding
    assert cost.dtype == torch.float32
    loaded = model.output_layer.weight  # [V padded, h], bf16 parameters under bf16
    assert loaded.dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert_close(cost, emo_cost_embedding(loaded), atol=0, what="from the loaded weights")
    hf_weight = hf.lm_head.weight.detach().to(loaded.dtype)
    assert_close(cost[:130], emo_cost_embedding(hf_weight), atol=0, what="from the HF weights")
    # in no HF conversion: the buffer is not one the loader or the exporter looks up
    assert COST not in dict(persistent_buffers(model))
    tasks = auto._model_bridge.build_conversion_tasks(auto.hf_pretrained, [model])
    assert all(task is not None for task in tasks)
    # one step of Bridge's forward step trains against it
    tokens, labels, mask, positions = batch()
    sample = {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": positions}
    with tensor_cuda_stays():
        output, loss_function = bridge.forward_step(bridge_state(provider), iter([sample]), built)
    loss, _, _ = loss_function(output)
    assert torch.isfinite(loss)
    if not bf16:
        expected = expected_loss(model, cost)
        assert_close(output.loss, expected, atol=1e-5, what="loss against the HF embedding")


# ---- Megatron-LM (megatron.training 0.19.2) ------------------------------------------------

ARGS = (
    "--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 "
    "--group-query-attention --num-query-groups 2 --add-qkv-bias --disable-bias-linear "
    "--normalization RMSNorm --swiglu --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 "
    "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 "
    "--vocab-size 130 --make-vocab-size-divisible-by 64 --tokenizer-type NullTokenizer "
    "--lr 1e-3 --train-iters 1 --calculate-per-token-loss --transformer-impl local "
    "--use-cpu-initialization --no-gradient-accumulation-fusion --no-bias-swiglu-fusion "
    "--no-bias-dropout-fusion --no-rope-fusion --no-masked-softmax-fusion "
    "--no-persist-layer-norm --ckpt-format torch_dist --save-interval 1 "
    # a CPU has no CUDA generator to save; no optimizer in these loads
    "--no-save-optim --no-save-rng --no-load-optim --no-load-rng"
)


@pytest.fixture
def megatron_lm_loop(tmp_path, monkeypatch, one_process_groups):
    """Megatron-LM's parsed arguments (as pretrain sets them) and its checkpointing, on the
    CPU: `parse(*flags)` gives the arguments, `build(kind)` a model of its builder."""
    if importlib.util.find_spec("megatron.training") is None:
        pytest.skip("megatron.training is in megatron-core 0.17+ (.venv312)")
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training import global_vars
    from megatron.training.arguments import (
        core_transformer_config_from_args,
        parse_args,
        validate_args,
    )

    from tests.megatron_cpu import MEGATRON_LM, run_megatron_on_cpu

    from .test_megatron_lm import megatron_gpt_builder

    # its checkpointing reads the tracker file into a CUDA tensor and saves the CUDA RNG state
    run_megatron_on_cpu(MEGATRON_LM, "megatron.training.checkpointing")
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())

    def parse(*flags: str):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *ARGS.split(), *flags])
        destroy_num_microbatches_calculator()  # set_global_variables starts it again
        global_vars.destroy_global_vars()
        args = parse_args()
        validate_args(args, {})
        global_vars.set_global_variables(args, build_tokenizer=False)
        args.padded_vocab_size = 192  # what the tokenizer build pads 130 to (64's multiple)
        return args

    def build(args, seed: int, kind: str | None = "emo"):
        torch.manual_seed(seed)
        config = core_transformer_config_from_args(args)
        if kind is None:  # megatron's own GPTModel
            return megatron_gpt_builder(args, True, True, config=config)
        loss = NumericLossConfig(kind=kind, normalize="tokens")
        return megatron_lm.numeric_builder(megatron_gpt_builder, VOCAB, loss)(
            args, True, True, config=config
        )

    yield parse, build
    destroy_num_microbatches_calculator()
    global_vars.destroy_global_vars()


def save(parse, model, directory) -> None:
    from megatron.training.checkpointing import save_checkpoint

    parse("--save", str(directory))
    save_checkpoint(1, [model], None, None, 0)


def load(model) -> None:
    from megatron.training.checkpointing import load_checkpoint

    load_checkpoint([model], None, None)


@pytest.mark.parametrize("saved_kind", [None, "del"], ids=["gpt-model", "del"])
def test_megatron_lm_emo_from_a_pretrained_checkpoint(
    megatron_lm_loop, tmp_path, caplog, saved_kind
):
    """--pretrained-checkpoint of megatron's own GPTModel or of another loss, at megatron's
    default strictness (its load is a fine-tuning one, `hide_loss_modules`): before, a
    CheckpointException (KeyError head.emo_cost_embedding); now the cost embedding is taken
    from the loaded output weights, in one line, and the first step trains against it."""
    parse, build = megatron_lm_loop
    pretrained = build(parse(), seed=1, kind=saved_kind)
    save(parse, pretrained, tmp_path / "pretrained")
    args = parse("--pretrained-checkpoint", str(tmp_path / "pretrained"))
    args.load = str(tmp_path / "run")  # nothing there yet: a new run from the pretrained one
    model = build(args, seed=2)
    with caplog.at_level(logging.WARNING):
        load(model)
    assert args.finetune
    assert_close(model.output_layer.weight, pretrained.output_layer.weight, atol=0, what="weights")
    expected = emo_cost_embedding(pretrained.output_layer.weight)
    assert_close(model.head.emo_cost_embedding, expected, atol=0, what="cost embedding")
    (line,) = said(caplog)
    assert "\n" not in line
    # Megatron-LM's forward step and loss function: the step's loss is EMO's on that embedding
    from .test_megatron_lm import pretrain_gpt_forward_step

    tokens, labels, mask, positions = batch()
    step = megatron_lm.forward_step(pretrain_gpt_forward_step)
    output, loss_function = step(iter([(tokens, labels, mask, positions)]), model)
    assert_close(output.loss, expected_loss(model, expected), atol=1e-5, what="first loss")
    loss, count, _ = loss_function(output)
    assert torch.isfinite(loss) and count.item() == mask.sum().item()


def test_megatron_lm_resume_keeps_the_saved_cost_embedding_and_finetune_takes_it_again(
    megatron_lm_loop, tmp_path
):
    """An EMO run's checkpoint, its output weights trained since the cost embedding was taken:
    --load (a resume) restores the embedding the run started with; --finetune (a new run from
    those weights) takes it from them, as every new run does. Before, the fine-tuning run
    kept the old run's."""
    parse, build = megatron_lm_loop
    run = build(parse(), seed=1)
    with torch.no_grad():
        run.output_layer.weight.mul_(1.5).add_(0.01)  # trained since the start
    started_with = run.head.emo_cost_embedding.clone()
    save(parse, run, tmp_path / "emo")
    resumed = build(parse("--load", str(tmp_path / "emo")), seed=2)
    load(resumed)
    assert_close(resumed.head.emo_cost_embedding, started_with, atol=0, what="resumed")
    tuned = build(parse("--load", str(tmp_path / "emo"), "--finetune"), seed=3)
    load(tuned)
    expected = emo_cost_embedding(run.output_layer.weight)
    assert_close(tuned.head.emo_cost_embedding, expected, atol=0, what="fine-tuned")


def test_megatron_lm_continues_a_checkpoint_without_it_at_a_lenient_strictness(
    megatron_lm_loop, tmp_path, caplog
):
    """--load of a checkpoint of another loss with --dist-ckpt-strictness log_all: before,
    loaded with the cost embedding of the weights at construction (stale: 0.945 off here);
    now taken from the loaded output weights, in one line."""
    parse, build = megatron_lm_loop
    other = build(parse(), seed=1, kind="del")
    save(parse, other, tmp_path / "del")
    args = parse("--load", str(tmp_path / "del"), "--dist-ckpt-strictness", "log_all")
    model = build(args, seed=2)
    with caplog.at_level(logging.WARNING):
        load(model)
    expected = emo_cost_embedding(other.output_layer.weight)
    assert_close(model.head.emo_cost_embedding, expected, atol=0, what="cost embedding")
    (line,) = said(caplog)
    assert "\n" not in line
