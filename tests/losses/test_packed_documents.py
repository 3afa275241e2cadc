"""Packed documents (megatron's THD format): digit runs and place values end where a document
starts (`document_starts`), so a packed row gives exactly what its documents give as separate
rows: places, loss, statistics and gradients, for every kind with a digit term, through the
reference, the unfused and the fused op, single digits and grouped digits. `document_starts_of`
reads megatron-core's PackedSeqParams as Megatron-LM's and Megatron-Bridge's data sets build
them. Without the starts, a packed row whose documents meet digit-to-digit reads one number
(issue 51: numeric term 0.3326 packed against 0.2340 as separate rows): each equivalence test
first checks that it does, so that it can tell the two apart."""

from __future__ import annotations

import itertools

import pytest
import torch

from del_megatron import NumericLossConfig, numeric_loss
from del_megatron.errors import UserError
from del_megatron.losses import NumericLossHead, digit_places
from del_megatron.losses.documents import document_starts_of
from del_megatron.losses.groups import grouped_places
from del_megatron.losses.vocab import POINT_CLASS

from ..utils import assert_close
from .batches import (
    DIGIT_IDS,
    GROUPED_STRINGS,
    GROUPED_VOCAB_SIZE,
    OTHER_IDS,
    POINT_IDS,
    VOCAB_SIZE,
    grouped_sequence,
    make_grouped_vocab,
    make_vocab,
    number_sequence,
)

HIDDEN = 6
ATOL = 1e-12  # float64 throughout: the two layouts differ only in the order of sums

# every kind with a digit term, with place weights (without them a run's places do not matter)
DIGIT_CASES = {
    "del": NumericLossConfig(kind="del"),
    "del-point-class": NumericLossConfig(kind="del", include_decimal_point=True),
    "del-tokens": NumericLossConfig(kind="del", normalize="tokens", alpha=0.3),
    "del_distance": NumericLossConfig(kind="del_distance"),
    "ntl_was": NumericLossConfig(kind="ntl_was", place_weighting=True),
    "ntl_mse": NumericLossConfig(kind="ntl_mse", place_weighting=True),
    "dist2": NumericLossConfig(kind="dist2", place_weighting=True),
}
PATHS = ["reference", "unfused", "fused"]


# ---- building packed rows and their documents as rows ------------------------------------


def digit(value: int) -> int:
    ids = DIGIT_IDS[value]
    return ids[0] if isinstance(ids, list) else ids


def documents(seed: int) -> list[list[int]]:
    """Three documents' labels that meet digit-to-digit ("...12" + "34...") and '.'-to-digit
    ("...3." + "5..."), each also full of numbers of its own."""
    gen = torch.Generator().manual_seed(seed)
    first = number_sequence(gen, 9)[:7] + [digit(1), digit(2)]
    second = [digit(3), digit(4)] + number_sequence(gen, 8)[:6] + [digit(3), POINT_IDS[0]]
    third = [digit(5), digit(7)] + number_sequence(gen, 7)
    return [first, second, third]


def grouped_documents(seed: int) -> list[list[int]]:
    """Grouped digits: number tokens meeting number tokens at each boundary."""
    gen = torch.Generator().manual_seed(seed)
    by_length: dict[int, list[int]] = {}
    for i, text in sorted(GROUPED_STRINGS.items()):
        by_length.setdefault(len(text), []).append(i)
    first = grouped_sequence(gen, 8) + [by_length[2][3], by_length[3][1]]
    second = [by_length[1][4], by_length[3][2]] + grouped_sequence(gen, 7)
    return [first, second]


def starts_of(lengths: list[int]) -> torch.Tensor:
    """[1, sum] bool, True at each document's first position."""
    starts = torch.zeros(1, sum(lengths), dtype=torch.bool)
    starts[0, torch.tensor([0, *lengths[:-1]]).cumsum(0)] = True
    return starts


def as_rows(packed: torch.Tensor, lengths: list[int], fill) -> torch.Tensor:
    """packed [1, T, ...] -> [n, S, ...]: each document a row, padded with `fill`."""
    width = max(lengths)
    rows = packed.new_full((len(lengths), width, *packed.shape[2:]), fill)
    for i, part in enumerate(packed[0].split(lengths)):
        rows[i, : len(part)] = part
    return rows


