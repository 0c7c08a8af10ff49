"""How the results write numbers (ram_trl/recipes/results_format.py): golden strings, edge cases included."""

from __future__ import annotations

import math

from ram_trl.recipes.results_format import ci, fmt3, fmt_rho, pct, pct_ci, value_range


def test_scores_and_intervals():
    assert fmt3(None) == "-" and fmt3(0.12345) == "0.123" and fmt3(1) == "1.000"
    assert ci(None, [0, 1]) == "-"
    assert ci(0.5, None) == "0.500" and ci(0.5, []) == "0.500"
    assert ci(0.5, [0.25, 0.75]) == "0.500 [0.250, 0.750]"
    assert ci(2 / 3, (0.5, 1), ".2f") == "0.67 [0.50, 1.00]"


def test_percentages_and_rho():
    assert pct(None) == "-" and pct(0.1234) == "12.3%"
    assert pct_ci(None, [0, 1]) == "undefined"
    assert pct_ci(7 / 12, None) == "58%"
    assert pct_ci(0.5, [0.404, 0.596]) == "50% [40%, 60%]"
    assert fmt_rho(None) == "-" and fmt_rho("inf") == "inf" and fmt_rho(math.inf) == "inf"
    assert fmt_rho(11.14) == "11.1" and fmt_rho(0.0004567) == "0.000457"


def test_value_range():
    assert value_range([]) is None and value_range([None, math.inf]) is None
    assert value_range([0.62, 0.71, None], 100, ".0f", "%") == "62-71%"
    assert value_range([0.621, 0.624], 100, ".0f", "%") == "62%"  # both ends print the same
    assert value_range([3.0, math.inf, 40.7], 1, ".3g") == "3-40.7"
