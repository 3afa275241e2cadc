"""Answer extraction and checking with math-verify, on real GSM8K answers where present."""

from __future__ import annotations

import json

import pytest

from del_megatron.evaluation.generation import (
    Problem,
    answer_of,
    check,
    gold_of,
    load_problems,
    prompt_of,
)


@pytest.mark.parametrize(
    ("gold", "completion", "correct", "error"),
    [
        ("1000", "They have 1,000 in all.\n#### 1,000", True, 0.0),
        ("5", "It costs $5 each.\n#### $5", True, 0.0),
        ("5", "#### 5.00", True, 0.0),
        ("-3", "The temperature falls to -3.\n#### -3", True, 0.0),
        ("18", "16 - 3 - 4 = 9, 9 * 2 = 18 dollars.\n#### 18", True, 0.0),
        ("18", "#### 20", False, 2.0),
        ("0.5", "#### 1/2", True, 0.0),
        ("72", "Natalia sold 48 + 24 = 72 clips.", True, 0.0),  # no '####': the last number
        ("72", "I do not know.", False, None),
    ],
)
def test_answers_are_checked_by_value(gold, completion, correct, error):
    got, got_error = check(gold, completion)
    assert got is correct
    assert got_error == (pytest.approx(error) if error is not None else None)


def test_real_gsm8k_answers(gsm8k_train):
    problems = load_problems(gsm8k_train, limit=200)
    assert all(p.gold and "####" not in p.gold for p in problems)
    for problem in problems:  # the reference solution is right, a shifted answer is not
        assert check(problem.gold, problem.answer)[0], problem.answer
        assert not check(problem.gold, f"#### {float(problem.gold.replace(',', '')) + 1}")[0]
    with_thousands = [
        p for p in problems if "," in p.gold or float(p.gold.replace(",", "")) >= 1000
    ]
    assert with_thousands  # numbers like 1,000 are in there and pass above


def test_prompts_and_extraction(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"question": q, "answer": a})
            for q, a in [("1+1?", "1+1=2\n#### 2"), ("2+3?", "5")]
        )
    )
    shot, problem = load_problems(path)
    assert (shot.gold, problem.gold) == ("2", "5")
    prompt = prompt_of(problem, [shot], "Q: {question}\nA:")
    assert prompt == "Q: 1+1?\nA: 1+1=2\n#### 2\n\nQ: 2+3?\nA:"
    assert answer_of(" 2+3=5\n#### 5\n\nQ: next") == "5"
    assert answer_of(" 5\n\nQ: next") == "5"
    assert gold_of("text\n#### 1,234") == "1,234"
    assert Problem("q", "a", "a").gold == "a"
