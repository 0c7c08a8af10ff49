"""Hand-computed golden cases for task arithmetic and linear merging."""

from __future__ import annotations

import pytest
import torch

from ram_trl.methods.linear import linear, task_arithmetic

F = torch.float32
DELTAS = torch.tensor([[0.2, -0.4, 0.0], [0.6, 0.4, 1.0]], dtype=F)


def test_task_arithmetic_weights_and_lambda():
    w = torch.tensor([1.0, 0.5])
    assert task_arithmetic(DELTAS.clone(), w).tolist() == pytest.approx([0.5, -0.2, 0.5])
    assert task_arithmetic(DELTAS.clone(), w, scale=0.5).tolist() == pytest.approx([0.25, -0.1, 0.25])
    assert task_arithmetic(DELTAS.clone(), w, normalize=True).tolist() == pytest.approx(
        [0.5 / 1.5, -0.2 / 1.5, 0.5 / 1.5]
    )


def test_task_arithmetic_zero_weight_sum_is_not_divided():
    w = torch.tensor([1.0, -1.0])
    assert task_arithmetic(DELTAS.clone(), w, normalize=True).tolist() == pytest.approx([-0.4, -0.8, -1.0])


def test_linear_is_weighted_average_of_models():
    base = torch.tensor([1.0, 2.0, 3.0], dtype=F)
    w = torch.tensor([1.0, 3.0])
    merged = linear(DELTAS.clone(), base, w, normalize=True)
    models = base + DELTAS
    assert (base + merged).tolist() == pytest.approx(((models[0] * 1 + models[1] * 3) / 4).tolist())
    unnormalized = linear(DELTAS.clone(), base, w, normalize=False)
    assert (base + unnormalized).tolist() == pytest.approx((models[0] * 1 + models[1] * 3).tolist())


def test_linear_zero_weights_rejected():
    with pytest.raises(ValueError, match="sum to zero"):
        linear(DELTAS.clone(), torch.zeros(3), torch.tensor([1.0, -1.0]), normalize=True)
