"""A deterministic math-heavy corpus: arithmetic with exact answers, word problems with
quantities and prices, units and percentages, tables of numbers, and plain prose.

Every problem has an exact answer (decimal arithmetic, no floating point); the held-out
split keeps question and answer apart for evaluation. Same seed, same corpus, byte for byte.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

NAMES = [
    "Ada",
    "Bram",
    "Chen",
    "Dana",
    "Emil",
    "Farah",
    "Goran",
    "Hana",
    "Ivo",
    "Jia",
    "Kofi",
    "Lena",
    "Mateo",
    "Nia",
    "Omar",
    "Priya",
]
ITEMS = [
    ("notebook", "notebooks"),
    ("pencil", "pencils"),
    ("apple", "apples"),
    ("ticket", "tickets"),
    ("book", "books"),
    ("lamp", "lamps"),
    ("cup", "cups"),
    ("bag of rice", "bags of rice"),
    ("bottle of milk", "bottles of milk"),
]
UNITS = [
    ("liters", "tank"),
    ("kilograms", "sack"),
    ("meters", "roll of cable"),
    ("gigabytes", "disk"),
]
PROSE = (
    "The committee met in the old library to discuss the plans for the spring fair. "
    "Rain had fallen all night and the river ran high under the stone bridge. "
    "She wrote carefully, checking every line before she turned the page. "
    "Nobody expected the small shop on the corner to become the busiest in town. "
    "The results were recorded in a notebook that was later lost and found again. "
    "A good estimate is worth more than a precise answer to the wrong question. "
    "They walked along the shore, talking about the years that had passed. "
    "Every measurement carries an error, and a careful student writes it down."
).split(". ")


def _money(value: Decimal) -> str:
    return f"{value.quantize(Decimal('0.01'))}"


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def _decimal(rng: random.Random, whole_digits: int, places: int) -> Decimal:
    return Decimal(_number(rng, whole_digits)) + Decimal(rng.randint(0, 10**places - 1)) / (
        10**places
    )


def arithmetic(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice("+-*/d")
    if kind == "d":  # decimals
        a, b = _decimal(rng, rng.randint(1, 3), 2), _decimal(rng, rng.randint(1, 2), 1)
        op = rng.choice("+-*")
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"Compute {a} {op} {b}.", f"{result.normalize():f}"
    a, b = _number(rng, rng.randint(1, 5)), _number(rng, rng.randint(1, 4))
    if kind == "/":
        b = max(b, 1)
        return f"Compute {a * b} / {b}.", str(a)
    result = {"+": a + b, "-": a - b, "*": a * b}[kind]
    return f"Compute {a} {kind} {b}.", str(result)


def word_problem(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(NAMES)
    (_, many), count = rng.choice(ITEMS), rng.randint(2, 24)
    price = _decimal(rng, rng.randint(1, 2), 2)
    extra = _decimal(rng, 1, 2)
    total = count * price + extra
    question = (
        f"{name} buys {count} {many} at ${_money(price)} each and pays ${_money(extra)} "
        f"for delivery. "
        f"How much does {name} pay in total?"
    )
    return question, _money(total)


def percentage(rng: random.Random) -> tuple[str, str]:
    unit, container = rng.choice(UNITS)
    capacity = rng.randint(2, 400) * 5
    percent = rng.choice([5, 10, 12.5, 15, 20, 25, 30, 35, 40, 60, 75, 80])
    used = Decimal(capacity) * Decimal(str(percent)) / 100
    question = (
        f"A {container} holds {capacity} {unit}. After {percent}% of it is used, "
        f"how many {unit} remain?"
    )
    return question, f"{(Decimal(capacity) - used).normalize():f}"


def table(rng: random.Random) -> tuple[str, str]:
    rows = rng.sample(ITEMS, rng.randint(2, 4))
    lines = ["| item | quantity | unit price |", "|---|---|---|"]
    total = Decimal(0)
    for (one, _), qty in zip(rows, [rng.randint(1, 30) for _ in rows], strict=True):
        price = _decimal(rng, 1, 2)
        lines.append(f"| {one} | {qty} | {_money(price)} |")
        total += qty * price
    return "\n".join(lines) + "\nWhat is the total cost of the order?", _money(total)


def prose(rng: random.Random) -> str:
    return ". ".join(rng.sample(PROSE, rng.randint(2, 4))).rstrip(".") + "."


PROBLEMS: list[Callable[[random.Random], tuple[str, str]]] = [
    arithmetic,
    word_problem,
    percentage,
    table,
]


def problem(rng: random.Random) -> tuple[str, str]:
    return rng.choice(PROBLEMS)(rng)


def document(rng: random.Random) -> str:
    """A training document: prose mixed with worked problems."""
    parts = []
    for _ in range(rng.randint(2, 6)):
        if rng.random() < 0.3:
            parts.append(prose(rng))
        else:
            question, answer = problem(rng)
            parts.append(f"{question}\nAnswer: {answer}")
    return "\n\n".join(parts)


def write_corpus(out_dir: Path, *, documents: int, heldout: int, seed: int) -> tuple[Path, Path]:
    """train.jsonl ({"text"}) and heldout.jsonl ({"question", "answer", "text"})."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    train, held = out_dir / "train.jsonl", out_dir / "heldout.jsonl"
    with open(train.with_suffix(".tmp"), "w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": document(rng)}) + "\n")
    held_rng = random.Random(seed + 1_000_003)  # disjoint stream: held-out questions are new
    with open(held.with_suffix(".tmp"), "w") as f:
        for _ in range(heldout):
            question, answer = problem(held_rng)
            f.write(
                json.dumps(
                    {
                        "question": question,
                        "answer": answer,
                        "text": f"{question}\nAnswer: {answer}",
                    }
                )
                + "\n"
            )
    train.with_suffix(".tmp").replace(train)
    held.with_suffix(".tmp").replace(held)
    return train, held
