"""The numeric task suite (data_tools/tasks.py): answers right, deterministic by seed,
held-out questions never in training, and the noisy task's stated distribution the one its
answers are drawn from."""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from decimal import Decimal

import pytest

from data_tools import tasks


def _value(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def expected_answer(task: str, question: str) -> str | None:
    """The answer recomputed from the question's text alone (None: the noisy task)."""
    numbers = re.findall(r"\d[\d,]*(?:\.\d+)?", question)
    if task in ("copy", "reformat"):
        return str(_value(numbers[0]))
    if task in ("add", "add_carries"):
        return str(int(numbers[0]) + int(numbers[1]))
    if task == "subtract":
        return str(int(numbers[0]) - int(numbers[1]))
    if task == "multiply":
        return str(int(numbers[0]) * int(numbers[1]))
    if task == "convert":
        source, target = re.search(r" (\w+) to (\w+)\.$", question).groups()
        factor = {(s, t): f for s, t, f in tasks.CONVERSIONS}[source, target]
        return f"{(Decimal(numbers[0]) * factor).normalize():f}"
    return None


@pytest.mark.parametrize("task", tasks.suite(), ids=lambda t: t.name)
def test_answers_are_right(task):
    rng = random.Random(7)
    for _ in range(300):
        problem = task.make(rng)
        expected = expected_answer(task.name, problem.question)
        if expected is None:  # noisy: a reading within the scale's error of the weight
            weight = int(re.search(r"a (\d+) g", problem.question).group(1))
            assert problem.gold in problem.distribution
            assert int(problem.gold) - weight in tasks.NOISE[problem.question[6]]
            continue
        assert problem.gold == expected, problem
        assert problem.answer.endswith(problem.gold)


def test_written_carries():
    assert tasks.column_sums(47, 85) == "7+5=12, 4+8+1=13, 1"
    assert tasks.column_sums(905, 7) == "5+7=12, 0+0+1=1, 9+0=9"
    problem = tasks.add_carries((3, 3))(random.Random(1))
    worked, gold = problem.answer.split(" #### ")
    assert gold == problem.gold
    # the last column's total (and a final carry) spell the leading digits of the sum
    assert gold.endswith(
        str(
            sum(
                int(c.split("=")[1]) % 10 * 10**i
                for i, c in enumerate(worked.split(", "))
                if "=" in c
            )
        )
    )


def test_noisy_distribution_matches_its_samples():
    """Readings of one weight drawn 30000 times: each reading's frequency within 4 standard
    errors of the probability the problem states, and nothing drawn outside it."""
    make = tasks.noisy((3, 3))
    rng = random.Random(3)
    draws: dict[str, list] = {}
    for _ in range(60000):
        problem = make(rng)
        draws.setdefault(problem.question.split(" weighs")[0], []).append(problem)
    for scale, problems in draws.items():
        counts = Counter(
            int(p.gold) - int(re.search(r"a (\d+) g", p.question).group(1)) for p in problems
        )
        n = len(problems)
        errors = tasks.NOISE[scale[-1]]
        assert set(counts) <= set(errors)
        for error, p in errors.items():
            assert abs(counts[error] / n - p) < 4 * math.sqrt(p * (1 - p) / n), (scale, error)
        # the stated distribution of one problem is the noise shifted to its weight
        one = problems[0]
        weight = int(re.search(r"a (\d+) g", one.question).group(1))
        assert one.distribution == {str(weight + e): p for e, p in errors.items()}


def test_digit_truth():
    # exact answers: no entropy, a perfect model is always right
    assert tasks.digit_truth("4.07", None) == ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    # 98, 99, 100, 101 with 1/4 each: the first digit is 9 or 1 (1/2 each); after "9" the
    # second is 8 or 9; after "10" the last is 0 or 1
    dist = {"98": 0.25, "99": 0.25, "100": 0.25, "101": 0.25}
    entropies, tops = tasks.digit_truth("100", dist)
    assert entropies == pytest.approx([math.log(2), 0.0, math.log(2)])
    assert tops == pytest.approx([0.5, 1.0, 0.5])
    entropies, _ = tasks.digit_truth("99", dist)
    assert entropies == pytest.approx([math.log(2), math.log(2)])


def _written(tmp_path, name, seed):
    out = tmp_path / name
    tasks.write_tasks(out, documents=300, heldout=40, seed=seed)
    return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_deterministic_by_seed_and_heldout_disjoint(tmp_path):
    first, again = _written(tmp_path, "a", 5), _written(tmp_path, "b", 5)
    assert first == again
    assert _written(tmp_path, "c", 6) != first
    meta = json.loads(first[tasks.Path("tasks.json")])
    assert [t["name"] for t in meta["tasks"]] == list(tasks.MAKERS)
    held = set()
    for entry in meta["tasks"]:
        records = [json.loads(line) for line in first[tasks.Path(entry["heldout"])].splitlines()]
        questions = {r["question"] for r in records}
        assert len(questions) == len(records) == 40
        held |= questions
        for r in records:
            assert r["text"] == f"{r['question']}\nAnswer: {r['answer']}"
            assert len(r["digit_entropy"]) == sum(c.isdigit() for c in r["gold"])
    trained = {
        line.split("\nAnswer:")[0].split("\n")[-1]
        for doc in first[tasks.Path("train.jsonl")].decode().splitlines()
        for line in json.loads(doc)["text"].split("\n\n")
    }
    assert len(trained) > 500
    assert not trained & held


def test_heldout_refused_when_too_few_questions():
    with pytest.raises(ValueError, match="distinct questions"):
        tasks.heldout_problems(tasks.Task("copy", "easy", tasks.copy((1, 1))), 11, 0)
