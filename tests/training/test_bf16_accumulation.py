"""bf16 training sums its micro-batch gradients in float32: the DeepSpeed config generated for
a GPU run (`config.deepspeed_config`, bf16) trained on CPU in one process, 64 micro-batches
of one optimizer step, its summed gradient (DeepSpeed's `safe_get_full_grad` at the
accumulation boundary) against the float64 sum.

Each micro-batch's gradient is a bf16 product (rounded to 2^-9 relative); summed in float32
the step's gradient stays within 0.21% (relative norm) of the float64 sum here, at every
ZeRO stage. DeepSpeed's default (no `data_types.grad_accum_dtype`) sums in bf16 and rounds
the running sum at every micro-batch: 0.85%. The bound, 0.4%, lies between.

The fused output layer + loss hands DeepSpeed a bf16 weight gradient through the same
accumulation (ZeRO 1: DeepSpeed's BF16_Optimizer, which moves each micro-batch's `.grad` into
its float32 sum and zeroes the held `.grad`: the fused op's held-`.grad` path): it follows the
unfused op within the same bound. The layout-free checkpoint state reads and writes that
optimizer too."""

from __future__ import annotations

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig
from del_megatron.checkpoint import optim_state
from del_megatron.config import parse_run_config
from del_megatron.losses import numeric_loss, vocab_parallel_numeric_loss
from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss
from del_megatron.runtime import select_accelerator
from del_megatron.training.engines.deepspeed import deepspeed_config
from del_megatron.training.engines.deepspeed_checkpoint import DeepSpeedAdapter

MICRO_BATCHES = 64
BOUND = 4e-3  # relative norm error of the step's summed gradient


def run_config(zero: int, micro_batches: int):
    return parse_run_config(
        {
            "model": {
                "vocab_size": 256,
                "hidden_size": 64,
                "ffn_hidden_size": 128,
                "num_layers": 1,
                "num_attention_heads": 4,
                "num_query_groups": 4,
                "max_position_embeddings": 64,
            },
            "parallel": {"zero_stage": zero},
            "optim": {"clip_grad": 0.0},
            "train": {
                "steps": 1,
                "micro_batch_size": 1,
                "global_batch_size": micro_batches,
                "seq_len": 16,
            },
            "data": {"tokenizer": "unused.model", "sources": [{"manifest": "unused.json"}]},
        }
    )


def bf16_engine(model: torch.nn.Module, zero: int, micro_batches: int):
    """A DeepSpeed engine of `model` under the config generated for a bf16 (GPU) run."""
    select_accelerator(torch.device("cpu"))
    import deepspeed

    config = deepspeed_config(run_config(zero, micro_batches), 1, gpu=True)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), config=config
    )
    return engine


def summed_gradient(model: torch.nn.Module, inputs: list, zero: int) -> torch.Tensor:
    """The float32 gradient of model.weight DeepSpeed holds after the micro-batches of one
    step (each input a micro-batch), under the generated bf16 config at `zero`."""
    from deepspeed.utils import safe_get_full_grad

    engine = bf16_engine(model, zero, len(inputs))
    try:
        for index, batch in enumerate(inputs):
            engine.backward(engine(*batch))
            if index == len(inputs) - 1:  # the boundary: summed, not yet stepped
                grad = safe_get_full_grad(engine.module.weight).float().clone()
            engine.step()
    finally:
        engine.destroy()
    return grad


@pytest.fixture
def one_rank(group, monkeypatch):
    """A one-process group DeepSpeed's engine joins (it reads the launcher's LOCAL_RANK)."""
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    return group


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


class Regression(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, x, y):
        return ((x @ self.weight.T - y) ** 2).float().mean()


def test_the_generated_bf16_config_sums_and_reduces_gradients_in_float32():
    for zero in (1, 2, 3):
        config = deepspeed_config(run_config(zero, 8), 8, gpu=True)
        assert config["data_types"] == {"grad_accum_dtype": "fp32"}
        assert config["communication_data_type"] == "fp32"
    assert "data_types" not in deepspeed_config(run_config(1, 8), 8, gpu=False)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bf16_micro_batches_sum_like_float64(one_rank, zero):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 64, generator=gen) / 8
    xs = torch.randn(MICRO_BATCHES, 16, 64, generator=gen)
    ys = torch.randn(MICRO_BATCHES, 16, 32, generator=gen) + 1.0
    reference = weight.double().requires_grad_()
    for x, y in zip(xs, ys, strict=True):
        # DeepSpeed divides each micro-batch's loss by the accumulation steps
        (((x.double() @ reference.T - y.double()) ** 2).mean() / MICRO_BATCHES).backward()
    batches = [(x.bfloat16(), y.bfloat16()) for x, y in zip(xs, ys, strict=True)]
    got = summed_gradient(Regression(weight), batches, zero)
    error = relative_error(got, reference.grad)
    assert error < BOUND, f"ZeRO {zero}: summed gradient {error:.2e} from float64's"


