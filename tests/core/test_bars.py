"""Text bars: whole cells or eighths, padded or not, never clamped behind the caller's back."""

from __future__ import annotations

import math

import pytest

from kvguard.core.bars import EIGHTHS, text_bar


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [
        (0.0, ".........."),
        (0.04, ".........."),
        (0.05, ".........."),  # round half to even: 0.5 cell -> 0
        (0.06, "#........."),
        (0.5, "#####....."),
        (0.99, "##########"),
        (1.0, "##########"),
    ],
)
def test_whole_cells_round_to_the_nearest_and_pad_to_width(fraction, expected):
    """The demo's status bar: "#" filled, "." padding, always ``width`` long in [0, 1]."""
    assert text_bar(fraction, 10, fill="#", empty=".") == expected


def test_whole_cells_default_to_an_unpadded_block_bar():
    """The daemon's status bar: full blocks, no padding (its f-string pads)."""
    assert text_bar(0.5, 30) == "█" * 15
    assert text_bar(0.0, 30) == ""
    assert text_bar(1.0, 30) == "█" * 30


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [
        (0.0, ""),
        (1 / 80, "▏"),  # one eighth of one cell of 10
        (0.5, "█████"),
        (0.55, "█████▌"),
        (0.1 + 7 / 80, "█▉"),
        (1.0, "█" * 10),
    ],
)
def test_eighths_draw_the_last_cell_partly(fraction, expected):
    """The budget table's bar: whole blocks, then one of seven partial blocks."""
    assert text_bar(fraction, 10, eighths=True) == expected


def test_eighths_pad_after_a_partial_cell():
    """With padding, a partial cell counts as one of the ``width`` cells."""
    assert text_bar(0.55, 10, empty=" ", eighths=True) == "█████▌    "
    assert text_bar(0.0, 4, empty="-", eighths=True) == "----"
    assert len(text_bar(0.123, 30, empty=" ", eighths=True)) == 30


def test_every_eighth_is_reachable():
    """Each partial block shows up for its own number of eighths."""
    drawn = {text_bar(n / 8, 1, eighths=True) for n in range(1, 8)}
    assert drawn == set(EIGHTHS[1:])


def test_out_of_range_fractions_are_not_clamped():
    """Above 1 the bar runs past ``width``; below 0 nothing is filled."""
    assert text_bar(1.5, 30) == "█" * 45
    assert text_bar(-0.5, 30) == ""
    assert text_bar(1.2, 10, fill="#", empty=".") == "#" * 12
    assert text_bar(-0.5, 10, eighths=True) == ""
    assert text_bar(1.5, 2, eighths=True) == "███"


def test_a_caller_clamps_to_keep_the_bar_within_width():
    """The documented clamp keeps any value, NaN included, inside the bar."""

    def clamped(fraction: float) -> str:
        return text_bar(max(0.0, min(fraction, 1.0)), 10, fill="#", empty=".")

    assert clamped(7.0) == "#" * 10
    assert clamped(-7.0) == "." * 10
    assert clamped(math.nan) == "." * 10


def test_nan_is_refused_unclamped():
    """NaN has no length."""
    with pytest.raises(ValueError, match="NaN"):
        text_bar(math.nan, 10)