def from_rows(rows: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[n, S, ...] -> [1, T, ...]: the documents' positions back in the packed row."""
    return torch.cat([rows[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)


class Case:
    """A packed row [1, T] of documents and the same documents as rows [n, S] (padded with
    ignore_index, masked): labels, loss mask, and float64 hidden states and output weights."""

    def __init__(self, docs: list[list[int]], vocab_size: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.lengths = [len(d) for d in docs]
        self.labels = torch.tensor([[t for d in docs for t in d]])
        total = self.labels.shape[1]
        self.mask = (torch.rand(1, total, generator=gen) > 0.15).double()
        self.starts = starts_of(self.lengths)
        # the positions where documents meet stay counted: that is where they would join
        self.mask[self.starts | torch.roll(self.starts, -1, 1)] = 1.0
        self.hidden = torch.randn(1, total, HIDDEN, generator=gen, dtype=torch.float64)
        self.weight = torch.randn(vocab_size, HIDDEN, generator=gen, dtype=torch.float64)
        self.rows_labels = as_rows(self.labels, self.lengths, -100)
        self.rows_mask = as_rows(self.mask, self.lengths, 0.0)
        self.rows_hidden = as_rows(self.hidden, self.lengths, 0.0)


def run(path, vocab, cfg, labels, mask, hidden_bs, weight, group, starts=None):
    """The loss of `path` on hidden [b, s, h] and weight [V, h] (leaves here), with the
    gradient of its loss: (output, d/d hidden [b, s, h], d/d weight [V, h])."""
    hidden_bs = hidden_bs.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    if path == "reference":
        logits = hidden_bs @ weight.T  # [b, s, V]
        out = numeric_loss(logits, labels, vocab, cfg, mask, document_starts=starts)
    elif path == "unfused":
        logits = (hidden_bs @ weight.T).transpose(0, 1)  # [s, b, V]
        head = NumericLossHead(vocab, cfg)
        out = head(labels, mask, group, logits=logits, document_starts=starts)
    else:
        fused = cfg.model_copy(update={"fused_output": True, "fused_chunk_tokens": 7})
        head = NumericLossHead(vocab, fused)
        hidden = hidden_bs.transpose(0, 1)  # [s, b, h]
        out = head(labels, mask, group, hidden=hidden, output_weight=weight, document_starts=starts)
    out.loss.backward()
    return out, hidden_bs.grad, weight.grad


def check_packed_equals_rows(case: Case, vocab, cfg, path, group, what=""):
    rows, rows_hidden_grad, rows_weight_grad = run(
        path, vocab, cfg, case.rows_labels, case.rows_mask, case.rows_hidden, case.weight, group
    )
    # the packed row read as one document joins the numbers where documents meet
    joined, _, _ = run(path, vocab, cfg, case.labels, case.mask, case.hidden, case.weight, group)
    assert abs(joined.numeric.item() - rows.numeric.item()) > 1e-3, f"{what}: not discriminating"

    packed, hidden_grad, weight_grad = run(
        path, vocab, cfg, case.labels, case.mask, case.hidden, case.weight, group, case.starts
    )
    for name in ("loss", "ce", "numeric"):
        assert_close(getattr(packed, name), getattr(rows, name), atol=ATOL, what=f"{what} {name}")
    assert packed.stats.keys() == rows.stats.keys()
    for key in rows.stats:
        assert_close(packed.stats[key], rows.stats[key], atol=ATOL, what=f"{what} stats {key}")
    per_token = from_rows(rows.per_token, case.lengths)
    assert_close(packed.per_token, per_token, atol=ATOL, what=f"{what} per_token")
    expected_hidden_grad = from_rows(rows_hidden_grad, case.lengths)
    assert_close(hidden_grad, expected_hidden_grad, atol=ATOL, what=f"{what} hidden grad")
    assert_close(weight_grad, rows_weight_grad, atol=ATOL, what=f"{what} weight grad")
    return packed


# ---- places ---------------------------------------------------------------------------


def classes_of(text: str) -> torch.Tensor:
    return torch.tensor([int(c) if c.isdigit() else POINT_CLASS if c == "." else -1 for c in text])


def test_digits_meeting_across_a_document_start_are_two_numbers():
    """ "x=12" + "34y": places 1, 0 and 1, 0 with the start; 3, 2, 1, 0 read as one row."""
    classes = classes_of("x=1234y")
    starts = torch.zeros(7, dtype=torch.bool)
    starts[[0, 4]] = True
    assert digit_places(classes)[0][2:6].tolist() == [3, 2, 1, 0]
    assert digit_places(classes, starts)[0][2:6].tolist() == [1, 0, 1, 0]
    # "3." + "5": an integer and an integer, not 3.5; "1.2" + "3": 1.2 and 3
    for text, cut, places in [("3.5", 2, [0, 0]), ("1.23", 3, [0, -1, 0])]:
        classes = classes_of(text)
        starts = torch.zeros(len(text), dtype=torch.bool)
        starts[[0, cut]] = True
        place, point = digit_places(classes, starts)
        assert place[(classes >= 0) & (classes <= 9)].tolist() == places, text
        assert point.nonzero().flatten().tolist() == ([1] if text == "1.23" else [])


def random_cuts(gen: torch.Generator, classes: torch.Tensor, count: int) -> list[int]:
    """Cut points in (0, T): where a digit or '.' meets a digit or '.' where there are such
    places, and one anywhere."""
    numeric = (classes >= 0) & (classes <= POINT_CLASS)
    meets = (numeric[1:] & numeric[:-1]).nonzero().flatten() + 1
    order = torch.randperm(len(meets), generator=gen)[:count]
    anywhere = int(torch.randint(1, classes.numel(), (1,), generator=gen))
    return sorted({*meets[order].tolist(), anywhere})


def pieces(cuts: list[int], total: int) -> list[int]:
    bounds = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("seed", range(12))
def test_places_of_a_packed_row_are_its_documents_places(seed):
    """Random rows of numbers ('.5', '3.14.15', second '.') cut into documents where digits
    and points meet: the packed row's places and decimal points are each document's own."""
    vocab = make_vocab()
    gen = torch.Generator().manual_seed(seed)
    labels = torch.tensor(number_sequence(gen, 64))
    classes = vocab.class_table(VOCAB_SIZE, torch.device("cpu"))[labels]
    lengths = pieces(random_cuts(gen, classes, 4), labels.numel())
    starts = starts_of(lengths)[0]
    place, point = digit_places(classes, starts)
    parts = [digit_places(part) for part in classes.split(lengths)]
    assert torch.equal(place, torch.cat([p for p, _ in parts]))
    assert torch.equal(point, torch.cat([q for _, q in parts]))
    # batched [b, s] with per-row starts gives the same rows
    batched, _ = digit_places(torch.stack([classes, classes]), torch.stack([starts, starts]))
    assert torch.equal(batched[1], place)


@pytest.mark.parametrize("seed", range(8))
def test_grouped_places_of_a_packed_row_are_its_documents_places(seed):
    vocab = make_grouped_vocab()
    gen = torch.Generator().manual_seed(100 + seed)
    labels = torch.tensor(grouped_sequence(gen, 48))
    count_table, _ = vocab.number_table(GROUPED_VOCAB_SIZE, torch.device("cpu"))
    count = count_table[labels]
    point = vocab.class_table(GROUPED_VOCAB_SIZE, torch.device("cpu"))[labels] == POINT_CLASS
    classes = torch.where(count > 0, 0, torch.where(point, POINT_CLASS, -1))
    lengths = pieces(random_cuts(gen, classes, 4), labels.numel())
    place, is_slot = grouped_places(classes, count, 3, starts_of(lengths)[0])
    parts = [
        grouped_places(c, n, 3)
        for c, n in zip(classes.split(lengths), count.split(lengths), strict=True)
    ]
    assert torch.equal(place, torch.cat([p for p, _ in parts]))
    assert torch.equal(is_slot, torch.cat([s for _, s in parts]))


# ---- the loss: a packed row equals its documents as rows --------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", DIGIT_CASES)
def test_a_packed_row_equals_its_documents_as_rows(group, name, path):
    vocab = make_vocab()
    case = Case(documents(seed=1), VOCAB_SIZE, seed=2)
    check_packed_equals_rows(case, vocab, DIGIT_CASES[name], path, group, f"{name}/{path}")


@pytest.mark.parametrize("path", PATHS)
def test_grouped_digits_packed_row_equals_its_documents_as_rows(group, path):
    vocab = make_grouped_vocab()
    case = Case(grouped_documents(seed=3), GROUPED_VOCAB_SIZE, seed=4)
    cfg = NumericLossConfig(kind="del")
    check_packed_equals_rows(case, vocab, cfg, path, group, f"grouped/{path}")


@pytest.mark.parametrize("path", ["unfused", "fused"])
def test_the_head_with_document_starts_equals_the_reference(group, path):
    """The head's ops and the single-device reference read the same starts (a packed batch of
    two rows, each with documents of its own)."""
    vocab = make_vocab()
    case = Case(documents(seed=5), VOCAB_SIZE, seed=6)
    labels, mask = case.labels.repeat(2, 1), case.mask.repeat(2, 1)
    hidden = torch.cat([case.hidden, case.hidden.flip(1)])
    starts = torch.cat([case.starts, starts_of([4, labels.shape[1] - 4])])
    cfg = DIGIT_CASES["del"]
    ref, ref_hidden_grad, ref_weight_grad = run(
        "reference", vocab, cfg, labels, mask, hidden, case.weight, group, starts
    )
    out, hidden_grad, weight_grad = run(
        path, vocab, cfg, labels, mask, hidden, case.weight, group, starts
    )
    assert_close(out.loss, ref.loss, atol=ATOL, what="loss")
    assert_close(out.per_token, ref.per_token, atol=ATOL, what="per_token")
    for key in ref.stats:
        assert_close(out.stats[key], ref.stats[key], atol=ATOL, what=f"stats {key}")
    assert_close(hidden_grad, ref_hidden_grad, atol=ATOL, what="hidden grad")
    assert_close(weight_grad, ref_weight_grad, atol=ATOL, what="weight grad")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["mle", "mixce", "emo"])
def test_kinds_without_a_digit_term_are_unchanged(group, kind, path):
    from del_megatron import emo_cost_embedding

    vocab = make_vocab()
    case = Case(documents(seed=7), VOCAB_SIZE, seed=8)
    cfg = NumericLossConfig(kind=kind)
    cost = emo_cost_embedding(case.weight)
    outputs = []
    for starts in (None, case.starts):
        weight = case.weight.clone().requires_grad_()
        logits = case.hidden @ weight.T
        if path == "reference":
            out = numeric_loss(
                logits,
                case.labels,
                vocab,
                cfg,
                case.mask,
                cost_embedding=cost,
                document_starts=starts,
            )
        else:
            update = {"fused_output": path == "fused"}
            head = NumericLossHead(vocab, cfg.model_copy(update=update), case.weight)
            inputs = (
                {"hidden": case.hidden.transpose(0, 1), "output_weight": weight}
                if path == "fused"
                else {"logits": logits.transpose(0, 1)}
            )
            out = head(case.labels, case.mask, group, document_starts=starts, **inputs)
        out.loss.backward()
        outputs.append((out.per_token.detach(), weight.grad))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])


@pytest.mark.parametrize("path", PATHS)
def test_starts_only_at_row_starts_are_todays_loss_bit_for_bit(group, path):
    """document_starts=None is today's loss; starts at the rows' first positions only (one
    document a row) give it bit for bit too."""
    vocab = make_vocab()
    case = Case(documents(seed=9), VOCAB_SIZE, seed=10)
    cfg = DIGIT_CASES["del-point-class"]
    rows_starts = torch.zeros_like(case.rows_labels, dtype=torch.bool)
    rows_starts[:, 0] = True
    args = (vocab, cfg, case.rows_labels, case.rows_mask, case.rows_hidden, case.weight, group)
    today, today_hidden, today_weight = run(path, *args)
    same, same_hidden, same_weight = run(path, *args, rows_starts)
    assert torch.equal(same.per_token, today.per_token)
    assert all(torch.equal(same.stats[k], today.stats[k]) for k in today.stats)
    assert torch.equal(same_hidden, today_hidden) and torch.equal(same_weight, today_weight)


def test_document_starts_of_the_wrong_shape_are_refused():
    vocab = make_vocab()
    labels = torch.tensor([[digit(1), digit(2)]])
    logits = torch.zeros(1, 2, VOCAB_SIZE)
    with pytest.raises(ValueError, match="document_starts must be a bool tensor"):
        numeric_loss(logits, labels, vocab, document_starts=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="document_starts must be a bool tensor"):
        numeric_loss(logits, labels, vocab, document_starts=torch.ones(1, 2))


# ---- document_starts_of: megatron's PackedSeqParams as the loops build them ---------------


def packed_params(cu, padded=None, **fields):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(cu, dtype=torch.int32)
    padded = None if padded is None else torch.tensor(padded, dtype=torch.int32)
    values = {
        "qkv_format": "thd",
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu,
        "cu_seqlens_q_padded": padded,
        "cu_seqlens_kv_padded": padded,
        **fields,
    }
    return PackedSeqParams(**values)


def positions(starts: torch.Tensor) -> list[int]:
    return starts[0].nonzero().flatten().tolist()


def test_document_starts_of_places_starts_at_the_labels():
    """Documents of 5 and 4 tokens and a tail of padding (row of 12): Megatron-LM's labels
    (the row shifted as a whole) start one position before each document's first token;
    Bridge's (each document shifted before packing) at it."""
    pytest.importorskip("megatron.core")
    labels = torch.zeros(1, 12, dtype=torch.long)
    params = packed_params([0, 5, 9])
    assert positions(document_starts_of(params, labels, shifted="row")) == [0, 4, 8]
    assert positions(document_starts_of(params, labels, shifted="document")) == [0, 5, 9]
    # the last offset at the row's end closes the last document: it starts nothing
    full = packed_params([0, 5, 12])
    assert positions(document_starts_of(full, labels, shifted="row")) == [0, 4]
    # padded to multiples of 4 (Bridge's pad_seq_to_mult, TE's cu_seqlens_q_padded): tokens
    # [0, 3) padding [3, 4), tokens [4, 8); the padding is a segment of its own
    padded = packed_params([0, 3, 7], padded=[0, 4, 8])
    row8 = labels[:, :8]
    assert positions(document_starts_of(padded, row8, shifted="document")) == [0, 3, 4]
    assert positions(document_starts_of(padded, row8, shifted="row")) == [0, 2, 3]
    # Bridge's [1, n] batch form and zero-length documents (its fixed-shape padding)
    batched = packed_params([[0, 5, 9, 12, 12]])
    assert positions(document_starts_of(batched, labels, shifted="document")) == [0, 5, 9]
    assert document_starts_of(None, labels, shifted="row") is None


def megatron_lm_row(docs: list[list[int]]):
    """Megatron-LM's GPTDataset with inter-document masking (and its SFTDataset): the packed
    row of s + 1 tokens shifted as a whole, tokens = row[:-1], labels = row[1:]; cu_seqlens
    over the s tokens, the extra token folded into the last document."""
    row = [t for d in docs for t in d]
    lengths = [len(d) for d in docs]
    lengths[-1] -= 1
    cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return torch.tensor([row[:-1]]), torch.tensor([row[1:]]), packed_params(cu)


def bridge_row(docs: list[list[int]]):
    """Megatron-Bridge's GPTSFTPackedDataset (and in-batch packing): each document shifted
    on its own, tokens = doc[:-1], labels = doc[1:], then packed; cu_seqlens over them."""
    tokens = [t for d in docs for t in d[:-1]]
    labels = [t for d in docs for t in d[1:]]
    cu = torch.tensor([0, *(len(d) - 1 for d in docs)]).cumsum(0).tolist()
    return torch.tensor([tokens]), torch.tensor([labels]), packed_params(cu)


@pytest.mark.parametrize("loop", ["megatron-lm", "bridge"])
def test_a_packed_batch_of_the_loops_equals_its_documents(group, loop):
    """Documents "w = 1 2" and "3 4 . 5 x", packed as each loop packs them: with
    document_starts_of the head gives what the documents' own label sequences give as rows
    (Megatron-LM: the second document's targets begin with its first token, predicted at the
    first document's last position; Bridge: each document's targets are its own)."""
    pytest.importorskip("megatron.core")
    vocab = make_vocab()
    word = OTHER_IDS
    first = [word[0], word[1], digit(1), digit(2)]
    second = [digit(3), digit(4), POINT_IDS[0], digit(5), word[2]]
    if loop == "megatron-lm":
        _, labels, params = megatron_lm_row([first, second])
        starts = document_starts_of(params, labels, shifted="row")
        lengths = [len(first) - 1, len(second)]
    else:
        _, labels, params = bridge_row([first, second])
        starts = document_starts_of(params, labels, shifted="document")
        lengths = [len(first) - 1, len(second) - 1]
    assert torch.equal(starts, starts_of(lengths))
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(1, labels.shape[1], HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB_SIZE, HIDDEN, generator=gen, dtype=torch.float64)
    mask = torch.ones(labels.shape, dtype=torch.float64)
    cfg = DIGIT_CASES["del"]
    packed, packed_grad, _ = run("unfused", vocab, cfg, labels, mask, hidden, weight, group, starts)
    rows, rows_grad, _ = run(
        "unfused",
        vocab,
        cfg,
        as_rows(labels, lengths, -100),
        as_rows(mask, lengths, 0.0),
        as_rows(hidden, lengths, 0.0),
        weight,
        group,
    )
    assert_close(packed.loss, rows.loss, atol=ATOL, what=f"{loop} loss")
    assert_close(packed_grad, from_rows(rows_grad, lengths), atol=ATOL, what=f"{loop} grad")


@pytest.mark.parametrize(
    "change, named",
    [
        ({"qkv_format": "sbhd"}, "qkv_format"),
        ({"cu_seqlens_kv": torch.tensor([0, 4, 12], dtype=torch.int32)}, "cu_seqlens_kv"),
        ({"cu_seqlens_kv": torch.tensor([0, 12], dtype=torch.int32)}, "cu_seqlens_kv"),
        ({"local_cp_size": 2}, "context parallelism"),
        ({"cu_seqlens_q": None, "cu_seqlens_kv": None}, "cu_seqlens_q"),
        ({"cu_seqlens_q_padded": torch.tensor([0, 12], dtype=torch.int32)}, "padded"),
    ],
)
def test_what_cannot_be_read_is_refused_in_one_line(change, named):
    pytest.importorskip("megatron.core")
    import dataclasses

    labels = torch.zeros(1, 12, dtype=torch.long)
    params = dataclasses.replace(packed_params([0, 5, 12]), **change)
    with pytest.raises(UserError, match=named) as refused:
        document_starts_of(params, labels, shifted="document")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "cu, labels_shape, named",
    [
        ([0, 5, 13], (1, 12), "cu_seqlens must grow"),  # past the row
        ([0, 7, 5], (1, 12), "cu_seqlens must grow"),  # not growing
        ([0, 5, 12], (2, 12), "micro-batch size 1"),
    ],
)
def test_offsets_that_do_not_fit_the_row_are_refused(cu, labels_shape, named):
    pytest.importorskip("megatron.core")
    with pytest.raises(UserError, match=named):
        document_starts_of(packed_params(cu), torch.zeros(labels_shape), shifted="row")


