"""Golden values for the magnitude statistics: exact metrics, histogram estimates within their bounds, streaming."""

from __future__ import annotations

import math

import pytest
import torch

from ram_trl.statistics.counting import active_mask
from ram_trl.statistics.magnitude import (
    MagnitudeStatistics,
    excess_kurtosis,
    histogram_gini,
    histogram_top_mass,
    magnitude_bin_edges,
)
from tests.helpers import magnitude_bin, magnitude_of
from tests.reference import gini_coefficient, top_mass_share

F = torch.float32
D = 2.0**-7  # the default relative bin width
FOURTH_POWER_BOUND = 1.5 * D**2 + 4 * D**3 + D**4  # relative error of the estimated sum of tau**4
THIRD_POWER_BOUND = 0.75 * D**2 + D**3  # error of the estimated sum of tau**3, relative to sum |tau|**3


# ---------------------------------------------------------------------------------------------------------------
# Exact magnitude metrics


def test_gini_golden_values():
    assert gini_coefficient(torch.full((10,), 3.0)) == 0.0
    for n in (2, 10, 1000):
        one_hot = torch.zeros(n)
        one_hot[n // 2] = -5.0
        assert gini_coefficient(one_hot) == pytest.approx(1 - 1 / n)
    # sorted 1, 2, 3, 4: sum (2i - 5) x_i = -3 - 2 + 3 + 12 = 10; G = 10 / (4 * 10)
    assert gini_coefficient(torch.tensor([4.0, -1.0, 3.0, 2.0])) == pytest.approx(0.25)
    assert math.isnan(gini_coefficient(torch.zeros(3)))


def test_top_mass_golden_values():
    values = torch.arange(1, 101, dtype=F)  # sum 5050
    assert top_mass_share(values, 0.01) == pytest.approx(100 / 5050)
    assert top_mass_share(-values, 0.05) == pytest.approx((100 + 99 + 98 + 97 + 96) / 5050)
    # k = max(1, floor(0.01 * 20)) = 1
    assert top_mass_share(torch.tensor([1.0] * 19 + [21.0]), 0.01) == pytest.approx(21 / 40)
    assert math.isnan(top_mass_share(torch.zeros(0), 0.01))


def test_excess_kurtosis_golden_values():
    def from_values(x: torch.Tensor) -> float:
        x = x.to(torch.float64)
        return excess_kurtosis(x.numel(), [float((x**p).sum()) for p in range(1, 5)])

    assert from_values(torch.tensor([1.0, -1.0] * 50)) == pytest.approx(-2.0)
    # mean 0.3125; deviations +-0.1875, +-0.0625: m2 = 0.01953125, m4 = 0.0006256103515625, m4 / m2**2 = 1.64
    assert from_values(torch.tensor([0.5, 0.25, 0.375, 0.125])) == pytest.approx(-1.36)
    g = torch.Generator().manual_seed(0)
    u = torch.rand(1_000_000, generator=g, dtype=torch.float64) - 0.5
    laplace = -torch.sign(u) * torch.log1p(-2 * u.abs())  # inverse CDF of Laplace(0, 1)
    normal = torch.randn(1_000_000, generator=g, dtype=torch.float64)
    assert from_values(laplace) == pytest.approx(3.0, abs=0.2)
    assert from_values(normal) == pytest.approx(0.0, abs=0.05)
    assert math.isnan(excess_kurtosis(0, [0, 0, 0, 0]))
    assert math.isnan(from_values(torch.full((5,), 2.0)))


# ---------------------------------------------------------------------------------------------------------------
# Histogram estimates and their error bounds


def test_bins_are_ordered_and_relative_width_bounded():
    values = torch.tensor([1.0, 1.0 + 2**-7 - 2**-20, 1.0 + 2**-7, -1.5, 2.0**-126, 3e38], dtype=F)
    bins = magnitude_bin(values)
    assert bins[0] == bins[1] and bins[2] == bins[0] + 1
    assert bins[3] == magnitude_bin(torch.tensor([1.5]))[0]
    edges = magnitude_bin_edges(int(bins[0]), int(bins[0]) + 2)
    assert edges.tolist() == [1.0, 1.0 + 2**-7, 1.0 + 2**-6]
    normal_bins = torch.arange(2**7, 254 * 2**7)
    lo = magnitude_bin_edges(int(normal_bins[0]), int(normal_bins[-1]) + 1)
    assert float((lo[1:] / lo[:-1]).max()) <= 1 + 2**-7


def _lognormal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 2.0 - 9.0).exp() * torch.where(torch.rand(n, generator=g) < 0.5, -1, 1)


