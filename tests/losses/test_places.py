"""Place values and weights: the spec's examples, edges, masks, and a loop scanner."""

from __future__ import annotations

import pytest
import torch

from del_megatron.losses import POINT_CLASS, digit_places, place_weights

from ..utils import assert_close
from .reference_loops import scan_places, weight

MASK = "#"  # a masked position in the strings below


def classes_of(text: str) -> torch.Tensor:
    """'12.5,x#3' -> classes: digits, '.' -> POINT_CLASS, '#' -> masked (-2), else -1."""

    def one(c):
        if c.isdigit():
            return int(c)
        return {".": POINT_CLASS, MASK: -2}.get(c, -1)

    return torch.tensor([one(c) for c in text])


# text -> places of its digits, left to right, and the indices of its decimal points
TABLE = {
    "123.45": ([2, 1, 0, -1, -2], [3]),
    ".5": ([-1], [0]),
    "x .25": ([-1, -2], [2]),
    "3.14.15": ([0, -1, -2, 1, 0], [1]),
    "1.2.3.4": ([0, -1, 0, -1], [1, 5]),
    "1,000": ([0, 2, 1, 0], []),
    "2026-11-29": ([3, 2, 1, 0, 1, 0, 1, 0], []),
    "costs 5.": ([0], []),
    "5.x": ([0], []),
    "12#34": ([1, 0, 1, 0], []),
    "1.#5": ([0, 0], []),
    "#.5": ([-1], [1]),
    "007": ([2, 1, 0], []),
    "..5": ([-1], [1]),
}


@pytest.mark.parametrize("text", TABLE)
def test_places_table(text):
    expected_places, expected_points = TABLE[text]
    classes = classes_of(text)
    place, point = digit_places(classes)
    is_digit = (classes >= 0) & (classes <= 9)
    assert place[is_digit].tolist() == expected_places
    assert point.nonzero().flatten().tolist() == expected_points


def test_numbers_never_span_sequences():
    batch = torch.stack([classes_of("ab12"), classes_of("34cd")])
    place, _ = digit_places(batch)
    assert place.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]  # "12" and "34", not "1234"


def test_spec_weight_examples():
    # "123" -> 6, 4, 2 and "12.34" -> 4, 2, ., 1.02**-2, 1.02**-3
    for text, expected in [("123", [6.0, 4.0, 2.0]), ("12.34", [4.0, 2.0, 1.02**-2, 1.02**-3])]:
        classes = classes_of(text)
        place, _ = digit_places(classes)
        is_digit = classes != POINT_CLASS
        u = place_weights(place, 2.0, 1.02, torch.float64)[is_digit]
        assert_close(u, torch.tensor(expected, dtype=torch.float64), atol=1e-15, what=text)


def test_random_sequences_match_a_left_to_right_scanner():
    gen = torch.Generator().manual_seed(0)
    # digits, '.', other, masked, with many dots so that chains like 1.2.3 occur
    choices = torch.tensor([0, 1, 2, 5, 9, POINT_CLASS, POINT_CLASS, -1, -2])
    classes = choices[torch.randint(len(choices), (64, 50), generator=gen)]
    place, point = digit_places(classes)
    weights = place_weights(place, 2.0, 1.02, torch.float64)
    for row in range(classes.shape[0]):
        kinds = [
            int(c) if 0 <= c <= 9 else ("." if c == POINT_CLASS else None) for c in classes[row]
        ]
        expected_places, expected_points = scan_places(kinds)
        for t, p in enumerate(expected_places):
            if p is not None:
                assert place[row, t] == p, (row, t)
                assert abs(weights[row, t].item() - weight(p, 2.0, 1.02)) < 1e-14
        assert point[row].tolist() == expected_points, row


def test_vectorized_no_python_loop_over_positions():
    """A long batch is processed as whole tensors: 8 x 32768 positions well under a second."""
    import time

    classes = torch.randint(-1, 11, (8, 32768))
    start = time.perf_counter()
    digit_places(classes)
    assert time.perf_counter() - start < 1.0
