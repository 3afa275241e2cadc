"""torchrun worker: vocab_parallel_fused_numeric_loss(hidden, W_shard) equals
vocab_parallel_numeric_loss(hidden @ W_shard^T) on every rank: loss, per-token losses,
statistics, and the gradients of hidden and of the weight shard, for every kind, the digit
layouts (a)-(d), padded vocabularies, masks and chunk sizes that do not divide the tokens;
float64 within 1e-10, float32 within 1e-5, bf16 inputs accumulated in float32. Three ways
to the gradient: formed in forward (every kind but EMO takes it for `loss`), recomputed in
backward for an incoming per-token gradient of arbitrary values (the fallback), and
`recompute=True`. And the collectives: one MAX and one SUM per chunk in forward, with as many
elements in all as the unfused op's (the bytes per token), none in backward.

argv: dtypes (float64 | float32 | bfloat16), each checked in turn in this one process group
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from del_megatron import DigitVocab, NumericLossConfig, collectives, emo_cost_embedding
from del_megatron.losses import fused as fused_module
from del_megatron.losses import vocab_parallel_numeric_loss
from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss
from tests.distributed.workers.tp_loss import KINDS, LAYOUTS, PADDED, labels_for
from tests.utils import assert_close

HIDDEN = 12
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


class CountCollectives:
    """The all-reduces made while active: (op, number of elements) each, counted at the rule
    every collective of ours goes through (del_megatron/collectives.py), so at any group
    size, one rank included."""

    def __enter__(self):
        self.calls = []
        self.original = collectives.all_reduce

        def counted(tensor, *, op=dist.ReduceOp.SUM, **kwargs):
            self.calls.append((op, tensor.numel()))
            return self.original(tensor, op=op, **kwargs)

        collectives.all_reduce = counted
        return self

    def __exit__(self, *exc):
        collectives.all_reduce = self.original


class CountRecomputes:
    """How many backward calls of the fused op recomputed the logits."""

    def __enter__(self):
        self.count = 0
        self.original = fused_module._recomputed

        def counted(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)

        fused_module._recomputed = counted
        return self

    def __exit__(self, *exc):
        fused_module._recomputed = self.original


def run(case: dict, dtype: torch.dtype, group, mode: str, weighting=None):
    """Loss and gradients of one case: mode 'unfused' (on the materialized logits), 'fused'
    or 'recompute'; the objective is `loss`, or (per_token * weighting).sum() when given.
    Also the collectives of forward and backward and the number of recomputing backwards."""
    hidden = case["hidden"].to(dtype).requires_grad_()
    weight = case["shard"].to(dtype).requires_grad_()
    args = (case["labels"], case["vocab"], case["cfg"], case["mask"], group)
    with CountCollectives() as forward:
        if mode == "unfused":
            out = vocab_parallel_numeric_loss(hidden @ weight.T, *args, cost_embedding=case["cost"])
        else:
            out = vocab_parallel_fused_numeric_loss(
                hidden,
                weight,
                *args,
                cost_embedding=case["cost"],
                chunk_tokens=case["chunk"],
                recompute=mode == "recompute",
            )
    objective = out.loss if weighting is None else (out.per_token * weighting).sum()
    with CountCollectives() as backward, CountRecomputes() as recomputes:
        objective.backward()
    return out, hidden.grad, weight.grad, forward.calls, backward.calls, recomputes.count


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


def compare(got, ref, dtype, what):
    atol = TOLERANCE[dtype]
    fused, grad_h, grad_w = got[:3]
    expected, ref_h, ref_w = ref[:3]
    assert_close(fused.loss, expected.loss, atol=atol, rtol=atol, what=f"{what} loss")
    assert_close(
        fused.per_token, expected.per_token, atol=atol, rtol=atol, what=f"{what} per_token"
    )
    for key in expected.stats:
        if dtype == torch.bfloat16 and key in ARGMAX_STATS:
            continue
        assert_close(
            fused.stats[key], expected.stats[key], atol=atol, rtol=atol, what=f"{what} {key}"
        )
    assert_close(grad_h.float(), ref_h.float(), atol=atol, rtol=atol, what=f"{what} grad hidden")
    assert_close(grad_w.float(), ref_w.float(), atol=atol, rtol=atol, what=f"{what} grad weight")


def main() -> None:
    dist.init_process_group("gloo")
    for name in sys.argv[1:]:
        check_dtype(getattr(torch, name), dist.group.WORLD)
    dist.destroy_process_group()


def check_dtype(dtype: torch.dtype, group) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    count = 0
    for case in cases(rank, world):
        what = f"{case['what']} {dtype}"
        ref = run(case, dtype, group, "unfused")
        got = run(case, dtype, group, "fused")
        tokens = case["labels"].numel()
        chunks = -(-tokens // case["chunk"])
        ops = [op for op, _ in got[3]]
        assert ops == [dist.ReduceOp.MAX, dist.ReduceOp.SUM] * chunks, (what, got[3])
        elements = sum(n for _, n in got[3])
        assert elements == sum(n for _, n in ref[3]), (what, got[3], ref[3])  # bytes per token
        assert got[4] == [], (what, got[4])
        # the gradient formed in forward is used, except for EMO (a ratio of whole-batch sums)
        assert got[5] == (1 if case["cfg"].kind == "emo" else 0), (what, got[5])
        compare(got, ref, dtype, what)
        if case["chunk"] == 16:
            # an incoming per-token gradient of arbitrary values: no multiple of the prediction
            gen = torch.Generator().manual_seed(count)
            weighting = torch.rand(case["labels"].shape, generator=gen, dtype=torch.float64)
            weighting = weighting.to(ref[0].per_token.dtype)
            ref_w = run(case, dtype, group, "unfused", weighting)
            got_w = run(case, dtype, group, "fused", weighting)
            assert got_w[5] == 1, (what, "arbitrary weighting did not recompute")
            compare(got_w, ref_w, dtype, f"{what} weighted")
        if case["chunk"] == 5:
            got_r = run(case, dtype, group, "recompute")
            assert got_r[5] == 1, (what, "recompute=True did not recompute")
            compare(got_r, ref, dtype, f"{what} recompute=True")
        count += 1
    if rank == 0:
        print(f"OK {count} cases on {world} ranks in {dtype}")


if __name__ == "__main__":
    main()
