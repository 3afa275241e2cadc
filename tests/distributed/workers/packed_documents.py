"""torchrun worker: packed documents on tensor-parallel vocabulary shards.

Every rank builds the same packed row of documents that meet digit-to-digit and the same
documents as separate rows (tests/losses/test_packed_documents.py), takes its vocabulary
shard, and checks for every kind with a digit term (and grouped digits), through the unfused
op (logits shard) and the fused op (hidden and the weight shard): the packed row with
`document_starts` equals the rows, and equals the single-device reference given the same
starts, in loss, per-token losses, statistics and gradients (float64, 1e-12). Without the
starts, the packed row differs from the rows (the case tells the two apart).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from del_megatron import NumericLossConfig, numeric_loss
from del_megatron.losses import vocab_parallel_numeric_loss
from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss
from tests.losses.batches import GROUPED_VOCAB_SIZE, VOCAB_SIZE, make_grouped_vocab, make_vocab
from tests.losses.test_packed_documents import (
    DIGIT_CASES,
    Case,
    documents,
    from_rows,
    grouped_documents,
)
from tests.utils import assert_close

ATOL = 1e-12


def padded(size: int, world: int) -> int:
    return -(-size // world) * world


def on_shards(fused, vocab, cfg, labels, mask, hidden_bs, weight_full, columns, starts=None):
    """The op on this rank's columns: (output, hidden grad summed over ranks [b, s, h], this
    rank's weight rows' grad)."""
    hidden = hidden_bs.transpose(0, 1).clone().requires_grad_()  # [s, b, h]
    weight = weight_full[columns].clone().requires_grad_()
    if fused:
        out = vocab_parallel_fused_numeric_loss(
            hidden, weight, labels, vocab, cfg, mask, chunk_tokens=5, document_starts=starts
        )
    else:
        out = vocab_parallel_numeric_loss(
            hidden @ weight.T, labels, vocab, cfg, mask, document_starts=starts
        )
    out.loss.backward()
    hidden_grad = hidden.grad.clone()
    dist.all_reduce(hidden_grad)  # megatron's output layer sums its input's gradient
    return out, hidden_grad.transpose(0, 1), weight.grad


def compare(case_name, out, hidden_grad, weight_grad, ref, ref_hidden, ref_weight, lengths=None):
    """out against ref; ref in rows [n, S] where lengths are given (put back in the row)."""
    back = (lambda x: from_rows(x, lengths)) if lengths else (lambda x: x)
    for name in ("loss", "ce", "numeric"):
        assert_close(getattr(out, name), getattr(ref, name), atol=ATOL, what=f"{case_name} {name}")
    for key in ref.stats:
        assert_close(out.stats[key], ref.stats[key], atol=ATOL, what=f"{case_name} {key}")
    assert_close(out.per_token, back(ref.per_token), atol=ATOL, what=f"{case_name} per_token")
    assert_close(hidden_grad, back(ref_hidden), atol=ATOL, what=f"{case_name} hidden grad")
    assert_close(weight_grad, ref_weight, atol=ATOL, what=f"{case_name} weight grad")


def check(rank, world, name, vocab, cfg, case: Case, vocab_size: int) -> int:
    full = padded(vocab_size, world)
    local = full // world
    columns = slice(rank * local, (rank + 1) * local)
    weight_full = torch.cat([case.weight, torch.zeros(full - vocab_size, case.weight.shape[1])])

    # the single-device reference on the packed row, with the starts
    ref_hidden = case.hidden.clone().requires_grad_()
    ref_weight = weight_full.clone().requires_grad_()
    ref = numeric_loss(
        ref_hidden @ ref_weight.T, case.labels, vocab, cfg, case.mask, document_starts=case.starts
    )
    ref.loss.backward()
    cases = 0
    for fused in (False, True):
        what = f"{name}/{'fused' if fused else 'unfused'}/rank {rank}"
        rows = on_shards(
            fused,
            vocab,
            cfg,
            case.rows_labels,
            case.rows_mask,
            case.rows_hidden,
            weight_full,
            columns,
        )
        joined = on_shards(
            fused, vocab, cfg, case.labels, case.mask, case.hidden, weight_full, columns
        )
        assert abs(joined[0].numeric.item() - rows[0].numeric.item()) > 1e-3, what
        packed = on_shards(
            fused,
            vocab,
            cfg,
            case.labels,
            case.mask,
            case.hidden,
            weight_full,
            columns,
            case.starts,
        )
        compare(f"{what} vs rows", *packed, *rows, lengths=case.lengths)
        compare(f"{what} vs reference", *packed, ref, ref_hidden.grad, ref_weight.grad[columns])
        cases += 1
    return cases


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    cases = 0
    vocab = make_vocab()
    for name, cfg in DIGIT_CASES.items():
        cases += check(rank, world, name, vocab, cfg, Case(documents(1), VOCAB_SIZE, 2), VOCAB_SIZE)
    grouped = Case(grouped_documents(3), GROUPED_VOCAB_SIZE, 4)
    cfg = NumericLossConfig(kind="del")
    cases += check(rank, world, "grouped", make_grouped_vocab(), cfg, grouped, GROUPED_VOCAB_SIZE)
    dist.barrier()
    if rank == 0:
        print(f"OK {cases} packed-document cases on {world} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
