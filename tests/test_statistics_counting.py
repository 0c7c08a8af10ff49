"""The counting maths shared by the statistics and the methods: the strict float32 threshold, the subset codes,
rho_t and the RAM+ / RAM+s factors, the exact k of magnitude trimming (hand-computed cases)."""

from __future__ import annotations

import math

import pytest
import torch

from ram_trl.statistics.counting import (
    active_flags,
    active_mask,
    keep_count,
    masked_deltas,
    overlap_unique_ratio,
    rescale_factor,
    soft_rescale_factor,
    subset_codes,
)

F = torch.float32


def test_mask_threshold_in_float32():
    # 1e-5 in float32 is 9.99999974738e-06; a float32 delta of exactly that value is not active.
    eps32 = torch.tensor(1e-5, dtype=F)
    assert not bool(active_mask(eps32.reshape(1, 1), 1e-5))
    assert bool(active_mask(torch.nextafter(eps32, torch.tensor(1.0)).reshape(1, 1), 1e-5))


def test_rho_edge_cases():
    assert overlap_unique_ratio(4, 2) == 2.0
    assert overlap_unique_ratio(3, 0) == math.inf  # shared but no unique element
    assert overlap_unique_ratio(0, 0) == 0.0  # no active element at all
    assert overlap_unique_ratio(0, 5) == 0.0


def test_rescale_factor_clips_at_alpha():
    assert rescale_factor(1.0, 0.1, 1.5) == pytest.approx(1.1)
    assert rescale_factor(2.0, 0.1, 1.5) == pytest.approx(1.15)  # clipped
    assert rescale_factor(math.inf, 0.1, 2.0) == pytest.approx(1.2)  # no unique element -> alpha
    assert rescale_factor(5.0, 0.0, 2.0) == 1.0  # RAM


def test_soft_rescale_factor():
    assert soft_rescale_factor(1.0, 0.1) == pytest.approx(1.05)
    assert soft_rescale_factor(2.0, 0.1) == pytest.approx(1 + 0.1 * 2 / 3)
    assert soft_rescale_factor(math.inf, 0.1) == pytest.approx(1.1)
    assert soft_rescale_factor(0.0, 0.1) == 1.0


def test_subset_codes_name_the_set_of_active_agents():
    # per element the bit field of its active agents: e0 none, e1 agent 0, e2 agents 0 and 1, e3 agents 1 and 2
    taus = torch.tensor([[0.0, 0.5, 0.2, 0.0], [0.0, 0.0, -0.4, 0.3], [0.0, 1e-5, 0.0, 0.6]], dtype=F)
    assert subset_codes(active_mask(taus, 1e-5)).tolist() == [0, 1, 3, 6]
    assert subset_codes(active_flags(taus, 1e-5)).tolist() == [0, 1, 3, 6]
    assert subset_codes(active_mask(taus, 1e-5)).dtype == torch.uint8
    many = torch.zeros(9, 1, dtype=F)
    many[8, 0] = 1.0
    assert subset_codes(active_flags(many, 0.5)).tolist() == [256]  # int32 beyond 8 agents


def test_masked_deltas_zero_the_inactive_elements():
    taus = torch.tensor([1e-5, -2e-5, 0.0, -1e-5, 0.3], dtype=F)
    assert masked_deltas(taus, 1e-5).tolist() == [0.0, pytest.approx(-2e-5), 0.0, 0.0, pytest.approx(0.3)]
    out = torch.empty(5, dtype=F)
    assert masked_deltas(taus, 1e-5, out=out) is out


@pytest.mark.parametrize(
    ("numel", "density", "k"),
    [
        (100, 0.29, 29),
        (10, 0.3, 3),
        (10, 0.7, 7),
        (7, 0.5, 3),
        (1000, 0.001, 1),
        (5, 0.01, 1),
        (5, 1.0, 5),
        (5, 0.0, 0),
    ],
)
def test_keep_count_exact_decimal(numel, density, k):
    # int(0.29 * 100) == 28 in binary floating point; the decimal density as written keeps 29.
    assert keep_count(numel, density) == k
