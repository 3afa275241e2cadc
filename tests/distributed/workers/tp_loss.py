"""torchrun worker: vocab_parallel_numeric_loss == numeric_loss on the gathered logits.

Every rank builds the same full logits, takes its vocabulary shard, and compares per-token
losses, statistics and gradients with the single-device reference for every loss kind, the
digit-id layouts (a)-(d), masks, ignore_index, padded vocabulary and batches without digits.
Also: kind=mle against megatron-core's vocab_parallel_cross_entropy, collective counts, and an
explicit group with megatron's parallel state never initialized.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from del_megatron import (
    DigitVocab,
    NumericLossConfig,
    collectives,
    emo_cost_embedding,
    numeric_loss,
)
from del_megatron.losses import vocab_parallel_numeric_loss
from tests.utils import assert_close

PADDED = 48  # divisible by 2 and 4
LAYOUTS = {
    # (a) all digits on rank 0
    "one-rank": ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [10]),
    # (b) spread over all ranks
    "spread": ([1, 7, 13, 19, 25, 31, 37, 43, 3, 29], [22]),
    # (c) a contiguous block straddling the middle shard boundary (24)
    "straddle": ([19, 20, 21, 22, 23, 24, 25, 26, 27, 28], [30]),
    # (d) two tokens for one class, on different ranks
    "merged": ([[0, 26], 13, 2, 38, 4, [5, 40], 6, 19, 8, 9], [22, 44]),
}
KINDS = ["mle", "del", "del_distance", "ntl_was", "ntl_mse", "dist2", "mixce", "emo"]


def labels_for(digit_ids, point_ids, batch, seq, vocab_size, gen, digits=True):
    """Sequences of words and numbers over the given ids."""
    flat = {i for ids in digit_ids for i in (ids if isinstance(ids, list) else [ids])}
    others = [i for i in range(vocab_size) if i not in flat and i not in point_ids]

    def digit(j):
        ids = digit_ids[int(torch.randint(10, (1,), generator=gen))]
        return ids[j % len(ids)] if isinstance(ids, list) else ids

    rows = []
    for _ in range(batch):
        row = []
        while len(row) < seq:
            r = float(torch.rand((), generator=gen))
            if not digits or r < 0.4:
                row.append(others[int(torch.randint(len(others), (1,), generator=gen))])
                continue
            row += [digit(j) for j in range(int(torch.randint(1, 6, (1,), generator=gen)))]
            if r > 0.75:  # a decimal part
                row += [point_ids[int(r * 100) % len(point_ids)], digit(0), digit(1)]
        rows.append(row[:seq])
    return torch.tensor(rows)


def compare(case, out, ref, grad_tp, grad_ref, atol):
    assert_close(out.loss, ref.loss, atol=atol, rtol=atol, what=f"{case} loss")
    assert_close(out.per_token, ref.per_token, atol=atol, rtol=atol, what=f"{case} per_token")
    for key in ref.stats:
        assert_close(
            out.stats[key], ref.stats[key], atol=atol, rtol=atol, what=f"{case} stats[{key}]"
        )
    assert_close(grad_tp, grad_ref, atol=atol, rtol=atol, what=f"{case} grad")


def check_against_reference(rank, world, dtype, atol):
    cases = 0
    for layout, (digit_ids, point_ids) in LAYOUTS.items():
        for vocab_size in (PADDED, PADDED - 3):  # exact, padded for tensor parallelism
            vocab = DigitVocab(digit_ids=digit_ids, point_ids=point_ids, vocab_size=vocab_size)
            for variant in ("plain", "masked", "no-digits"):
                gen = torch.Generator().manual_seed(cases)
                batch, seq = 3, 20
                labels = labels_for(
                    digit_ids, point_ids, batch, seq, vocab_size, gen, digits=variant != "no-digits"
                )
                mask = None
                if variant == "masked":
                    labels[torch.rand(labels.shape, generator=gen) < 0.1] = -100
                    mask = (torch.rand(labels.shape, generator=gen) > 0.2).to(dtype)
                full = torch.randn(seq, batch, PADDED, generator=gen, dtype=torch.float64) * 3
                full = full.to(dtype)
                cost = emo_cost_embedding(torch.randn(PADDED, 6, generator=gen)).to(dtype)
                weights = torch.rand(batch, seq, generator=gen, dtype=torch.float64).to(dtype)
                local = PADDED // world
                for kind in [*KINDS, "del:shift_invariant"]:
                    kind, _, option = kind.partition(":")
                    for normalize in ("digits", "tokens"):
                        if kind in ("mle", "mixce", "emo") and normalize == "tokens":
                            continue
                        if option and normalize == "tokens":
                            continue
                        options = {option: True} if option else {}
                        cfg = NumericLossConfig(kind=kind, normalize=normalize, **options)
                        shard = (
                            full[..., rank * local : (rank + 1) * local].clone().requires_grad_()
                        )
                        out = vocab_parallel_numeric_loss(
                            shard,
                            labels,
                            vocab,
                            cfg,
                            mask,
                            cost_embedding=cost[rank * local : (rank + 1) * local],
                        )
                        ref_logits = full.transpose(0, 1).clone().requires_grad_()
                        ref = numeric_loss(
                            ref_logits, labels, vocab, cfg, mask, cost_embedding=cost
                        )
                        # backward through both the scalar and the per-token losses
                        (out.loss + (out.per_token * weights).sum()).backward()
                        (ref.loss + (ref.per_token * weights).sum()).backward()
                        grad_ref = ref_logits.grad.transpose(0, 1)[
                            ..., rank * local : (rank + 1) * local
                        ]
                        case = (
                            f"{layout}/V={vocab_size}/{variant}/{kind}{option}/{normalize}/{dtype}"
                        )
                        compare(case, out, ref, shard.grad, grad_ref, atol)
                        cases += 1
    return cases


def check_mle_equals_megatron(rank, world):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(7)
    digit_ids, point_ids = LAYOUTS["spread"]
    vocab = DigitVocab(digit_ids=digit_ids, point_ids=point_ids, vocab_size=PADDED)
    labels = labels_for(digit_ids, point_ids, 2, 16, PADDED, gen)
    full = torch.randn(16, 2, PADDED, generator=gen)
    local = PADDED // world
    shard = full[..., rank * local : (rank + 1) * local]
    ours_in = shard.clone().requires_grad_()
    theirs_in = shard.clone().requires_grad_()
    ours = vocab_parallel_numeric_loss(ours_in, labels, vocab, NumericLossConfig(kind="mle"))
    theirs = vocab_parallel_cross_entropy(theirs_in * 1.0, labels.t().contiguous())  # [s, b]
    weights = torch.rand(2, 16, generator=gen)
    (ours.per_token * weights).sum().backward()
    (theirs.t() * weights).sum().backward()
    assert_close(ours.per_token, theirs.t(), atol=1e-5, what="mle vs megatron values")
    assert_close(ours_in.grad, theirs_in.grad, atol=1e-5, what="mle vs megatron grads")
    assert torch.equal(ours_in.detach(), shard), "the caller's logits were modified"


def count_collectives(rank, world):
    """Counts the collectives the op issues, at the rule every one of ours goes through
    (del_megatron/collectives.py; tests/test_collectives_rule.py checks that none goes
    around it): 2 forward (3 for emo), 0 backward, whatever the group's size."""
    names = ["all_reduce", "all_gather", "all_gather_object", "barrier"]
    calls = []
    originals = {n: getattr(collectives, n) for n in names}

    def counting(name):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)

        return wrapper

    gen = torch.Generator().manual_seed(11)
    digit_ids, point_ids = LAYOUTS["merged"]
    vocab = DigitVocab(digit_ids=digit_ids, point_ids=point_ids, vocab_size=PADDED - 3)
    labels = labels_for(digit_ids, point_ids, 2, 16, PADDED - 3, gen)
    local = PADDED // world
    cost = emo_cost_embedding(torch.randn(PADDED, 4, generator=gen))[
        rank * local : (rank + 1) * local
    ]
    for name in names:
        setattr(collectives, name, counting(name))
    try:
        for kind, expected_forward in [("del", 2), ("mle", 2), ("ntl_was", 2), ("emo", 3)]:
            shard = torch.randn(16, 2, local, generator=gen, requires_grad=True)
            calls.clear()
            out = vocab_parallel_numeric_loss(
                shard, labels, vocab, NumericLossConfig(kind=kind), cost_embedding=cost
            )
            forward = list(calls)
            calls.clear()
            out.loss.backward()
            assert len(forward) == expected_forward, (kind, forward)
            assert forward[:2] == ["all_reduce", "all_reduce"], (kind, forward)
            assert calls == [], (kind, "backward collectives", calls)
    finally:
        for name, fn in originals.items():
            setattr(collectives, name, fn)


