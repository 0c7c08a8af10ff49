"""Hand-computed golden cases for TIES (trim, elect, disjoint mean)."""

from __future__ import annotations

import math

import pytest
import torch

from ram_trl.methods import ties
from ram_trl.methods.ties import (
    MagnitudeCut,
    disjoint_merge,
    elect_sign,
    kth_largest_bits,
    magnitude_cut,
    magnitude_trim,
)

F = torch.float32


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


# ---------------------------------------------------------------------------------------------------------------
# The cut by radix select on float32 bit patterns equals the cut by torch.kthvalue


def _kthvalue_cut(magnitudes: torch.Tensor, k: int) -> MagnitudeCut:
    """The cut as computed before the radix select: torch.kthvalue, then the elements above it."""
    n = magnitudes.numel()
    if k >= n:
        return MagnitudeCut(0.0, 0, keep_all=True)
    if k <= 0:
        return MagnitudeCut(math.inf, 0)
    value = torch.kthvalue(magnitudes, n - k + 1).values
    return MagnitudeCut(float(value), k - int((magnitudes > value).sum()))


def _assert_same_cut(delta: torch.Tensor, k: int) -> None:
    """The cut equals kthvalue's, or keeps everything where kthvalue's cut is 0 (every nonzero element kept), and
    trims to the same bits either way."""
    magnitudes = delta.abs()
    cut, expected = magnitude_cut(magnitudes, k), _kthvalue_cut(magnitudes, k)
    if cut.keep_all and not expected.keep_all:
        assert expected.threshold == 0.0
    else:
        assert cut == expected
    trimmed, _ = magnitude_trim(delta.clone(), cut)
    reference, _ = magnitude_trim(delta.clone(), expected)
    assert torch.equal(trimmed.view(torch.int32), reference.view(torch.int32))


def _random_deltas(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 2000, (), generator=generator))
    normal = torch.randn(n, generator=generator)
    sparse = torch.rand(n, generator=generator) < 0.3
    return [
        normal,  # distinct magnitudes
        (normal * sparse).to(torch.bfloat16).float(),  # whole bf16 steps: many ties at the cut; mostly zeros
        torch.randint(-3, 4, (n,), generator=generator).float(),  # ties everywhere
        torch.randint(-3, 4, (n,), generator=generator).float() * 1e-40,  # subnormals and zeros
        normal * 1e30,  # large exponents
    ]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block", [256, 1 << 20])
def test_radix_cut_equals_kthvalue_on_random_inputs(seed, block, monkeypatch):
    monkeypatch.setattr(ties, "HISTOGRAM_BLOCK", block)
    generator = torch.Generator().manual_seed(100 + seed)
    for delta in _random_deltas(seed):
        n = delta.numel()
        random_k = int(torch.randint(0, n + 1, (), generator=generator))
        for k in sorted({0, 1, 2, n // 3, n - 1, n, random_k}):
            _assert_same_cut(delta, k)


def test_radix_cut_ties_at_the_cut_keep_the_lowest_indices():
    delta = torch.tensor([0.25, -0.5, 0.25, 0.125, -0.25, 0.25], dtype=F)
    cut = magnitude_cut(delta.abs(), 3)
    assert cut == MagnitudeCut(0.25, 2)
    assert magnitude_trim(delta.clone(), cut)[0].tolist() == [0.25, -0.5, 0.25, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_radix_cut_of_all_zeros_and_negative_zeros_keeps_everything(k):
    delta = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0], dtype=F)
    cut = magnitude_cut(delta.abs(), k)
    assert cut.keep_all
    trimmed, _ = magnitude_trim(delta.clone(), cut)
    assert torch.equal(trimmed.view(torch.int32), delta.view(torch.int32))  # the signs of zero survive
    _assert_same_cut(delta, k)


def test_radix_cut_when_fewer_nonzeros_than_k_keeps_everything():
    delta = torch.tensor([0.0, 3.0, 0.0, -1.0, -0.0, 0.0, 2.0, 0.0], dtype=F)
    cut = magnitude_cut(delta.abs(), 4)  # 3 nonzero elements, k = 4: the k-th largest is 0
    assert cut.keep_all
    _assert_same_cut(delta, 4)
    _assert_same_cut(delta, 3)  # exactly k nonzero elements: the cut is the smallest of them
    assert magnitude_cut(delta.abs(), 3) == MagnitudeCut(1.0, 1)


def test_radix_cut_k_one_and_k_numel():
    delta = torch.tensor([0.5, -2.0, 2.0, 1e-42, -3.0e38, 0.0], dtype=F)
    assert magnitude_cut(delta.abs(), 1) == MagnitudeCut(float(torch.tensor(3.0e38, dtype=F)), 1)
    assert magnitude_cut(delta.abs(), 2) == MagnitudeCut(2.0, 1)  # one of the two 2.0s: index 1
    assert magnitude_cut(delta.abs(), 5) == MagnitudeCut(float(torch.tensor(1e-42, dtype=F)), 1)  # a subnormal
    assert magnitude_cut(delta.abs(), 6).keep_all
    for k in range(7):
        _assert_same_cut(delta, k)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_non_finite_magnitudes_fall_back_to_kthvalue(bad):
    delta = torch.tensor([0.5, bad, -2.0, 0.25, 1.0], dtype=F)
    assert kth_largest_bits(delta.abs(), 2) is None
    for k in range(6):
        cut = magnitude_cut(delta.abs(), k)
        expected = _kthvalue_cut(delta.abs(), k)
        assert cut == expected or (math.isnan(cut.threshold) and math.isnan(expected.threshold))


def test_kth_largest_bits_by_hand():
    magnitudes = torch.tensor([1.0, 0.5, 1.0, 0.0, 1.5, 1.0], dtype=F)
    bits, above = kth_largest_bits(magnitudes, 3)
    assert torch.tensor(bits, dtype=torch.int32).view(F).item() == 1.0
    assert above == 1
