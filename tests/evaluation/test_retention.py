"""ram_trl/evaluation/retention.py: retention and its mean over the verticals (hand-computed)."""

from __future__ import annotations

import pytest

from ram_trl.evaluation.retention import mean_retention, retention


def test_retention_golden_and_undefined_cases():
    assert retention(0.5, 0.2, 0.6) == pytest.approx(0.75)  # (0.5 - 0.2) / (0.6 - 0.2)
    assert retention(0.1, 0.2, 0.6) == pytest.approx(-0.25)  # below the base
    assert retention(0.8, 0.2, 0.6) == pytest.approx(1.5)  # beats the specialist
    assert retention(0.5, 0.2, 0.21) is None  # gain 0.01 < MIN_GAIN 0.02
    assert retention(0.5, 0.2, 0.21, min_gain=0.01) == pytest.approx(30.0)
    assert retention(0.5, 0.2, 0.2, min_gain=0.0) is None  # no gain: never inf
    assert retention(0.5, 0.3, 0.2, min_gain=0.0) is None  # the specialist lost
    assert retention(0.5, 0.2, float("nan")) is None


def test_mean_retention_over_defined_verticals():
    assert mean_retention({"a": 0.75, "b": None, "c": 1.25}) == pytest.approx(1.0)
    assert mean_retention([0.5, 0.25]) == pytest.approx(0.375)
    assert mean_retention({"a": None}) is None
    assert mean_retention([]) is None