@pytest.mark.parametrize("path", ["unfused", "fused+promise"])
def test_document_starts_and_the_loss_make_no_host_synchronisation(group, path, monkeypatch):
    """From megatron's offsets (on the device, as both loops put them) to the loss and its
    backward, nothing waits for the device (tests/losses/test_no_host_sync.py's count)."""
    pytest.importorskip("megatron.core")
    from del_megatron.losses import fused as fused_op
    from del_megatron.losses import vocab_parallel
    from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss

    from ..distributed.residency import Residency

    vocab = make_vocab()
    case = Case(documents(seed=12), VOCAB_SIZE, seed=13)
    _, labels, params = bridge_row([[digit(1)] + d for d in documents(seed=12)])
    cfg = DIGIT_CASES["del"]

    def loss_and_backward():
        starts = document_starts_of(params, labels, shifted="document")
        hidden = case.hidden.transpose(0, 1).clone().requires_grad_()
        weight = case.weight.clone().requires_grad_()
        if path == "unfused":
            out = vocab_parallel.vocab_parallel_numeric_loss(
                hidden @ weight.T, labels, vocab, cfg, case.mask, group, document_starts=starts
            )
        else:
            out = vocab_parallel_fused_numeric_loss(
                hidden, weight, labels, vocab, cfg, case.mask, group, chunk_tokens=4,
                promise_scaled_loss=True, document_starts=starts,
            )  # fmt: skip
        (out.per_token * case.mask).sum().backward()

    loss_and_backward()  # the vocabulary's device tables made once
    residency = Residency()
    for function in (vocab_parallel._VocabParallelParts, fused_op._FusedParts):
        monkeypatch.setattr(function, "backward", residency.in_backward(function))
    with residency:
        loss_and_backward()
    assert residency.sync_places["setup"] == []
