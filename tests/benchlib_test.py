"""Tests of tools.benchlib's pure helpers: interleaved rounds and the median and range."""

from __future__ import annotations

import pytest

from tools import benchlib


def test_interleaved_takes_each_measure_once_per_round_in_turn():
    calls = []

    def measure(name):
        def take():
            calls.append(name)
            return f"{name}{sum(c == name for c in calls)}"

        return take

    values = benchlib.interleaved({n: measure(n) for n in "ABC"}, rounds=3)
    assert calls == list("ABCABCABC")
    assert values == {"A": ["A1", "A2", "A3"], "B": ["B1", "B2", "B3"], "C": ["C1", "C2", "C3"]}
    assert benchlib.interleaved({"A": measure("A")}, rounds=0) == {"A": []}


def test_spread_is_the_median_and_the_range():
    assert benchlib.spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert benchlib.spread([4.0, 1.0, 2.0, 10.0]) == (3.0, 1.0, 10.0)  # Even: mean of the middle.
    assert benchlib.spread([5.0]) == (5.0, 5.0, 5.0)
    s = benchlib.spread([8_100.4, 7_900.0, 8_038.0])
    assert (s.median, s.low, s.high) == (8_038.0, 7_900.0, 8_100.4)
    assert s.text() == "8,038 (7,900-8,100)"
    assert s.range_text() == "7,900-8,100"
    assert benchlib.Spread(0.4, 0.39, 0.414).text(".2f") == "0.40 (0.39-0.41)"
    with pytest.raises(ValueError, match="no values"):
        benchlib.spread([])