def check_retain_graph_is_refused(rank, world):
    digit_ids, point_ids = LAYOUTS["spread"]
    vocab = DigitVocab(digit_ids=digit_ids, point_ids=point_ids, vocab_size=PADDED)
    labels = labels_for(digit_ids, point_ids, 1, 8, PADDED, torch.Generator().manual_seed(1))
    shard = torch.randn(8, 1, PADDED // world, requires_grad=True)
    out = vocab_parallel_numeric_loss(shard, labels, vocab)
    out.loss.backward(retain_graph=True)
    try:
        out.loss.backward()
    except RuntimeError as err:
        assert "retain_graph" in str(err)
    else:
        raise AssertionError("a second backward through the same graph was accepted")


def check_saved_memory(rank, world):
    """Saved for backward: one float32 [N, V/tp] buffer plus O(N * K), like megatron's CE."""
    from torch.autograd.graph import saved_tensors_hooks

    digit_ids, point_ids = LAYOUTS["merged"]
    local = 4096  # large enough that one more [N, V/tp] buffer would dwarf the O(N * K) part
    vocab = DigitVocab(digit_ids=digit_ids, point_ids=point_ids, vocab_size=local * world)
    seq, batch = 64, 4
    labels = labels_for(digit_ids, point_ids, batch, seq, 48, torch.Generator().manual_seed(3))
    for dtype in (torch.float32, torch.bfloat16):
        saved = {}

        def pack(t, saved=saved):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        shard = torch.randn(seq, batch, local).to(dtype).requires_grad_()
        with saved_tensors_hooks(pack, lambda t: t):
            out = vocab_parallel_numeric_loss(shard, labels, vocab, NumericLossConfig(kind="del"))
        rows = seq * batch
        buffer = rows * local * 4
        # besides the buffer: per row a handful of scalars and the K x M member shares, in a
        # few copies (autograd of the small digit terms): O(N * K), under 5% of the buffer here
        small = rows * (16 + 4 * 10 * 2) * 8
        total = sum(saved.values())
        assert buffer <= total <= buffer + small, (dtype, total, buffer, small)
        out.loss.backward()


def check_bf16(rank, world):
    """bf16 shards are computed in float32: equal to the reference on the same bf16 logits."""
    digit_ids, point_ids = LAYOUTS["straddle"]
    vocab = DigitVocab(digit_ids=digit_ids, point_ids=point_ids, vocab_size=PADDED - 3)
    gen = torch.Generator().manual_seed(4)
    labels = labels_for(digit_ids, point_ids, 2, 32, PADDED - 3, gen)
    full = (torch.randn(32, 2, PADDED, generator=gen) * 3).bfloat16()
    local = PADDED // world
    for kind in ("del", "dist2", "mle"):
        cfg = NumericLossConfig(kind=kind)
        shard = full[..., rank * local : (rank + 1) * local].clone().requires_grad_()
        out = vocab_parallel_numeric_loss(shard, labels, vocab, cfg)
        ref_logits = full.transpose(0, 1).clone().requires_grad_()
        ref = numeric_loss(ref_logits, labels, vocab, cfg)
        out.loss.backward()
        ref.loss.backward()
        assert shard.grad.dtype == torch.bfloat16
        assert_close(out.loss, ref.loss, atol=1e-5, what=f"bf16 {kind} loss")
        grad_ref = ref_logits.grad.transpose(0, 1)[..., rank * local : (rank + 1) * local]
        assert_close(shard.grad.float(), grad_ref.float(), atol=1e-4, what=f"bf16 {kind} grad")


GROUPED_PADDED = 160  # the grouped vocabulary's 155 tokens, padded; 160 / 4 = 40 per rank
GROUPED_KINDS = ["del", "del_distance", "ntl_was", "ntl_mse", "dist2", "mle", "mixce", "emo"]


def check_grouped(rank, world):
    """Grouped digits (number tokens of 1..3 digits, tests/losses/batches.py): the unfused
    and the fused op on vocabulary shards equal the single-device reference (itself equal to
    the float64 loop oracle, tests/losses/test_groups.py; checked here too, float64 digits
    kinds), values, statistics and gradients, float64 within 1e-10 and float32 within 1e-5;
    the fused op both recomputing (per_token weighted) and handing over the gradient it
    formed in forward (the loss, scaled, under `promise_scaled_loss`)."""
    from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss
    from tests.losses.batches import (
        GROUPED_POINT_IDS,
        GROUPED_STRINGS,
        GROUPED_VOCAB_SIZE,
        make_grouped_batch,
        make_grouped_vocab,
    )
    from tests.losses.reference_loops import grouped_loop_loss
    from tests.losses.test_numeric_loss import _loop_cfg

    vocab = make_grouped_vocab()
    group = dist.group.WORLD  # the megatron group when initialized is this one too
    local = GROUPED_PADDED // world
    mine = slice(rank * local, (rank + 1) * local)
    cases = 0
    for dtype, atol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        for kind in GROUPED_KINDS:
            for normalize in ("digits", "tokens"):
                if kind in ("mle", "mixce", "emo") and normalize == "tokens":
                    continue
                cfg = NumericLossConfig(kind=kind, normalize=normalize)
                batch, seq, hidden_size = 2, 19, 8
                labels, mask = make_grouped_batch(batch, seq, seed=cases)
                gen = torch.Generator().manual_seed(100 + cases)
                weight = torch.randn(GROUPED_PADDED, hidden_size, generator=gen).to(dtype)
                hidden = torch.randn(seq, batch, hidden_size, generator=gen).to(dtype)
                weights = torch.rand(batch, seq, generator=gen).to(dtype)
                cost = emo_cost_embedding(weight).to(dtype)
                full = hidden @ weight.T  # [s, b, V]

                ref_logits = full.transpose(0, 1).clone().requires_grad_()
                ref = numeric_loss(ref_logits, labels, vocab, cfg, mask, cost_embedding=cost)
                (ref.loss + (ref.per_token * weights).sum()).backward()
                grad_ref = ref_logits.grad.transpose(0, 1)[..., mine]

                shard = full[..., mine].clone().requires_grad_()
                out = vocab_parallel_numeric_loss(
                    shard, labels, vocab, cfg, mask, group, cost_embedding=cost[mine]
                )
                (out.loss + (out.per_token * weights).sum()).backward()
                case = f"grouped/{kind}/{normalize}/{dtype}"
                compare(case, out, ref, shard.grad, grad_ref, atol)

                # fused, chunks of 7 rows (38 tokens: the last chunk short); per_token weighted
                # by arbitrary values: the gradient formed in forward is not a multiple of the
                # incoming one, so the checked backward recomputes
                h = hidden.clone().requires_grad_()
                w = weight[mine].clone().requires_grad_()
                fused = vocab_parallel_fused_numeric_loss(
                    h, w, labels, vocab, cfg, mask, group, cost_embedding=cost[mine],
                    chunk_tokens=7,
                )  # fmt: skip
                (fused.loss + (fused.per_token * weights).sum()).backward()
                ref_h = hidden.transpose(0, 1).clone().requires_grad_()
                ref_w = weight.clone().requires_grad_()
                ref2 = numeric_loss(ref_h @ ref_w.T, labels, vocab, cfg, mask, cost_embedding=cost)
                (ref2.loss + (ref2.per_token * weights).sum()).backward()
                grad_h = h.grad.clone()
                dist.all_reduce(grad_h)  # megatron's output layer sums the input gradient
                compare(f"fused {case}", fused, ref2, w.grad, ref_w.grad[mine], atol)
                assert_close(
                    grad_h, ref_h.grad.transpose(0, 1), atol=atol, rtol=atol,
                    what=f"fused {case} grad hidden",
                )  # fmt: skip
                # the loss' own gradient, scaled (the trainer's backward): formed in forward
                # through the slots' set log-sum-exps and handed over; under the promise a
                # prediction that missed would raise instead of recomputing
                h = hidden.clone().requires_grad_()
                w = weight[mine].clone().requires_grad_()
                fused = vocab_parallel_fused_numeric_loss(
                    h, w, labels, vocab, cfg, mask, group, cost_embedding=cost[mine],
                    chunk_tokens=7, promise_scaled_loss=True,
                )  # fmt: skip
                (fused.loss * 1.7).backward()
                ref_h = hidden.transpose(0, 1).clone().requires_grad_()
                ref_w = weight.clone().requires_grad_()
                ref3 = numeric_loss(ref_h @ ref_w.T, labels, vocab, cfg, mask, cost_embedding=cost)
                (ref3.loss * 1.7).backward()
                grad_h = h.grad.clone()
                dist.all_reduce(grad_h)
                compare(f"fused own {case}", fused, ref3, w.grad, ref_w.grad[mine], atol)
                assert_close(
                    grad_h, ref_h.grad.transpose(0, 1), atol=atol, rtol=atol,
                    what=f"fused own {case} grad hidden",
                )  # fmt: skip
                if dtype == torch.float64 and kind in GROUPED_KINDS[:6]:
                    loss = grouped_loop_loss(
                        full.transpose(0, 1).tolist(), labels.tolist(), GROUPED_STRINGS,
                        GROUPED_POINT_IDS, _loop_cfg(cfg), GROUPED_VOCAB_SIZE, mask.tolist(),
                    )[0]  # fmt: skip
                    assert_close(out.loss, loss, atol=1e-10, what=f"{case} oracle")
                cases += 1
    return cases


def run_mode(mode: str, rank: int, world: int) -> int:
    """One mode's checks; returns its number of cases."""
    global vocab_parallel_numeric_loss
    if mode == "explicit-group":
        # megatron's parallel state is never initialized: the group must come from the caller
        group = dist.new_group(list(range(world)))
        plain = vocab_parallel_numeric_loss

        def with_group(*args, **kwargs):
            return plain(*args, group=group, **kwargs)

        vocab_parallel_numeric_loss = with_group
        try:
            return check_against_reference(rank, world, torch.float64, 1e-10)
        finally:
            vocab_parallel_numeric_loss = plain
    if mode == "grouped":  # grouped digits alone (not launched by the suite: a quick run)
        return check_grouped(rank, world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    cases = check_against_reference(rank, world, torch.float64, 1e-10)
    cases += check_against_reference(rank, world, torch.float32, 1e-5)
    check_mle_equals_megatron(rank, world)
    count_collectives(rank, world)
    check_retain_graph_is_refused(rank, world)
    check_saved_memory(rank, world)
    check_bf16(rank, world)
    grouped = check_grouped(rank, world)
    if rank == 0:
        print(f"OK {grouped} grouped cases on {world} ranks")
    return cases


def main() -> None:
    """argv: modes (explicit-group | grouped | reference), run in turn in one process group;
    explicit-group before reference, which initializes megatron's parallel state."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for mode in sys.argv[1:]:
        cases = run_mode(mode, rank, world)
        dist.barrier()
        if rank == 0:
            print(f"OK {cases} cases on {world} ranks ({mode})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
