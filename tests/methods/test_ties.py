"""Hand-computed golden cases for TIES (trim, elect, disjoint mean)."""

from __future__ import annotations

import pytest
import torch

from ram_trl.methods.ties import disjoint_merge, elect_sign, keep_count, magnitude_cut, magnitude_trim

F = torch.float32


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


def test_trim_keeps_top_k_and_breaks_ties_by_lowest_index():
    delta = torch.tensor([0.1, -0.5, 0.3, 0.3, -0.3, 0.05], dtype=F)
    cut = magnitude_cut(delta.abs(), 3)  # 0.5, then two of the three 0.3s: indices 2 and 3
    trimmed, equal = magnitude_trim(delta.clone(), cut)
    assert trimmed.tolist() == pytest.approx([0.0, -0.5, 0.3, 0.3, 0.0, 0.0])
    assert equal == 3


def test_trim_is_the_same_in_chunks():
    delta = torch.tensor([0.3, -0.5, 0.3, 0.1, -0.3, 0.3, 0.2, 0.3], dtype=F)
    cut = magnitude_cut(delta.abs(), 4)  # 0.5 + the first three 0.3s (indices 0, 2, 4)
    whole, _ = magnitude_trim(delta.clone(), cut)
    seen, parts = 0, []
    for chunk in (delta[:3], delta[3:5], delta[5:]):
        part, equal = magnitude_trim(chunk.clone(), cut, seen)
        seen += equal
        parts.append(part)
    assert torch.equal(torch.cat(parts), whole)
    assert (whole != 0).sum() == 4
    assert whole.tolist() == pytest.approx([0.3, -0.5, 0.3, 0.0, -0.3, 0.0, 0.0, 0.0])


def test_cut_keep_all_and_none():
    delta = torch.tensor([1.0, -2.0], dtype=F)
    assert magnitude_trim(delta.clone(), magnitude_cut(delta.abs(), 2))[0].tolist() == [1.0, -2.0]
    assert magnitude_trim(delta.clone(), magnitude_cut(delta.abs(), 0))[0].tolist() == [0.0, 0.0]


def test_elect_sign_by_sum_and_zero_is_positive():
    weighted = torch.tensor([[1.0, -1.0, 2.0, 0.0], [-3.0, 1.0, -1.0, 0.0]], dtype=F)
    assert elect_sign(weighted).tolist() == [-1.0, 1.0, 1.0, 1.0]


def test_disjoint_mean_by_hand():
    deltas = torch.tensor([[0.4, -0.2, 0.0, 0.3], [-0.6, -0.4, 0.0, 0.5], [0.4, 0.6, 0.0, 0.0]], dtype=F)
    weights = torch.tensor([1.0, 1.0, 1.0])
    merged = disjoint_merge(deltas.clone(), weights, 1.0, normalize=True)
    # e0: sum 0.2 -> +, agreeing 0.4, 0.4 -> mean 0.4; e1: sum 0 -> +, agreeing 0.6 -> 0.6; e2: nothing -> 0;
    # e3: + , agreeing 0.3 and 0.5 -> 0.4
    assert merged.tolist() == pytest.approx([0.4, 0.6, 0.0, 0.4])
    summed = disjoint_merge(deltas.clone(), weights, 0.5, normalize=False)
    assert summed.tolist() == pytest.approx([0.4, 0.3, 0.0, 0.4])


def test_disjoint_weights_enter_election_and_divisor():
    deltas = torch.tensor([[1.0], [-1.0]], dtype=F)
    weights = torch.tensor([3.0, 1.0])
    # weighted: 3, -1 -> elected +, agreeing weighted 3 with weight 3 -> 3 / 3 = 1
    assert disjoint_merge(deltas.clone(), weights, normalize=True).tolist() == [1.0]
    assert disjoint_merge(deltas.clone(), weights, normalize=False).tolist() == [3.0]
