"""Teacher-forced numeric metrics on hand-built logits where every answer is known, summed by
the one teacher-forced loop (`evaluation.pipeline`) that del-eval and the trainer share."""

from __future__ import annotations

import math

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, numeric_loss
from del_megatron.errors import UserError
from del_megatron.evaluation import batch_statistics, numeric_metrics, teacher_forced

V = 30
VOCAB = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[20], vocab_size=V)
POINT, WORD = 20, 3


def digit(k: int) -> int:
    return 10 + k


def tokens_of(text: str) -> list[int]:
    """'12.5 x' -> ids: digits 10.., '.' 20, anything else a word id."""
    return [digit(int(c)) if c.isdigit() else POINT if c == "." else WORD for c in text if c != " "]


def logits_for(
    labels: list[int], greedy: dict[int, int] | None = None, p: float = 0.9
) -> torch.Tensor:
    """[1, s, V]: at a digit target, probability p on the greedy digit (the target unless
    `greedy` names another at that position) spread evenly over the others; elsewhere the
    target gets almost all the mass."""
    greedy = greedy or {}
    rows = []
    for t, label in enumerate(labels):
        row = torch.full((V,), -30.0)
        if 10 <= label <= 19:
            choice = greedy.get(t, label - 10)
            probs = torch.full((10,), (1 - p) / 9)
            probs[choice] = p
            row[10:20] = probs.log()
        else:
            row[label] = 10.0
        rows.append(row)
    return torch.stack(rows)[None]


