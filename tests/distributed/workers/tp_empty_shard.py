"""torchrun worker (2 ranks): a vocabulary padded so far that rank 1 owns no real column.

Vocabulary 20 padded to 48 (the README's model: 100 padded to 256) leaves rank 1 the
columns 24..47, all padding. The unfused op (logits shard) and the fused op (hidden and the
weight shard) must equal the single-process reference on the gathered logits: values,
statistics, and gradients (the padding columns' gradient is zero), for every kind.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from del_megatron import DigitVocab, NumericLossConfig, emo_cost_embedding, numeric_loss
from del_megatron.losses import vocab_parallel_numeric_loss
from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss
from tests.utils import assert_close

VOCAB, PADDED, HIDDEN = 20, 48, 8
KINDS = ["mle", "del", "del_distance", "ntl_was", "ntl_mse", "dist2", "mixce", "emo"]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    local = PADDED // world
    columns = slice(rank * local, (rank + 1) * local)
    vocab = DigitVocab(digit_ids=list(range(5, 15)), point_ids=[15], vocab_size=VOCAB)
    gen = torch.Generator().manual_seed(0)
    seq, batch = 12, 2
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    hidden_full = torch.randn(seq, batch, HIDDEN, generator=gen, dtype=torch.float64)
    weight_full = torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64)
    weight_full[VOCAB:] = 0  # padding rows, as megatron initializes nothing special there
    cost = emo_cost_embedding(torch.randn(PADDED, 4, generator=gen, dtype=torch.float64))
    cases = 0
    for kind in KINDS:
        cfg = NumericLossConfig(kind=kind)
        # the reference: one process, the real vocabulary only
        ref_hidden = hidden_full.clone().requires_grad_()
        ref_weight = weight_full[:VOCAB].clone().requires_grad_()
        ref_logits = (ref_hidden @ ref_weight.T).transpose(0, 1)
        ref = numeric_loss(ref_logits, labels, vocab, cfg, cost_embedding=cost[:VOCAB])
        ref.loss.backward()
        ref_weight_grad = torch.cat([ref_weight.grad, torch.zeros(PADDED - VOCAB, HIDDEN)])

        for fused in (False, True):
            hidden = hidden_full.clone().requires_grad_()
            weight = weight_full[columns].clone().requires_grad_()
            if fused:
                out = vocab_parallel_fused_numeric_loss(
                    hidden, weight, labels, vocab, cfg, cost_embedding=cost[columns]
                )
            else:
                out = vocab_parallel_numeric_loss(
                    hidden @ weight.T, labels, vocab, cfg, cost_embedding=cost[columns]
                )
            out.loss.backward()
            case = f"{kind}/{'fused' if fused else 'unfused'}/rank {rank}"
            assert_close(out.loss, ref.loss, atol=1e-10, what=f"{case} loss")
            assert_close(out.per_token, ref.per_token, atol=1e-10, what=f"{case} per_token")
            for key in ref.stats:
                assert_close(out.stats[key], ref.stats[key], atol=1e-10, what=f"{case} {key}")
            # each rank holds its part of hidden's gradient (the output layer's all-reduce
            # in megatron sums them)
            hidden_grad = hidden.grad.clone()
            dist.all_reduce(hidden_grad)
            assert_close(hidden_grad, ref_hidden.grad, atol=1e-10, what=f"{case} hidden grad")
            assert_close(
                weight.grad, ref_weight_grad[columns], atol=1e-10, what=f"{case} weight grad"
            )
            cases += 1
    dist.barrier()
    if rank == 0:
        print(f"OK {cases} cases, rank 1 owning no real column")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
