"""torchrun worker: vocab_parallel_fused_numeric_loss(hidden, W_shard) equals
vocab_parallel_numeric_loss(hidden @ W_shard^T) on every rank: loss, per-token losses,
statistics, and the gradients of hidden and of the weight shard, for every kind, the digit
layouts (a)-(d), padded vocabularies, masks and chunk sizes that do not divide the tokens;
float64 within 1e-10, float32 within 1e-5, bf16 inputs accumulated in float32. And the
collectives: one MAX and one SUM in forward (EMO included), none in backward.

argv: dtype (float64 | float32 | bfloat16)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from del_megatron import DigitVocab, NumericLossConfig, emo_cost_embedding
from del_megatron.losses import vocab_parallel_numeric_loss
from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss
from tests.distributed.workers.tp_loss import KINDS, LAYOUTS, PADDED, labels_for
from tests.utils import assert_close

HIDDEN = 12
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


class CountCollectives:
    def __enter__(self):
        self.calls = []
        self.original = dist.all_reduce

        def counted(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
            self.calls.append(op)
            return self.original(tensor, op, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.original


def run(case: dict, dtype: torch.dtype, group, fused: bool):
    """Loss and gradients of one case, fused or on the materialized logits; and the
    collectives of forward and backward."""
    hidden = case["hidden"].to(dtype).requires_grad_()
    weight = case["shard"].to(dtype).requires_grad_()
    args = (case["labels"], case["vocab"], case["cfg"], case["mask"], group)
    with CountCollectives() as forward:
        if fused:
            out = vocab_parallel_fused_numeric_loss(
                hidden, weight, *args, cost_embedding=case["cost"], chunk_tokens=case["chunk"]
            )
        else:
            out = vocab_parallel_numeric_loss(hidden @ weight.T, *args, cost_embedding=case["cost"])
    with CountCollectives() as backward:
        out.loss.backward()
    return out, hidden.grad, weight.grad, forward.calls, backward.calls


def cases(rank: int, world: int):
    count = 0
    for layout, (digit_ids, point_ids) in LAYOUTS.items():
        for vocab_size in (PADDED, PADDED - 3):
            vocab = DigitVocab(digit_ids=digit_ids, point_ids=point_ids, vocab_size=vocab_size)
            for kind in KINDS:
                for chunk in (5, 16, 1000):  # 3 x 13 = 39 tokens: chunks that do not divide
                    gen = torch.Generator().manual_seed(count)
                    batch, seq = 3, 13
                    rows = PADDED // world
                    weight = torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64)
                    shard = weight[rank * rows : (rank + 1) * rows]
                    yield {
                        "what": f"{layout} V={vocab_size} {kind} chunk={chunk}",
                        "labels": labels_for(digit_ids, point_ids, batch, seq, vocab_size, gen),
                        "mask": (torch.rand(batch, seq, generator=gen) > 0.2).float(),
                        "hidden": torch.randn(
                            seq, batch, HIDDEN, generator=gen, dtype=torch.float64
                        ),
                        "shard": shard,
                        "vocab": vocab,
                        "cfg": NumericLossConfig(kind=kind),
                        "cost": emo_cost_embedding(shard) if kind == "emo" else None,
                        "chunk": chunk,
                    }
                    count += 1


# argmax ties and near-ties resolve differently once bf16 rounds the logits
ARGMAX_STATS = ("digit_correct", "digit_cond_correct", "digit_abs_error_sum")


def main() -> None:
    dtype = getattr(torch, sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    atol = TOLERANCE[dtype]
    count = 0
    for case in cases(rank, world):
        fused, grad_h, grad_w, fwd, bwd = run(case, dtype, group, fused=True)
        ref, ref_h, ref_w, _, _ = run(case, dtype, group, fused=False)
        what = f"{case['what']} {dtype}"
        assert fwd == [dist.ReduceOp.MAX, dist.ReduceOp.SUM], (what, fwd)
        assert bwd == [], (what, bwd)
        assert_close(fused.loss, ref.loss, atol=atol, rtol=atol, what=f"{what} loss")
        assert_close(fused.per_token, ref.per_token, atol=atol, rtol=atol, what=f"{what} per_token")
        for key in ref.stats:
            if dtype == torch.bfloat16 and key in ARGMAX_STATS:
                continue
            assert_close(
                fused.stats[key], ref.stats[key], atol=atol, rtol=atol, what=f"{what} {key}"
            )
        assert_close(
            grad_h.float(), ref_h.float(), atol=atol, rtol=atol, what=f"{what} grad hidden"
        )
        assert_close(
            grad_w.float(), ref_w.float(), atol=atol, rtol=atol, what=f"{what} grad weight"
        )
        count += 1
    if rank == 0:
        print(f"OK {count} cases on {world} ranks in {dtype}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