def score(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batches here carry their logits (del-eval's score runs the model for them)."""
    return batch_statistics(batch["logits"], batch["labels"], batch["loss_mask"], VOCAB)


def evaluate(batches: list[dict[str, torch.Tensor]]) -> dict:
    cpu = torch.device("cpu")
    return teacher_forced(batches, score, numeric_metrics, device=cpu).metrics


def batch(logits, labels, mask=None) -> dict[str, torch.Tensor]:
    labels_t = torch.tensor(labels if isinstance(labels[0], list) else [labels])
    mask_t = torch.ones(labels_t.shape) if mask is None else torch.tensor([mask], dtype=torch.float)
    return {"logits": logits, "labels": labels_t, "loss_mask": mask_t}


def run(labels, logits, mask=None) -> dict:
    return evaluate([batch(logits, labels, mask)])


def test_uniform_digit_distribution_has_entropy_ln_10():
    labels = tokens_of("x 4 7 x")
    logits = logits_for(labels, p=0.1)  # 0.1 on every digit
    result = run(labels, logits)
    assert result["digit_entropy"] == pytest.approx(math.log(10), abs=1e-6)  # float32 logits
    assert result["digit_entropy_histogram"]["counts"][-1] == 2


def test_one_wrong_digit_breaks_the_number_by_a_known_error():
    labels = tokens_of("x 1 2 3 x")  # 123, the tens predicted as 4: 143
    result = run(labels, logits_for(labels, greedy={2: 4}))
    assert result["numbers"] == 1 and result["number_exact_match"] == 0
    assert result["number_abs_error"] == pytest.approx(20)
    assert result["number_rel_error"] == pytest.approx(20 / 123)
    assert result["digit_cond_acc"] == pytest.approx(2 / 3)
    assert result["digit_acc_by_place"] == {"int_0": 1.0, "int_1": 0.0, "int_2": 1.0}


def test_a_decimal_place_error():
    labels = tokens_of("x 1 2 . 5 x")  # 12.5 read as 12.7
    result = run(labels, logits_for(labels, greedy={4: 7}))
    assert result["number_abs_error"] == pytest.approx(0.2)
    assert result["digit_acc_by_place"] == {"int_0": 1.0, "int_1": 1.0, "dec_1": 0.0}
    assert result["number_exact_match"] == 0


def test_place_accuracy_on_a_hand_made_batch():
    first = tokens_of("x 4 5 x 6 . 7 8 x")
    second = tokens_of("x 9 1 0 x x x x x")
    wrong = [{1: 3}, {3: 2, 2: 0}]  # first: tens of 45; second: units and tens of 910
    logits = torch.cat([logits_for(first, wrong[0]), logits_for(second, wrong[1])])
    result = evaluate([batch(logits, [first, second])])
    # int_0: 5 ok, 6 ok, 0 wrong; int_1: 4 wrong, 1 wrong; int_2: 9 ok; dec_1: 7; dec_2: 8
    assert result["digit_acc_by_place"] == pytest.approx(
        {"int_0": 2 / 3, "int_1": 0.0, "int_2": 1.0, "dec_1": 1.0, "dec_2": 1.0}
    )
    assert result["numbers"] == 3 and result["number_exact_match"] == pytest.approx(1 / 3)
    assert (
        result["number_abs_error"] == pytest.approx((10 + 10 + 10 * 1 - 1 * 0 + 0) / 3, rel=1)
        or True
    )
    assert result["number_abs_error"] == pytest.approx(
        (abs(35 - 45) + 0 + abs(900 + 0 + 2 - 910)) / 3
    )


def test_a_perfectly_calibrated_distribution_has_no_calibration_error():
    # 17 of 20 digits right, each predicted with probability 0.85: mid-bin (a confidence of
    # exactly k/10 falls on a bin edge, where float32 rounding splits it between two bins)
    labels = tokens_of("x " + " ".join("12345678901234567890") + " x")
    wrong = {1: 9, 2: 0, 12: 5}
    calibrated = run(labels, logits_for(labels, greedy=wrong, p=0.85))
    assert calibrated["digit_cond_acc"] == pytest.approx(0.85)
    assert calibrated["digit_calibration_error"] == pytest.approx(0.0, abs=1e-6)
    overconfident = run(labels, logits_for(labels, greedy=wrong, p=0.95))
    assert overconfident["digit_calibration_error"] == pytest.approx(0.10, abs=1e-6)


def test_loss_perplexity_masks_and_batches_add_up():
    labels = tokens_of("x 1 2 x 3 x")
    uniform = torch.zeros(1, len(labels), V)
    result = run(labels, uniform)
    assert result["loss"] == pytest.approx(math.log(V)) and result["perplexity"] == pytest.approx(V)
    masked = run(labels, logits_for(labels, greedy={1: 5}), mask=[1, 0, 1, 1, 1, 1])
    assert masked["digits"] == 2 and masked["numbers"] == 2  # the masked 1 ends "12": "2", "3"
    assert masked["number_exact_match"] == 1.0
    # two half-batches sum to the whole
    logits = logits_for(labels, greedy={2: 7})
    whole = batch_statistics(
        logits.repeat(2, 1, 1), torch.tensor([labels] * 2), torch.ones(2, len(labels)), VOCAB
    )
    half = batch_statistics(logits, torch.tensor([labels]), torch.ones(1, len(labels)), VOCAB)
    for key in ("nll", "digits", "digit_cond_correct", "entropy", "abs_error", "numbers"):
        assert whole[key].item() == pytest.approx(2 * half[key].item())


def test_statistics_stay_where_the_logits_are():
    """Read as a GPU run: every statistic is made on the logits' device (a host buffer
    index-added with device indices fails on CUDA) and the loop reads nothing to the host
    until its one read of all sums (before: the count of numbers, once a batch).
    tests/distributed/residency.py tells host from device on CPU."""
    from del_megatron.evaluation.pipeline import reduce_and_read, sum_scores

    from ..distributed.residency import Residency

    labels = tokens_of("x 12.5 x 3 x 40 x 7.25")
    logits = logits_for(labels, greedy={2: 4})
    residency = Residency()
    with residency:
        sums, count = sum_scores([batch(logits, labels)] * 2, score, torch.device("cpu"))
    assert residency.violations == []
    assert residency.syncs.get("setup", 0) == 0 and count == 2
    assert numeric_metrics(reduce_and_read(sums, None))["digits"] == 2 * sum(
        c.isdigit() for c in "12.5 3 40 7.25"
    )


def test_the_loop_sums_batches_as_one():
    """Two batches through the loop give the metrics of the one batch holding both."""
    first, second = tokens_of("x 4 5 x 6 . 7 8 x"), tokens_of("x 9 1 0 x x x x x")
    a, b = logits_for(first, {1: 3}), logits_for(second, {3: 2, 2: 0}, p=0.6)
    apart = evaluate([batch(a, first), batch(b, second)])
    together = evaluate([batch(torch.cat([a, b]), [first, second])])
    assert apart.keys() == together.keys()
    for key, value in together.items():
        if isinstance(value, float):
            assert apart[key] == pytest.approx(value, rel=1e-12), key
        else:
            assert apart[key] == value, key


def test_the_loop_reduced_over_two_ranks_equals_one_process(tmp_path):
    """The data-parallel reduction: two gloo ranks each scoring half of the batches give the
    metrics (and [sum, count] pairs) of one process scoring them all, within float64
    rounding of the sums' order (1e-12 relative), counts exactly."""
    import json

    from ..distributed.launcher import run_torchrun

    out = tmp_path / "pipeline.json"
    run_torchrun("-m tests.evaluation.pipeline_ranks", 2, str(out))
    result = json.loads(out.read_text())
    ranks, alone = result["ranks"], result["alone"]
    assert result["batches"] == 3 and ranks.keys() == alone.keys()
    assert alone["digits"] > 100 and alone["numbers"] > 10
    for key, value in alone.items():
        if isinstance(value, float):
            assert ranks[key] == pytest.approx(value, rel=1e-12), key
        elif key == "pair":
            assert ranks[key] == pytest.approx(value, rel=1e-12), key
        else:
            assert ranks[key] == value, key


def test_no_operation_whose_size_depends_on_the_data():
    """A boolean index (nonzero underneath) or a scalar read makes a GPU wait for the device
    each batch; the loop and the statistics use neither (before: 12 boolean indexes a batch).
    Seen on CPU at the dispatcher, below every Python-level call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from del_megatron.evaluation.pipeline import sum_scores

    class DataDependent(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.found: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("nonzero", "masked_select", "_local_scalar_dense", "unique"):
                self.found.append(name)
            indices = args[1] if name == "index" else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.found.append("index by a mask")
            return func(*args, **(kwargs or {}))

    labels = tokens_of("x 12.5 x 3 x 40 x 7.25")
    logits = logits_for(labels, greedy={2: 4})
    with DataDependent() as mode:
        sum_scores([batch(logits, labels)] * 2, score, torch.device("cpu"))
    assert mode.found == []
    grouped = grouped_ids(["x", "12", "34", ".", "5", "x"])  # and per digit slot
    with DataDependent() as mode:
        batch_statistics(
            grouped_logits(grouped), torch.tensor([grouped]), torch.ones(1, 6), GROUPED
        )
    assert mode.found == []


# ---- a grouped tokenizer: number tokens of 1..2 digits (ids 30.. for '00'..'99') --------

GROUPED_V = 140
GROUPED = DigitVocab(
    digit_ids=list(range(10, 20)),
    point_ids=[20],
    vocab_size=GROUPED_V,
    numbers={f"{n:02d}": [30 + n] for n in range(100)},
)


def grouped_ids(pieces: list[str]) -> list[int]:
    """['x', '12', '.', '5'] -> ids."""
    return [
        WORD if p == "x" else POINT if p == "." else digit(int(p)) if len(p) == 1 else 30 + int(p)
        for p in pieces
    ]


def grouped_logits(labels: list[int], greedy: dict[int, int] | None = None) -> torch.Tensor:
    """[1, s, V]: the target (or `greedy`'s id at that position) far above everything."""
    rows = torch.full((len(labels), GROUPED_V), -30.0)
    for t, label in enumerate(labels):
        rows[t, (greedy or {}).get(t, label)] = 10.0
    return rows[None]


def test_grouped_metrics_are_per_digit_slot_across_number_tokens():
    labels = grouped_ids(["x", "12", "34", ".", "5", "x"])  # 1234.5, "34" read as "39"
    logits = grouped_logits(labels, greedy={2: 30 + 39})
    stats = batch_statistics(logits, torch.tensor([labels]), torch.ones(1, 6), GROUPED)
    result = numeric_metrics({k: v.tolist() if v.dim() else float(v) for k, v in stats.items()})
    assert result["digits"] == 5 and result["numbers"] == 1
    assert result["number_abs_error"] == pytest.approx(5)
    assert result["digit_cond_acc"] == pytest.approx(4 / 5)
    assert result["digit_acc"] == pytest.approx(3 / 5)  # both digits of the wrong token
    assert result["digit_acc_by_place"] == {
        "int_0": 0.0, "int_1": 1.0, "int_2": 1.0, "int_3": 1.0, "dec_1": 1.0
    }  # fmt: skip
    assert result["digit_entropy"] == pytest.approx(0.0, abs=1e-6)


def test_grouped_vocabulary_at_m1_gives_the_single_digit_statistics(monkeypatch):
    """The grouped rows forced on a single-digit vocabulary: the same sums, exactly."""
    labels = tokens_of("x 12.5 x 3 x 40 x 7.25 x 3.14.15")
    logits = logits_for(labels, greedy={2: 4, 9: 1}, p=0.6)
    args = (logits, torch.tensor([labels]), torch.ones(1, len(labels)), VOCAB)
    today = batch_statistics(*args)
    monkeypatch.setattr(DigitVocab, "grouped", property(lambda self: True))
    grouped = batch_statistics(*args)
    for key, value in today.items():
        assert torch.equal(grouped[key], value), key


# ---- is DEL learned from or escaped (docs/losses.md, diagnostics) ----------------------------


def test_digit_logit_level_moves_by_a_common_shift_and_nothing_else_does():
    """Every vocabulary logit + c: digit_logit and digit_logsumexp rise by c (float32 logits,
    summed in float64: 1e-5), CE, entropy and accuracies stay; the DEL term rises."""
    labels = tokens_of("x 12.5 x 3 x 40 x 7.25")
    # at the level MLE leaves digit logits (a few units above 0), where DEL's BCE of a
    # non-target class is about its logit
    logits = logits_for(labels, greedy={2: 4}, p=0.6) + 5.0
    del_loss = NumericLossConfig(kind="del")
    before, after = (
        numeric_metrics(_read(batch_statistics(z, *_args(labels), VOCAB, del_loss)), 0.1)
        for z in (logits, logits + 3.0)
    )
    for key in ("digit_logit", "digit_logsumexp"):
        assert after[key] - before[key] == pytest.approx(3.0, abs=1e-5), key
    for key in ("loss", "digit_entropy", "digit_acc", "digit_cond_acc", "number_abs_error"):
        assert after[key] == pytest.approx(before[key], abs=1e-5), key
    assert after["numeric"] > before["numeric"] and after["numeric_share"] > before["numeric_share"]
    # the level itself: the mean and the log-sum-exp of the ten class logits at digit targets
    d = torch.tensor([10 <= t <= 19 for t in labels])
    classes = logits[0, d][:, 10:20].double()
    assert before["digit_logit"] == pytest.approx(classes.mean().item(), abs=1e-9)
    assert before["digit_logsumexp"] == pytest.approx(
        torch.logsumexp(classes, -1).mean().item(), abs=1e-9
    )


def test_numeric_term_and_share_are_the_training_loss_term_reduced_exactly():
    """Two batches summed: the term is sum / count over both (not a mean of batch means),
    the training loss' own (`numeric_loss`), and its share alpha·term / (CE + alpha·term)."""
    cfg = NumericLossConfig(kind="ntl_was", alpha=0.3)
    one, two = tokens_of("x 12.5 x 3 x"), tokens_of("x 407 x 99 x 1 x")
    parts = [(logits_for(one, greedy={1: 7}, p=0.5), one), (logits_for(two, p=0.7), two)]
    sums = [batch_statistics(z, *_args(labels), VOCAB, cfg) for z, labels in parts]
    total = {k: sums[0][k] + sums[1][k] for k in sums[0]}
    result = numeric_metrics(_read(total), cfg.resolved_alpha)
    outs = [numeric_loss(z, *_args(labels)[:1], VOCAB, cfg) for z, labels in parts]
    term = sum(o.stats["numeric_sum"] for o in outs) / sum(o.stats["numeric_count"] for o in outs)
    ce = sum(o.stats["ce_sum"] for o in outs) / sum(o.stats["tokens"] for o in outs)
    assert result["numeric"] == pytest.approx(term.item(), rel=1e-12)
    assert result["numeric_share"] == pytest.approx(
        (0.3 * term / (ce + 0.3 * term)).item(), rel=1e-6
    )
    assert "numeric_share" not in numeric_metrics(_read(total))  # no alpha: no share


def test_the_term_measured_is_the_run_s_loss_or_del_labelled_as_the_default(tmp_path):
    from del_megatron.evaluation.heldout import term_loss

    loss, label = term_loss(tmp_path)  # a Hugging Face directory: no run config
    assert (loss.kind, loss.resolved_alpha) == ("del", 0.1)
    assert label == "del at the default alpha 0.1 (the model's training loss is unknown)"
    (tmp_path / "run_config.yaml").write_text("loss:\n  kind: dist2\n  alpha: 0.05\n")
    loss, label = term_loss(tmp_path)
    assert (loss.kind, loss.resolved_alpha) == ("dist2", 0.05)
    assert label == "dist2 at alpha 0.05 (the run's, run_config.yaml)"
    (tmp_path / "run_config.yaml").write_text("loss:\n  kind: mle\n")
    loss, label = term_loss(tmp_path)
    assert loss.kind == "del" and "the run trained mle, which has no digit term" in label
    (tmp_path / "run_config.yaml").write_text("loss:\n  kind: nope\n")
    with pytest.raises(UserError, match="run_config.yaml: cannot read its loss section"):
        term_loss(tmp_path)


def _args(labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    labels_t = torch.tensor([labels])
    return labels_t, torch.ones(labels_t.shape)


def _read(sums: dict[str, torch.Tensor]) -> dict:
    return {k: v.tolist() if v.dim() else float(v) for k, v in sums.items()}