def _histogram(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    stats = MagnitudeStatistics.zeros(1)
    stats.update(values.reshape(1, -1), torch.ones(1, values.numel(), dtype=torch.bool))
    return stats.counts[0], stats.sums[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_histogram_estimates_within_documented_bounds(seed):
    values = _lognormal(50_000, seed)
    counts, sums = _histogram(values)
    d = 2.0**-7
    exact = gini_coefficient(values)
    estimate = histogram_gini(counts, sums)
    assert 0.0 <= exact - estimate <= d / 4
    masked = torch.cat([values, torch.zeros(150_000)])
    assert 0.0 <= gini_coefficient(masked) - histogram_gini(counts, sums, zeros=150_000) <= d / 4
    for fraction in (0.01, 0.05, 0.5):
        exact_top = top_mass_share(values, fraction)
        assert abs(histogram_top_mass(counts, sums, fraction) - exact_top) <= d * exact_top


def test_histogram_bounds_are_nearly_attained():
    # Half of the values at the bottom of one bin, half at its top: Gini is about d / 4, the estimate 0.
    d = 2.0**-7
    top = torch.nextafter(torch.tensor(1.0 + d), torch.tensor(0.0))
    values = torch.cat([torch.ones(500), top.repeat(500)])
    counts, sums = _histogram(values)
    assert histogram_gini(counts, sums) == pytest.approx(0.0, abs=1e-12)
    assert 0.9 * d / 4 < gini_coefficient(values) <= d / 4
    # the top 50% are all at the top of the bin; the estimate takes them at the bin's mean
    exact_top = top_mass_share(values, 0.5)
    error = abs(histogram_top_mass(counts, sums, 0.5) - exact_top)
    assert 0.4 * d * exact_top < error <= d * exact_top


def test_histogram_is_exact_when_every_value_has_its_own_bin():
    values = torch.tensor([0.5, 0.25, 0.375, 0.125])
    counts, sums = _histogram(values)
    assert histogram_gini(counts, sums) == pytest.approx(0.25)  # sorted 1, 2, 3, 4 (x 0.125)
    assert histogram_top_mass(counts, sums, 0.01) == pytest.approx(0.4)  # 0.5 / 1.25


# ---------------------------------------------------------------------------------------------------------------
# The accumulator


def test_streamed_in_chunks_equals_one_shot_and_masks_inactive_elements():
    g = torch.Generator().manual_seed(3)
    deltas = torch.randn(2, 10_000, generator=g) * 1e-4
    mask = active_mask(deltas, 1e-5)
    whole = MagnitudeStatistics.zeros(2)
    whole.update(deltas, mask)
    parts = MagnitudeStatistics.zeros(2)
    for start in range(0, 10_000, 777):
        piece = MagnitudeStatistics.zeros(2)
        piece.update(deltas[:, start : start + 777], mask[:, start : start + 777])
        parts.add(piece)
    assert torch.equal(parts.counts, whole.counts)
    assert torch.allclose(parts.sums, whole.sums, rtol=1e-12)
    assert torch.allclose(parts.power_sums, whole.power_sums, rtol=1e-12)
    for t in range(2):
        active = deltas[t][mask[t]].to(torch.float64)
        summary = whole.summary(t, numel=10_000)
        assert summary["count"] == active.numel() == int(mask[t].sum())
        assert summary["mean_abs"] == pytest.approx(float(active.abs().mean()), rel=1e-12)
        assert summary["mean"] == pytest.approx(float(active.mean()), rel=1e-9)
        assert summary["std"] == pytest.approx(float(active.std(unbiased=False)), rel=1e-9)
        centred = active - active.mean()
        kurtosis = float((centred**4).mean() / (centred**2).mean() ** 2 - 3)
        # sum tau**4 is estimated from the bins; the mean is small, so the kurtosis inherits its relative bound
        assert abs(summary["excess_kurtosis"] - kurtosis) <= 1.1 * FOURTH_POWER_BOUND * (kurtosis + 3)
        assert 0 <= gini_coefficient(active) - summary["gini"] <= 2.0**-9
        assert 0 <= gini_coefficient(torch.where(mask[t], deltas[t], 0.0)) - summary["gini_masked"] <= 2.0**-9
        top = top_mass_share(active, 0.05)
        assert summary["top_5pct_mass"] == pytest.approx(top, rel=2.0**-7)


def test_summary_of_agent_without_active_elements_is_undefined():
    stats = MagnitudeStatistics.zeros(1)
    stats.update(torch.zeros(1, 5), torch.zeros(1, 5, dtype=torch.bool))
    summary = stats.summary(0)
    assert summary["count"] == 0
    assert all(math.isnan(v) for k, v in summary.items() if k != "count")


def test_coarse_histogram_merges_bins_per_octave():
    values = torch.tensor([[1.0, 1.1, 1.3, 1.9, 2.0, 4.5]])
    stats = MagnitudeStatistics.zeros(1)
    stats.update(values, torch.ones_like(values, dtype=torch.bool))
    edges, counts = stats.coarse_histogram(bins_per_octave=2)
    assert edges.tolist() == [1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert counts.tolist() == [[3, 1, 1, 0, 1]]
    with pytest.raises(ValueError, match="power of two"):
        stats.coarse_histogram(bins_per_octave=3)


@pytest.mark.parametrize("zero_filled", [False, True])
def test_of_values_equals_update_of_the_active_elements(zero_filled):
    g = torch.Generator().manual_seed(4)
    deltas = torch.randn(10_000, generator=g) * 1e-4
    deltas[:50] = torch.tensor([2.0**-126, -(2.0**-133), 3.0, -1e30, 1e-5] * 10)  # tiny inactive, huge active
    mask = active_mask(deltas, 1e-5)
    reference = MagnitudeStatistics.zeros(1)
    reference.update(deltas.unsqueeze(0), mask.unsqueeze(0))
    values = torch.where(mask, deltas, 0.0) if zero_filled else deltas[mask]
    got = MagnitudeStatistics.zeros(1)
    for start in range(0, values.numel(), 4096):  # chunk by chunk, as the telemetry adds them
        got.add(magnitude_of(values[start : start + 4096], zero_filled=zero_filled))
    assert torch.equal(got.counts, reference.counts)
    assert got.counts[0, 0] == 0 and got.sums[0, 0] == 0.0
    assert torch.allclose(got.sums, reference.sums, rtol=1e-14, atol=0)
    assert torch.allclose(got.power_sums, reference.power_sums, rtol=1e-12, atol=0)


def test_of_values_keeps_subnormal_magnitudes_of_bin_zero_unless_zero_filled():
    tiny = torch.tensor([1e-42, -1e-42, 0.0, 1.0])
    assert magnitude_bin(tiny)[:3].tolist() == [0, 0, 0]
    assert magnitude_of(tiny).count(0) == 4
    assert magnitude_of(tiny, zero_filled=True).count(0) == 1
    assert float(magnitude_bin_edges(1, 1)[0]) == 2.0**-133


# ---------------------------------------------------------------------------------------------------------------
# The signed, packed histogram: exact integer accumulation, estimated higher powers


def _exact_bin_sums(values: torch.Tensor, mantissa_bits: int) -> dict[int, tuple[int, float]]:
    """Reference: per |tau| bin, the count and the exactly rounded sum of the float32 magnitudes (math.fsum)."""
    bins = magnitude_bin(values, mantissa_bits).tolist()
    out: dict[int, list] = {}
    for b, v in zip(bins, values.abs().tolist(), strict=True):
        out.setdefault(b, []).append(v)
    return {b: (len(v), math.fsum(v)) for b, v in out.items()}


def test_hand_computed_values_each_alone_in_its_bin_give_exact_power_sums():
    stats = magnitude_of(torch.tensor([1.0, -1.0, 1.5, -3.0]))
    assert stats.power_sums[0].tolist() == [-1.5, 13.25, -23.625, 88.0625]
    assert stats.count(0) == 4
    assert stats.summary(0)["mean_abs"] == 6.5 / 4


@pytest.mark.parametrize("mantissa_bits", [7, 0, 3])
def test_bin_sums_are_exact_across_unpacking(mantissa_bits):
    # mantissa_bits=0 unpacks every 2**19 elements: 1.3M values in three calls cross that several times
    g = torch.Generator().manual_seed(5)
    values = (torch.randn(1_300_000, generator=g) * torch.exp(torch.randn(1_300_000, generator=g) * 3)).to(F)
    stats = MagnitudeStatistics.zeros(1, mantissa_bits)
    for part in values.split(500_000):
        assert stats.add_values(0, part) == part.numel()
    reference = _exact_bin_sums(values, mantissa_bits)
    counts, sums = stats.counts[0].tolist(), stats.sums[0].tolist()  # each property folds every bin: read once
    nonzero = [b for b, count in enumerate(counts) if count]
    assert sorted(nonzero) == sorted(reference)
    for b in nonzero:
        assert (counts[b], sums[b]) == reference[b]
    assert float(stats.power_sums[0, 0]) == pytest.approx(math.fsum(values.tolist()), rel=1e-12)
    assert float(stats.square_sums[0]) == pytest.approx(math.fsum(v * v for v in values.tolist()), rel=1e-12)


def test_higher_power_estimates_are_within_their_bounds_and_the_bounds_nearly_attained():
    # half of the values at the bottom of one bin, half at its top, of both signs: the worst case of the estimates
    top = float(torch.nextafter(torch.tensor(1.0 + D), torch.tensor(0.0)))
    values = torch.tensor([1.0, top] * 500 + [-1.0, -top] * 250, dtype=F)
    x = values.to(torch.float64)
    stats = magnitude_of(values)
    estimate = stats.power_sums[0].tolist()
    exact = [float((x**p).sum()) for p in range(1, 5)]
    assert stats.fourth_power_relative_error == FOURTH_POWER_BOUND  # what the analysis reports
    assert estimate[:2] == pytest.approx(exact[:2], rel=1e-13)  # float64 sums
    fourth = (exact[3] - estimate[3]) / exact[3]
    assert 0.0 < fourth <= FOURTH_POWER_BOUND
    assert fourth > 0.9 * 1.5 * D**2
    third = abs(exact[2] - estimate[2]) / float((x.abs() ** 3).sum())
    assert 0.0 < third <= THIRD_POWER_BOUND


def test_nan_is_left_out_inf_and_negative_zero_handled():
    values = torch.tensor([0.5, -0.0, 0.0, float("nan"), float("inf"), -float("inf"), -0.25, 0.0], dtype=F)
    stats = MagnitudeStatistics.zeros(1)
    assert stats.add_histogram(0, values, zero_filled=True) == 4  # 0.5, inf, -inf, -0.25
    assert stats.count(0) == 4
    assert stats.counts[0, 0] == 0
    inf_bin = int(magnitude_bin(torch.tensor([math.inf])))
    assert stats.counts[0, inf_bin] == 2 and stats.sums[0, inf_bin] == math.inf
    assert not stats.sums[0].isnan().any()
    kept = MagnitudeStatistics.zeros(1)
    assert kept.add_values(0, values) == 7  # not zero-filled: the three zeros count; NaN does not
    assert kept.counts[0, 0] == 3 and math.isinf(float(kept.square_sums[0]))


def test_adding_statistics_of_another_resolution_is_refused():
    with pytest.raises(ValueError, match="resolution"):
        MagnitudeStatistics.zeros(1).add(MagnitudeStatistics.zeros(1, 3))
    with pytest.raises(ValueError, match="mantissa_bits"):
        MagnitudeStatistics.zeros(1, 24)
