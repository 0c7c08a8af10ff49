"""The RAM authors' public script (xiangchi-yuan/mrl ``ram-main.py``) against ram_trl, on a case computed by hand.

Its ``arm-r-v2`` mode rescales an agent's unique elements by ``1 + (R - 1) * min(2, min(1, rho))`` (``R`` =
``--rescale_factor``): that is ram_trl's ``ram_plus`` with ``r = R - 1`` and ``alpha = 1``. Its ``arm-r`` mode uses
``shared / active`` clipped to ``[0, 1]``: ``ram_plus_soft`` with ``r = R - 1``. See docs/reference-implementations.md.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import ram_trl

# Two agents on an 8-element base of zeros (so each agent's weights are its task vector), dyadic values so that
# every product below is exact in float32:
#   element   0     1     2      3      4      5     6    7
#   tau_1   0.5   0.25  0.125  0.125  0.375  0.75  0    0      active 0-5
#   tau_2   0.25  0     0      0      0      0.25  0.5  0      active 0, 5, 6
# shared (both active): elements 0 and 5. Agent 1: unique 4, shared 2 -> rho_1 = 0.5. Agent 2: unique 1, shared 2
# -> rho_2 = 2.
TAU_1 = [0.5, 0.25, 0.125, 0.125, 0.375, 0.75, 0.0, 0.0]
TAU_2 = [0.25, 0.0, 0.0, 0.0, 0.0, 0.25, 0.5, 0.0]
R = 1.5  # the script's --rescale_factor


def authors_rescale_v2(rho: float, rescale_factor: float) -> float:
    """``arm-r-v2``, transcribed: ``1 + (R - 1) * min(2, min(1, rho))``."""
    return 1 + (rescale_factor - 1) * min(2, min(1, rho))


def authors_rescale_r(shared: int, active: int, rescale_factor: float) -> float:
    """``arm-r``, transcribed: ``1 + (R - 1) * clip(shared / active, 0, 1)``."""
    return 1 + (rescale_factor - 1) * min(1.0, max(0.0, shared / active))


def _merge(tmp_path, method: str, parameters: dict, taus=(TAU_1, TAU_2)) -> tuple[torch.Tensor, dict]:
    for name, values in [("base", [0.0] * 8), ("a1", taus[0]), ("a2", taus[1])]:
        (tmp_path / name).mkdir(exist_ok=True)
        save_file({"w": torch.tensor(values, dtype=torch.float32)}, str(tmp_path / name / "model.safetensors"))
    config = {
        "merge_method": method,
        "base_model": str(tmp_path / "base"),
        "models": [{"model": str(tmp_path / "a1")}, {"model": str(tmp_path / "a2")}],
        "parameters": parameters,
    }
    out = tmp_path / f"out-{method}-{len(parameters)}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no config.json in these toy checkpoints
        report = ram_trl.merge(config, out, progress=False)
    return load_file(str(out / "model.safetensors"))["w"], report


def test_arm_r_v2_is_ram_plus_with_alpha_1(tmp_path):
    # by hand: lambda_1 = 1 + 0.5 * min(1, 0.5) = 1.25, lambda_2 = 1 + 0.5 * min(1, 2) = 1.5
    assert authors_rescale_v2(0.5, R) == 1.25 and authors_rescale_v2(2.0, R) == 1.5
    # shared elements: the mean of the active values; unique ones: lambda_t * tau_t; 0 where nobody is active
    by_hand = [0.375, 0.3125, 0.15625, 0.15625, 0.46875, 0.5, 0.75, 0.0]
    merged, report = _merge(tmp_path, "ram_plus", {"r": R - 1, "alpha": 1.0})
    assert [a["unique"] for a in report["agents"]] == [4, 1] and [a["shared"] for a in report["agents"]] == [2, 2]
    assert [a["lambda"] for a in report["agents"]] == [1.25, 1.5]
    assert merged.tolist() == by_hand
    # the paper's default alpha = 2 differs exactly where rho_t > 1: agent 2's unique element, 1 + 0.5 * 2 = 2
    paper, _ = _merge(tmp_path, "ram_plus", {"r": R - 1})
    assert paper.tolist() == [*by_hand[:6], 1.0, 0.0]


def test_arm_r_is_ram_plus_soft(tmp_path):
    # by hand: lambda_1 = 1 + 0.5 * 2 / 6 = 7 / 6, lambda_2 = 1 + 0.5 * 2 / 3 = 4 / 3
    lambdas = [authors_rescale_r(2, 6, R), authors_rescale_r(2, 3, R)]
    assert lambdas == pytest.approx([7 / 6, 4 / 3], rel=1e-15)
    merged, _ = _merge(tmp_path, "ram_plus_soft", {"r": R - 1})
    expected = torch.tensor(
        [
            0.375,
            0.25 * lambdas[0],
            0.125 * lambdas[0],
            0.125 * lambdas[0],
            0.375 * lambdas[0],
            0.5,
            0.5 * lambdas[1],
            0.0,
        ]
    )
    torch.testing.assert_close(merged, expected, rtol=2**-23, atol=0)


def test_no_unique_element_where_the_script_divides_by_zero(tmp_path):
    # agent 2 changes only shared elements: the script's rho = shared / unique raises ZeroDivisionError; ram_trl
    # takes rho = inf, clipped: lambda_2 = 1 + r * alpha, and merges
    only_shared = [0.25, 0.0, 0.0, 0.0, 0.0, 0.25, 0.0, 0.0]
    merged, report = _merge(tmp_path, "ram_plus", {"r": R - 1, "alpha": 1.0}, taus=(TAU_1, only_shared))
    assert report["agents"][1]["unique"] == 0 and report["agents"][1]["lambda"] == 1.5
    assert merged.tolist() == [0.375, 0.3125, 0.15625, 0.15625, 0.46875, 0.5, 0.0, 0.0]
