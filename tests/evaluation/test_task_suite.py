"""Per-task evaluation (evaluation/task_suite.py): the loss mask covers exactly the gold
answer, and the metrics of models whose answers are known (an oracle, a uniform model)."""

from __future__ import annotations

import math

import pytest
import torch

from data_tools.tasks import write_tasks
from del_megatron.errors import UserError
from del_megatron.evaluation.backends import Loaded
from del_megatron.evaluation.task_suite import (
    _problem,
    answer_batches,
    answer_example,
    answer_metrics,
    load_suite,
)
from del_megatron.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks")
    write_tasks(out, documents=20, heldout=12, seed=3)
    return load_suite(out)


@pytest.fixture(scope="module")
def tokenizer(spm_split_digits):
    return Tokenizer(spm_split_digits)  # trained on other text: the answer found anyway


@pytest.mark.parametrize("shots", [0, 2])
def test_the_mask_is_the_gold_answer(suite, tokenizer, shots):
    for task in suite:
        shot_problems = [_problem(r) for r in task.records[:shots]]
        records = task.records[shots:]
        batches = answer_batches(tokenizer, records, shot_problems, "{question}\nAnswer:", 5)
        rows = [
            (labels[mask.bool()].tolist(), labels.tolist(), tokens.tolist())
            for batch in batches
            for tokens, labels, mask in zip(
                batch["tokens"], batch["labels"], batch["loss_mask"], strict=True
            )
        ]
        assert len(rows) == len(records)
        for (answer_ids, labels, tokens), record in zip(rows, records, strict=True):
            assert tokenizer.decode(answer_ids).strip() == record["gold"], task.name
            ids, _ = answer_example(tokenizer, record, shot_problems, "{question}\nAnswer:")
            n = len(ids) - 1  # the rest of the row is padding
            assert tokens[:n] == ids[:-1] and labels[:n] == ids[1:]


def _oracle(examples: dict[tuple, list[int]], vocab: int):
    """A model that puts its mass on the next token of the example it reads."""

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, vocab)
        for row, ids in enumerate(tokens.tolist()):
            nexts = examples[tuple(ids)]
            logits[row, torch.arange(len(nexts)), torch.tensor(nexts)] = 30.0
        return logits

    return forward


def test_metrics_of_an_oracle_and_of_a_uniform_model(suite, tokenizer):
    noisy = next(t for t in suite if t.name == "noisy")
    batches = answer_batches(tokenizer, noisy.records, [], "{question}\nAnswer:", 4)
    examples = {
        tuple(tokens.tolist()): labels.tolist()
        for batch in batches
        for tokens, labels in zip(batch["tokens"], batch["labels"], strict=True)
    }
    vocab = tokenizer.vocab_size
    oracle = Loaded("hf", noisy.path, tokenizer, _oracle(examples, vocab), torch.device("cpu"))
    metrics = answer_metrics(oracle, noisy, shots=0, batch_size=4)
    assert metrics["digit_acc"] == 1.0 and metrics["number_exact_match"] == 1.0
    assert metrics["digit_entropy"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["digit_calibration_error"] == pytest.approx(0.0, abs=1e-6)
    # the noisy task's truth: some digits are drawn, so its entropy is above 0, and no model
    # can be sure of them (the oracle reads the sample; a real model cannot)
    assert metrics["true_digit_entropy"] > 0.1 and metrics["best_digit_acc"] < 0.95
    assert metrics["digits"] == sum(len(r["digit_entropy"]) for r in noisy.records)

    def uniform(tokens):
        return torch.zeros(*tokens.shape, vocab)

    flat = Loaded("hf", noisy.path, tokenizer, uniform, torch.device("cpu"))
    metrics = answer_metrics(flat, noisy, shots=0, batch_size=4)
    assert metrics["digit_entropy"] == pytest.approx(math.log(10))
    assert metrics["loss"] == pytest.approx(math.log(vocab), rel=1e-5)


def test_a_broken_suite_is_named(tmp_path):
    write_tasks(tmp_path, documents=5, heldout=3, seed=0)
    with pytest.raises(UserError, match="no task 'divide'"):
        load_suite(tmp_path, ["copy", "divide"])
    path = tmp_path / "heldout" / "add.jsonl"
    path.write_text(path.read_text() + '{"question": "x"}\n')
    with pytest.raises(UserError, match="add.jsonl line 4"):
        load_suite(tmp_path)
