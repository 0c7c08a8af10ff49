"""ram_trl/merging/lora/svd.py: the LoRA export's option validation, rank choice and truncated SVD, on small real tensors."""

from __future__ import annotations

import math

import pytest
import torch

from ram_trl.errors import ConfigError
from ram_trl.merging.lora.svd import LoraExportOptions, choose_rank, factorize, lora_options, relative_error

# ---------------------------------------------------------------------------------------------------------------
# Options


def test_full_output_has_no_lora_options():
    assert lora_options() is None
    assert lora_options("full") is None


def test_fixed_rank_options():
    options = lora_options("lora", rank=4)
    assert options == LoraExportOptions(rank=4)
    assert (options.mode, options.cap) == ("rank", 4)
    assert options.as_dict() == {"mode": "rank", "rank": 4, "max_rank": None, "energy": None}


def test_energy_options_store_a_float():
    options = lora_options("lora", max_rank=8, energy=1)
    assert options == LoraExportOptions(max_rank=8, energy=1.0)
    assert isinstance(options.energy, float)
    assert (options.mode, options.cap) == ("energy", 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"output_format": "dense"}, "--output-format must be one of ['full', 'lora'], got 'dense'"),
        ({"output_format": "lora", "rank": 2, "energy": 0.9}, "either --rank R"),
        ({"output_format": "lora"}, "--output-format lora needs --rank R"),
        ({"output_format": "lora", "max_rank": 4}, "--max-rank needs --energy E"),
        ({"output_format": "lora", "rank": True}, "--rank must be an integer >= 1, got True"),
        ({"output_format": "lora", "max_rank": 0, "energy": 0.5}, "--max-rank must be an integer >= 1, got 0"),
        ({"output_format": "lora", "max_rank": 4, "energy": 0.0}, "--energy must be a number in (0, 1], got 0.0"),
        ({"output_format": "lora", "max_rank": 4, "energy": "0.5"}, "--energy must be a number in (0, 1]"),
    ],
)
def test_bad_options_name_the_flag(kwargs, message):
    # the merge()-level spellings (lora_rank=...) are checked in tests/merging/lora/test_export.py
    with pytest.raises(ConfigError) as info:
        lora_options(**kwargs)
    assert message in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# Rank choice


@pytest.mark.parametrize(
    ("energy", "max_rank", "expected"),
    [(0.5, 8, 1), (0.64, 8, 1), (0.65, 8, 2), (0.9, 8, 2), (0.93, 8, 3), (1.0, 8, 3), (0.95, 2, 2)],
)
def test_energy_rank_by_hand(energy, max_rank, expected):
    # S = [3, 2, 1, 0, 0]: sigma^2 shares 9/14 = 0.643, 13/14 = 0.929, 14/14
    singular_values = torch.tensor([3.0, 2.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    options = LoraExportOptions(max_rank=max_rank, energy=energy)
    assert choose_rank(singular_values, options) == expected


def test_fixed_rank_is_capped_by_the_matrix():
    assert choose_rank(torch.ones(4, dtype=torch.float64), LoraExportOptions(rank=16)) == 4
    assert choose_rank(torch.ones(4, dtype=torch.float64), LoraExportOptions(rank=2)) == 2


def test_zero_delta_keeps_rank_one():
    assert choose_rank(torch.zeros(5, dtype=torch.float64), LoraExportOptions(max_rank=4, energy=0.9)) == 1


# ---------------------------------------------------------------------------------------------------------------
# The SVD


@pytest.mark.parametrize("shape", [(48, 20), (20, 48), (24, 24)])
@pytest.mark.parametrize("rank", [1, 7])
def test_factorize_equals_the_truncated_svd(shape, rank):
    delta = torch.randn(*shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    result = factorize(delta, LoraExportOptions(rank=rank))
    assert (result.b.shape, result.a.shape) == ((shape[0], rank), (rank, shape[1]))
    assert (result.a.dtype, result.b.dtype, result.rank) == (torch.float32, torch.float32, rank)
    truncated = (u[:, :rank] * s[:rank]) @ vh[:rank]
    torch.testing.assert_close((result.b @ result.a).double(), truncated, rtol=0, atol=1e-6)
    expected = math.sqrt(float((s[rank:] ** 2).sum() / (s**2).sum()))
    assert result.relative_error == pytest.approx(expected, rel=1e-6)
    assert result.energy_kept == pytest.approx(1 - expected**2, rel=1e-9)


def test_factorize_a_diagonal_by_hand():
    # diag(3, 2, 1): rank 2 keeps 3 and 2; energy (9 + 4) / 14, error sqrt(1 / 14)
    delta = torch.diag(torch.tensor([3.0, 2.0, 1.0]))
    result = factorize(delta, LoraExportOptions(rank=2))
    torch.testing.assert_close(result.b @ result.a, torch.diag(torch.tensor([3.0, 2.0, 0.0])), rtol=0, atol=1e-6)
    assert result.energy_kept == pytest.approx(13 / 14, rel=1e-12)
    assert result.relative_error == pytest.approx(math.sqrt(1 / 14), rel=1e-6)


def test_relative_error_by_hand(monkeypatch):
    delta = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    b = torch.tensor([[1.0], [0.0]])
    a = torch.tensor([[3.0, 0.0]])
    # residual [[0, 0], [0, 4]]: sqrt(16 / 25)
    assert relative_error(delta, b, a) == pytest.approx(0.8, rel=1e-15)
    monkeypatch.setattr("ram_trl.merging.lora.svd.ERROR_BLOCK_BYTES", 1)  # one row per block: the same sum
    assert relative_error(delta, b, a) == pytest.approx(0.8, rel=1e-15)
    assert relative_error(torch.zeros(2, 2), b, a) == 0.0