class OutputLayerLoss(torch.nn.Module):
    """The output weight [V, h] and the numeric loss on hidden states [s, b, h]: fused, or
    logits then the vocabulary-parallel op."""

    def __init__(self, weight, vocab, cfg, group, fused: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.vocab, self.cfg, self.group, self.fused = vocab, cfg, group, fused

    def forward(self, hidden, labels):
        if self.fused:
            # engine.backward(loss), the trainer's promise: scaled on the device, no host read
            out = vocab_parallel_fused_numeric_loss(
                hidden, self.weight, labels, self.vocab, self.cfg, group=self.group,
                chunk_tokens=8, promise_scaled_loss=True,
            )  # fmt: skip
        else:
            logits = hidden @ self.weight.T
            out = vocab_parallel_numeric_loss(
                logits, labels, self.vocab, self.cfg, group=self.group
            )
        return out.loss


def test_fused_weight_gradient_under_deepspeeds_bf16_optimizer(one_rank):
    """ZeRO 1 with float32 sums is DeepSpeed's BF16_Optimizer: the fused op's bf16 weight
    gradient, summed over 16 micro-batches, is the unfused op's."""
    micro, vocab_size, width, seq = 16, 96, 32, 12
    gen = torch.Generator().manual_seed(1)
    vocab = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[5], vocab_size=vocab_size)
    cfg = NumericLossConfig()
    weight = torch.randn(vocab_size, width, generator=gen) / 4
    hidden = torch.randn(micro, seq, 1, width, generator=gen)
    labels = torch.randint(0, vocab_size, (micro, 1, seq), generator=gen)
    labels[:, :, ::2] = torch.randint(10, 20, (micro, 1, (seq + 1) // 2), generator=gen)
    reference = weight.double().requires_grad_()
    for h, y in zip(hidden, labels, strict=True):
        logits = (h.double() @ reference.T).transpose(0, 1)
        (numeric_loss(logits, y, vocab, cfg).loss / micro).backward()
    batches = [(h.bfloat16(), y) for h, y in zip(hidden, labels, strict=True)]
    grads = {
        fused: summed_gradient(OutputLayerLoss(weight, vocab, cfg, one_rank, fused), batches, 1)
        for fused in (False, True)
    }
    for fused, grad in grads.items():
        error = relative_error(grad, reference.grad)
        assert error < BOUND, f"fused={fused}: {error:.2e} from float64's"
    assert relative_error(grads[True], grads[False].double()) < BOUND


def test_layout_free_state_of_deepspeeds_bf16_optimizer_round_trips(one_rank, tmp_path):
    """The layout-free checkpoint state (checkpoint/optim_state.py) reads and writes the
    BF16_Optimizer that ZeRO 1 becomes with float32 sums: fp32 masters and both Adam moments
    saved from one engine load bit for bit into a fresh one, whose bf16 weights follow. The
    state is the one of the save, though the file is written after two more steps (as the
    background writer does): the save copies it to the host."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 16, 64, generator=gen).bfloat16(), torch.randn(4, 16, 32).bfloat16()
    engines = [bf16_engine(Regression(torch.randn(32, 64, generator=gen)), 1, 2) for _ in "ab"]
    try:
        saved, fresh = engines
        assert type(saved.optimizer).__name__ == "BF16_Optimizer"
        for batch in range(4):
            saved.backward(saved(x[batch], y[batch]))
            saved.step()
        where = dict(tp_rank=0, tp_size=1, vocab_size=32)  # no vocabulary rows in this model
        write = optim_state.save_job(
            DeepSpeedAdapter(saved, zero3=False),
            tmp_path,
            **where,
            dp_rank=0,
            dp_size=1,
            pp_size=1,
            extra={},
        )
        param = saved.module.weight
        keys = ("exp_avg", "exp_avg_sq")
        want = {key: safe_get_full_optimizer_state(param, key).clone() for key in keys}
        want["fp32"] = safe_get_full_fp32_param(param).clone()
        for batch in range(2):  # training goes on while the file is written
            saved.backward(saved(x[batch], y[batch]))
            saved.step()
        assert not torch.equal(safe_get_full_fp32_param(param), want["fp32"])
        write()
        optim_state.load(DeepSpeedAdapter(fresh, zero3=False), tmp_path, **where)
        got = fresh.module.weight
        assert torch.equal(safe_get_full_fp32_param(got), want["fp32"])
        for key in keys:
            assert torch.equal(safe_get_full_optimizer_state(got, key), want[key]), key
        assert torch.equal(got, want["fp32"].bfloat16())
    finally:
        for engine in engines:
            engine.destroy()
