"""The LoRA product: every element is the float64 sum of its products in rank order, rounded once to float32."""

from __future__ import annotations

import pytest
import torch

from ram_trl.io import lora_product as module
from ram_trl.io.lora_product import lora_product


def _ordered(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The definition, one rank at a time: ((0 + p_0) + p_1) + ... in float64, rounded once."""
    total = torch.zeros(b.shape[0], a.shape[1], dtype=torch.float64)
    for k in range(b.shape[1]):
        total += b[:, k : k + 1].double() * a[k : k + 1, :].double()
    return total.float()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _tie_factors() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose ordered sum and reversed sum round to different float32 values.

    Row 0: 3 x 2**-54 + 2**-24 + 1 in rank order is 1 + 2**-24 + 1.5 * 2**-53, which rounds (float64) to
    1 + 2**-24 + 2**-52 and then up to 1 + 2**-23; summed from the 1 down, each 2**-54 is lost, the float64 sum is the
    float32 tie 1 + 2**-24, and that rounds to even: 1. Row 1 is row 0 negated, row 2 a random row.
    """
    tiny = 2.0**-54
    row = [tiny, tiny, tiny, 2.0**-24, 1.0]
    b = torch.tensor([row, [-x for x in row], torch.randn(5, generator=torch.Generator().manual_seed(1)).tolist()])
    a = torch.ones(5, 3)
    return b, a


def _reversed_product(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """A float64 product summing the ranks from the last one: another order, as another BLAS would."""
    total = torch.zeros(b.shape[0], a.shape[1], dtype=torch.float64)
    for k in reversed(range(b.shape[1])):
        total += b[:, k : k + 1] * a[k : k + 1, :]
    return total


def test_random_factors_give_the_ordered_sum_and_not_the_float32_product():
    gen = torch.Generator().manual_seed(0)
    b = torch.randn(300, 16, generator=gen) * 0.01
    a = torch.randn(16, 200, generator=gen) * 0.01
    got = lora_product(b, a)
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(_ordered(b, a)))
    # the float32 BLAS product rounds its partial sums: its last bits differ (this is what the product replaces)
    assert not torch.equal(_bits(b @ a), _bits(got))


def test_another_summation_order_in_the_blas_gives_the_same_bits(monkeypatch):
    b, a = _tie_factors()
    ordered = _ordered(b, a)
    assert ordered[0, 0].item() == 1.0 + 2.0**-23 and ordered[1, 0].item() == -(1.0 + 2.0**-23)
    reversed_sum = _reversed_product(b.double(), a.double()).float()
    assert reversed_sum[0, 0].item() == 1.0  # the data tells the orders apart
    monkeypatch.setattr(module, "_float64_product", _reversed_product)
    assert torch.equal(_bits(lora_product(b, a)), _bits(ordered))


def test_cancelling_products_in_a_reversed_blas_give_the_same_bits(monkeypatch):
    """Products that cancel (rows much smaller than their norms) are where the check must sum again most."""
    gen = torch.Generator().manual_seed(2)
    b = torch.randn(64, 32, generator=gen)
    a = torch.randn(32, 48, generator=gen)
    b[:, 16:] = -b[:, :16]  # each element: sum of p_k + (-p_k) pairs at distance 16, plus nothing else
    b[:, 16] += torch.randn(64, generator=gen) * 2.0**-20
    a[16:] = a[:16]
    ordered = _ordered(b, a)
    assert not torch.equal(_bits(_reversed_product(b.double(), a.double()).float()), _bits(ordered))
    monkeypatch.setattr(module, "_float64_product", _reversed_product)
    assert torch.equal(_bits(lora_product(b, a)), _bits(ordered))


def test_any_split_into_row_blocks_gives_the_same_bits(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    b = torch.randn(257, 64, generator=gen) * 0.02
    a = torch.randn(64, 129, generator=gen) * 0.02
    whole = lora_product(b, a)
    monkeypatch.setattr(module, "PRODUCT_ELEMENTS", 20 * 129)  # 20 rows per BLAS call
    monkeypatch.setattr(module, "BLOCK_ELEMENTS", 7 * 129)  # 7 rows per check
    assert torch.equal(_bits(lora_product(b, a)), _bits(whole))
    pieces = torch.cat([lora_product(b[start : start + 37], a) for start in range(0, 257, 37)])
    assert torch.equal(_bits(pieces), _bits(whole))


def test_zeros_are_positive_and_low_precision_factors_are_exact(monkeypatch):
    b = torch.zeros(4, 3)
    b[1] = torch.tensor([-1.0, 0.0, 2.0])
    a = torch.tensor([[1.0, -1.0], [5.0, 0.0], [0.0, -0.0]])
    # a BLAS whose zeros are -0 (PEFT's zero lora_B): the product's zeros are +0 all the same
    monkeypatch.setattr(module, "_float64_product", lambda x, y: torch.matmul(-x, y).neg())
    assert torch.signbit(module._float64_product(b.double(), a.double())[0]).all()
    got = lora_product(b, a)
    assert not torch.signbit(got[got == 0]).any()
    assert torch.equal(got[1], torch.tensor([-1.0, 1.0]))
    gen = torch.Generator().manual_seed(4)
    b16 = torch.randn(20, 8, generator=gen).to(torch.bfloat16)
    a16 = torch.randn(8, 30, generator=gen).to(torch.float16)
    assert torch.equal(_bits(lora_product(b16, a16)), _bits(_ordered(b16.float(), a16.float())))


def test_non_finite_factors_follow_the_ordered_sum():
    b = torch.tensor([[float("inf"), 1.0], [1.0, 2.0], [float("nan"), 0.0]])
    a = torch.tensor([[1.0, -1.0, 0.0], [float("-inf"), 1.0, 1.0]])
    got, want = lora_product(b, a), _ordered(b, a)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], want[finite])


