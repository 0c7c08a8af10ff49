"""Golden tests of the results statistics: t and bootstrap intervals, selection (hand-computed); retention is tested in
tests/evaluation/test_retention.py, and re-exported here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ram_trl.recipes import stats


def test_t_interval_golden():
    # mean 2, sd 1, t(0.975, 2) = 4.302653: 2 +/- 4.302653 / sqrt(3) = 2 +/- 2.484138
    mean, low, high = stats.t_interval([1.0, 2.0, 3.0])
    assert (mean, low, high) == pytest.approx((2.0, -0.484138, 4.484138), abs=1e-6)
    # mean 0.5, sd 0.1, t(0.975, 3) = 3.182446: 0.5 +/- 3.182446 * 0.1 / 2
    mean, low, high = stats.t_interval([0.4, 0.5, 0.6, 0.5 + 0.0])
    sd = math.sqrt((0.01 + 0 + 0.01 + 0) / 3)
    assert (low, high) == pytest.approx((0.5 - 3.182446 * sd / 2, 0.5 + 3.182446 * sd / 2))
    assert stats.t_interval([0.25]) == (0.25, None, None)
    assert stats.t_quantile(1) == 12.706205
    assert stats.t_quantile(40) == pytest.approx(2.021075, abs=1e-5)
    assert stats.t_quantile(100) == pytest.approx(1.983972, abs=1e-5)
    with pytest.raises(ValueError):
        stats.t_quantile(0)


def test_percentile_interval_and_bootstrap_means_golden():
    assert stats.percentile_interval(np.arange(101.0)) == pytest.approx((2.5, 97.5))
    assert stats.percentile_interval([0.0, 1.0], level=0.5) == pytest.approx((0.25, 0.75))
    indices = np.array([[0, 0, 0, 0], [1, 2, 1, 2], [0, 1, 2, 3]])
    assert stats.bootstrap_means([0.0, 1.0, 1.0, 0.0], indices).tolist() == [0.0, 1.0, 0.5]


def test_resample_indices_are_seeded():
    first = stats.resample_indices(5, 50, seed=3, stream=7)
    assert first.shape == (50, 5) and first.min() >= 0 and first.max() <= 4
    assert np.array_equal(first, stats.resample_indices(5, 50, seed=3, stream=7))
    assert not np.array_equal(first, stats.resample_indices(5, 50, seed=4, stream=7))


def test_bootstrap_scores_pairs_models_and_resamples_stages_independently():
    rewards = {
        "constant": {"a": [1.0] * 6, "b": [0.0] * 6},
        "x": {"a": [0.0, 1.0, 0.0, 1.0, 1.0, 0.0], "b": [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]},
        "y": {"a": [0.0, 1.0, 0.0, 1.0, 1.0, 0.0], "b": [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]},
        "a-only": {"a": [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]},
    }
    means = stats.bootstrap_scores(rewards, ["a", "b"], resamples=300, seed=0)
    # constant rewards: every resample gives the same mean; the average of 1 and 0 is exactly 0.5 throughout
    assert set(means["constant"]["a"]) == {1.0} and set(means["constant"]["average"]) == {0.5}
    assert stats.percentile_interval(means["constant"]["average"]) == (0.5, 0.5)
    # paired: the same prompts resampled for every model
    assert np.array_equal(means["x"]["average"], means["y"]["average"])
    assert np.array_equal(means["x"]["a"], means["a-only"]["a"])
    assert np.array_equal(means["a-only"]["average"], means["a-only"]["a"])
    # a and b use different resamples (same rewards, different streams)
    same = {"m": {"a": rewards["x"]["a"], "b": rewards["x"]["a"]}}
    resampled = stats.bootstrap_scores(same, ["a", "b"], resamples=300)["m"]
    assert not np.array_equal(resampled["a"], resampled["b"])
    # each stage's resamples do not depend on the other stages scored
    alone = stats.bootstrap_scores({"x": {"b": rewards["x"]["b"]}}, ["b"], resamples=300)["x"]["b"]
    assert np.array_equal(alone, means["x"]["b"])
    # the interval covers the observed mean and stays in [0, 1]
    low, high = stats.percentile_interval(means["x"]["a"])
    assert 0.0 <= low < 0.5 < high <= 1.0
    with pytest.raises(ValueError, match="different numbers of prompts"):
        stats.bootstrap_scores({"p": {"a": [1.0]}, "q": {"a": [1.0, 0.0]}}, ["a"])


def test_retention_samples_and_interval_of():
    merge = {"a": np.array([0.5, 0.4, 0.3]), "b": np.array([0.6, 0.6, 0.6])}
    base = {"a": np.array([0.2, 0.2, 0.2]), "b": np.array([0.2, 0.2, 0.2])}
    experts = {"a": {"a": np.array([0.6, 0.2, 0.4])}, "b": {"b": np.array([1.0, 1.0, 0.6])}}
    draws = stats.retention_samples(merge, base, experts, ["a", "b"])
    # resample 0: (0.75 + 0.5) / 2; resample 1: a's specialist did not gain -> NaN; resample 2: (0.5 + 1) / 2
    assert draws[0] == pytest.approx(0.625) and math.isnan(draws[1]) and draws[2] == pytest.approx(0.75)
    assert stats.interval_of(draws, "bootstrap") is None  # a third of the resamples undefined: not resolved
    assert stats.interval_of(draws, "seeds") is None
    assert stats.interval_of(np.array([0.625, 0.75]), "bootstrap", level=0.5) == pytest.approx((0.65625, 0.71875))
    low, high = stats.interval_of(np.array([1.0, 2.0, 3.0]), "seeds")
    assert (low, high) == pytest.approx((-0.484138, 4.484138), abs=1e-6)
    assert stats.interval_of(np.array([1.0]), "seeds") is None
    with pytest.raises(ValueError):
        stats.interval_of(draws, "jackknife")


def test_select_best_skips_missing_and_keeps_the_first_of_ties():
    assert stats.select_best({"a": 0.5, "b": None, "c": 0.7, "d": 0.7}) == "c"
    assert stats.select_best({"a": float("nan"), "b": 0.1}) == "b"
    assert stats.select_best({"a": None}) is None
    assert stats.select_best({}) is None
