"""Hand-computed golden cases for Fisher merging, including the zero-Fisher branch."""

from __future__ import annotations

import pytest
import torch

from ram_trl.methods.fisher import DEFAULT_FISHER_FLOOR, fisher_merge

F = torch.float32
# two agents, three elements: both informed / only agent 1 informed / nobody informed
DELTAS = torch.tensor([[1.0, 2.0, 4.0], [3.0, -2.0, 8.0]], dtype=F)
FISHERS = torch.tensor([[1.0, 0.0, 0.0], [3.0, 2.0, 0.0]], dtype=F)


def _merge(weights, scale=1.0, floor=0.0, fishers=FISHERS):
    return fisher_merge(DELTAS.clone(), fishers.clone(), torch.tensor(weights, dtype=F), scale, floor)


def test_fisher_weighted_mean_without_floor():
    # (1*1 + 3*3) / (1 + 3) = 2.5; (0*2 + 2*(-2)) / (0 + 2) = -2; sum F = 0: mean of 4 and 8 = 6
    assert _merge([1.0, 1.0]).tolist() == [2.5, -2.0, 6.0]


def test_weights_multiply_the_fisher():
    # (1*1*1 + 0.5*3*3) / (1*1 + 0.5*3) = 5.5 / 2.5; -2 (agent 0 has no information); (4 + 0.5*8) / 1.5
    merged = _merge([1.0, 0.5])
    assert merged.tolist() == pytest.approx([2.2, -2.0, 8.0 / 1.5], rel=1e-7)


def test_lambda_scales_the_merged_task_vector():
    assert _merge([1.0, 1.0], scale=0.5).tolist() == [1.25, -1.0, 3.0]


def test_floor_raises_small_fishers():
    # max(F, 0.5): element 1 is (0.5*2 + 2*(-2)) / (0.5 + 2) = -1.2, element 2 the plain mean 6
    merged = _merge([1.0, 1.0], floor=0.5)
    assert merged.tolist() == pytest.approx([2.5, -1.2, 6.0], rel=1e-7)
    assert DEFAULT_FISHER_FLOOR == 1e-6  # Matena & Raffel's default


def test_zero_fisher_branch_is_the_limit_of_the_floored_rule():
    # with every F = 0 a positive floor gives the weighted mean; the unfloored rule gives the same value there
    zeros = torch.zeros_like(FISHERS)
    floored = _merge([1.0, 3.0], floor=0.25, fishers=zeros)  # a power of two: no rounding
    exact = _merge([1.0, 3.0], floor=0.0, fishers=zeros)
    assert exact.tolist() == [2.5, -1.0, 7.0]  # (1*d0 + 3*d1) / 4
    assert torch.equal(floored, exact)


def test_zero_weights_keep_the_base():
    assert _merge([0.0, 0.0]).tolist() == [0.0, 0.0, 0.0]


def test_zero_weight_agent_is_ignored():
    # agent 1 weighted 0: its Fisher adds nothing to either sum; element 1 has no information left -> plain mean
    # over the weights, which is agent 0's value
    assert _merge([1.0, 0.0]).tolist() == [1.0, 2.0, 4.0]


def test_deltas_are_left_unchanged():
    deltas = DELTAS.clone()
    fisher_merge(deltas, FISHERS.clone(), torch.tensor([1.0, 1.0]), 1.0, 0.0)
    assert torch.equal(deltas, DELTAS)
