"""torchrun worker: a Llama-style megatron-core GPTModel with the DEL hook at TP = world size
gives the gradients of the same weights at TP = 1, and the same report (the digit-logit
level statistics and the gradient probe, `numeric_grad_probe`, included).

Each rank first builds the TP = 1 model (megatron parallel state with TP 1), runs one
forward/backward, keeps weights and gradients; then re-initializes megatron with TP = world,
builds the sharded model, loads each rank's shard of the same weights, runs the same batch,
and compares every parameter gradient with the matching shard of the TP = 1 gradient.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from del_megatron import DigitVocab, NumericLossConfig
from del_megatron.models import LlamaArchitecture, build_llama, loss_func
from del_megatron.models.sharding import partition_of_param, split
from tests.utils import assert_close

ARCH = LlamaArchitecture(
    vocab_size=100,
    hidden_size=64,
    ffn_hidden_size=96,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    max_position_embeddings=64,
    rope_theta=10000.0,
    qkv_bias=True,
    make_vocab_size_divisible_by=64,
)
VOCAB = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[20], vocab_size=ARCH.vocab_size)


def batch():
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, ARCH.vocab_size, (2, 25), generator=gen)
    digits = torch.rand(tokens.shape, generator=gen) < 0.4
    tokens = torch.where(digits, torch.randint(10, 21, tokens.shape, generator=gen), tokens)
    loss_mask = (torch.rand(2, 24, generator=gen) > 0.1).float()
    return tokens[:, :-1], tokens[:, 1:].contiguous(), loss_mask


def step(model, kind, probe=False, backward=True):
    """probe: the model's gradient probe (`numeric_grad_probe`), whose forward goes through
    megatron's logits; its gradients must be the unprobed forward's."""
    inputs, labels, loss_mask = batch()
    positions = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
    probed = {"numeric_grad_probe": True} if probe else {}
    output = model(inputs, positions, None, labels=labels, loss_mask=loss_mask, **probed)
    loss_sum, num_tokens, report = loss_func(loss_mask, output)
    if backward:
        (loss_sum / num_tokens).backward()
    return loss_sum / num_tokens, report


def main() -> None:
    kind = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = NumericLossConfig(kind=kind)
    cpu = torch.device("cpu")

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    full = build_llama(ARCH, VOCAB, cfg, cpu, seed=1234)
    full_loss, full_report = step(full, kind)
    # the probe at TP 1 (forward only): the report the TP = world probe must give
    _, probed_report = step(full, kind, probe=True, backward=False)
    weights = {n: p.detach().clone() for n, p in full.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in full.named_parameters()}
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    # a different init: the weights must come from the TP = 1 set
    sharded = build_llama(ARCH, VOCAB, cfg, cpu, seed=99)
    with torch.no_grad():
        for name, param in sharded.named_parameters():
            param.copy_(split(weights[name], partition_of_param(param), rank, world))
    sharded.freeze_emo_cost_embedding()  # weights loaded after construction (emo's cost)
    # probed at TP = world: its gradients are the unprobed TP = 1 ones, its report (digit
    # level statistics and gradient probe included) the probed TP = 1 one
    loss, report = step(sharded, kind, probe=True)

    assert_close(loss, full_loss, atol=1e-6, what="loss")
    probe_keys = {"numeric_grad_share", "numeric_grad_cos"}
    assert set(report) == set(full_report) | (probe_keys if kind != "emo" else set()), report
    assert set(probed_report) == set(report), probed_report
    for key in report:
        assert_close(report[key], probed_report[key], atol=1e-5, rtol=1e-6, what=f"report {key}")
        if key in full_report:
            assert_close(report[key], full_report[key], atol=1e-5, rtol=1e-6, what=f"report {key}")
    compared = 0
    for name, param in sharded.named_parameters():
        expected = split(grads[name], partition_of_param(param), rank, world)
        assert_close(param.grad, expected, atol=1e-5, what=f"grad {name}")
        compared += 1
    dist.barrier()
    if rank == 0:
        digits = full_report["digit_acc"][1].item()
        share = report["numeric_grad_share"][0].item() if "numeric_grad_share" in report else 0
        print(
            f"OK {compared} parameter gradients, kind={kind}, {digits:.0f} digit positions, "
            f"loss {loss.item():.6f}, numeric_grad_share {share:.4f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