def test_empty_shapes_and_a_mismatch():
    assert lora_product(torch.zeros(0, 4), torch.zeros(4, 3)).shape == (0, 3)
    assert torch.equal(lora_product(torch.ones(2, 0), torch.ones(0, 3)), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(4, 5\)"):
        lora_product(torch.ones(2, 3), torch.ones(4, 5))


def test_a_lora_merge_has_the_ordered_bits_for_any_chunk_budget(tmp_path):
    """The merge's LoRA task vectors are the product's bits, for chunks of a few rows and for whole tensors.

    Under ``MKL_CBWR=AVX2`` a float32 ``B[rows] @ A`` gave other bytes for each chunk budget (tests/test_numerics_env.py
    runs this module so).
    """
    pytest.importorskip("peft", reason="peft is needed to build a real LoRA adapter")
    from safetensors.torch import load_file

    import ram_trl
    from tests.helpers import lora_adapter, qwen_model, save_base

    base = save_base(qwen_model(), tmp_path / "base")
    lora_adapter(qwen_model(), tmp_path / "lora", r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"])
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(base),
        "models": [{"model": str(tmp_path / "lora")}],
        "out_dtype": "float32",
    }
    merged = {}
    for budget in ("8KB", "512MB"):
        ram_trl.merge(config, tmp_path / budget, chunk_budget=budget, progress=False)
        merged[budget] = load_file(tmp_path / budget / "model.safetensors")
    assert merged["8KB"].keys() == merged["512MB"].keys()
    for name, values in merged["8KB"].items():
        assert torch.equal(_bits(values), _bits(merged["512MB"][name])), name
    base_tensors = load_file(base / "model.safetensors")
    factors = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    for module_name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        prefix = f"base_model.model.{module_name}"
        delta = _ordered(factors[f"{prefix}.lora_B.weight"], factors[f"{prefix}.lora_A.weight"]) * 2.0
        want = base_tensors[f"{module_name}.weight"] + delta
        assert torch.equal(_bits(merged["8KB"][f"{module_name}.weight"]), _bits(want)), module_name
