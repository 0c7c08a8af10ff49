"""ram_trl/stage/save.py: the agent a run leaves behind (its save through a trainer is tested with the callback in
tests/callbacks/test_sparsity.py)."""

from __future__ import annotations

import pytest
import torch

from ram_trl.errors import NonFiniteError
from ram_trl.stage.save import check_finite_agent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finiteness_check_finds_every_nan_and_inf(dtype, tmp_path):

    clean = {"a": torch.randn(1000).to(dtype), "b": torch.randn(7, 33).to(dtype), "empty": torch.empty(0, dtype=dtype)}
    check_finite_agent({**clean, "ids": torch.arange(4)}, dtype, tmp_path)
    for value in (float("nan"), float("inf"), float("-inf")):
        for position in (0, 500, 999):  # the first, a middle and the last element (vectorised tails included)
            broken = clean["a"].clone()
            broken[position] = value
            with pytest.raises(NonFiniteError, match=r"holds 1 NaN/Inf values .*\(1 tensors, first 'a'\)"):
                check_finite_agent({**clean, "a": broken}, dtype, tmp_path)
    worse = clean["b"].clone()
    worse[3, ::4] = float("nan")
    with pytest.raises(NonFiniteError, match=r"holds 9 NaN/Inf values .*\(1 tensors, first 'b'\)"):
        check_finite_agent({**clean, "b": worse}, dtype, tmp_path)
