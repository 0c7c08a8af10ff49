"""ram_trl/merging/passes/epilogue.py: the kernels' epilogue on small real tensors (the passes as a whole are checked against
tests/reference.py in tests/merging/test_engine_reference.py and byte for byte in tests/merging/test_engine_golden.py)."""

from __future__ import annotations

import pytest
import torch

from ram_trl.errors import NonFiniteError
from ram_trl.merging.passes.epilogue import check_finite_output, keep_signed_zeros


def _bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.int32).tolist()


def test_signed_zeros_of_the_base_are_kept():
    base = torch.tensor([-0.0, -0.0, 0.0, 1.0])
    merged = base + torch.tensor([0.0, 0.5, 0.0, -1.0])  # -0.0 + 0.0 = +0.0; 1.0 - 1.0 = +0.0
    assert _bits(merged)[0] == 0
    keep_signed_zeros(merged, base)
    assert _bits(merged) == _bits(torch.tensor([-0.0, 0.5, 0.0, 0.0]))


def test_blocks_without_negative_zeros_are_left_alone():
    base = torch.tensor([0.0, 1.0, -2.0])
    merged = torch.tensor([-0.0, 0.0, 3.0])  # a -0.0 the base does not hold is not the helper's business
    keep_signed_zeros(merged, base)
    assert _bits(merged) == _bits(torch.tensor([-0.0, 0.0, 3.0]))
    bf16 = torch.tensor([-0.0, 1.0], dtype=torch.bfloat16)  # only float32 blocks are fixed up
    merged = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    keep_signed_zeros(merged, bf16)
    assert torch.equal(merged.view(torch.int16), torch.tensor([0.0, 1.0], dtype=torch.bfloat16).view(torch.int16))


def test_finite_output_passes():
    check_finite_output(torch.tensor([3.0e38, -3.0e38, 0.0]), "w", 0, 1)


def test_overflow_is_refused_with_its_count_and_rows():
    merged = torch.tensor([3.0e38, 3.0e38]) * 2  # inf, inf
    merged = torch.cat([merged, torch.tensor([1.0, float("nan")])])
    with pytest.raises(NonFiniteError) as info:
        check_finite_output(merged, "model.w", 4, 8)
    message = str(info.value)
    assert message.startswith("tensor 'model.w': 3 merged values overflow float32 (rows 4:8)")
    with pytest.raises(NonFiniteError, match=r"overflow in float16 \(\|x\| > 65504\) \(rows 0:1\)"):
        check_finite_output(torch.tensor([float("inf")]), "w", 0, 1, " in float16 (|x| > 65504)")
