"""The maths of the LoRA export: rank options, and ``delta ~ B @ A`` with ``B = U_r sqrt(S_r)`` (out x r) and
``A = sqrt(S_r) Vh_r`` (r x in), computed in float64, stored in float32 (``lora_alpha = r``, scaling 1;
docs/lora.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ram_trl.errors import ConfigError

OUTPUT_FORMATS = ("full", "lora")
#: Rows of the delta compared with ``B @ A`` at a time are about this many float64 bytes.
ERROR_BLOCK_BYTES = 64 * 1024 * 1024


# ---------------------------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class LoraExportOptions:
    """How the rank of each LoRA factorisation is chosen."""

    rank: int | None = None
    max_rank: int | None = None
    energy: float | None = None

    @property
    def mode(self) -> str:
        return "rank" if self.rank is not None else "energy"

    @property
    def cap(self) -> int:
        """The config's ``r``: the fixed rank, or the largest rank allowed."""
        value = self.rank if self.rank is not None else self.max_rank
        assert value is not None
        return value

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "rank": self.rank, "max_rank": self.max_rank, "energy": self.energy}


def _positive_int(value: Any, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{flag} must be an integer >= 1, got {value!r}")
    return value


def lora_options(
    output_format: str = "full", rank: int | None = None, max_rank: int | None = None, energy: float | None = None
) -> LoraExportOptions | None:
    """Validate the output options of :func:`ram_trl.merge` before any work starts."""
    if output_format not in OUTPUT_FORMATS:
        raise ConfigError(f"--output-format must be one of {list(OUTPUT_FORMATS)}, got {output_format!r}")
    given = {"--rank": rank, "--max-rank": max_rank, "--energy": energy}
    if output_format == "full":
        used = [flag for flag, value in given.items() if value is not None]
        if used:
            raise ConfigError(
                f"{' and '.join(used)} {'applies' if len(used) == 1 else 'apply'} only to --output-format lora "
                "(output_format='lora'); the output format is 'full'"
            )
        return None
    if rank is not None and (max_rank is not None or energy is not None):
        raise ConfigError(
            "--output-format lora takes either --rank R (one rank for every module) or --max-rank R --energy E "
            "(per-module rank by singular-value energy), not both"
        )
    if rank is not None:
        return LoraExportOptions(rank=_positive_int(rank, "--rank"))
    if max_rank is None and energy is None:
        raise ConfigError(
            "--output-format lora needs --rank R, or --max-rank R with --energy E (the smallest rank keeping the "
            "share E of each delta's squared singular values, at most R)"
        )
    if max_rank is None:
        raise ConfigError("--energy needs --max-rank R (the largest rank a module may get)")
    max_rank = _positive_int(max_rank, "--max-rank")
    if energy is None:
        raise ConfigError("--max-rank needs --energy E, 0 < E <= 1 (or use --rank R for a fixed rank)")
    if isinstance(energy, bool) or not isinstance(energy, int | float) or not 0.0 < float(energy) <= 1.0:
        raise ConfigError(f"--energy must be a number in (0, 1], got {energy!r}")
    return LoraExportOptions(max_rank=max_rank, energy=float(energy))


# ---------------------------------------------------------------------------------------------------------------
# The SVD


def choose_rank(singular_values: torch.Tensor, options: LoraExportOptions) -> int:
    """The rank kept for a delta with these singular values (descending)."""
    n = singular_values.numel()
    if options.rank is not None:
        return max(1, min(options.rank, n))
    assert options.energy is not None and options.max_rank is not None
    cumulative = singular_values.to(torch.float64).square().cumsum(0)
    total = float(cumulative[-1]) if n else 0.0
    if total <= 0.0:
        return 1
    target = torch.tensor([options.energy * total], dtype=torch.float64, device=cumulative.device)
    k = int(torch.searchsorted(cumulative, target)) + 1
    return max(1, min(k, options.max_rank, n))


@dataclass
class Factorization:
    """``delta ~ b @ a`` in float32, with the rank, the share of ``sigma**2`` kept and the relative error."""

    a: torch.Tensor
    b: torch.Tensor
    rank: int
    energy_kept: float
    relative_error: float


def factorize(delta: torch.Tensor, options: LoraExportOptions) -> Factorization:
    """Truncated float64 SVD of a 2-D delta into float32 LoRA factors (scaling 1)."""
    d = delta.to(torch.float64)
    wide = d.shape[0] < d.shape[1]
    q, r = torch.linalg.qr(d.T if wide else d)  # tall = q @ r, r square
    u_r, s, vh = torch.linalg.svd(r)  # tall = (q @ u_r) diag(s) vh
    del r
    k = choose_rank(s, options)
    left = q @ u_r[:, :k]
    del q, u_r
    u, v = (vh[:k].T, left) if wide else (left, vh[:k].T)  # delta = u diag(s) v.T
    root = s[:k].sqrt()
    b = (u * root).to(torch.float32)
    a = (root[:, None] * v.T).to(torch.float32)
    del u, v, left
    squares = s.square()
    total = float(squares.sum())
    kept = float(squares[:k].sum()) / total if total > 0 else 1.0
    return Factorization(a, b, k, kept, relative_error(d, b, a))


def relative_error(delta: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> float:
    """``||delta - b @ a||_F / ||delta||_F`` in float64, a block of rows at a time."""
    a64 = a.to(torch.float64)
    rows, cols = delta.shape
    block = max(1, ERROR_BLOCK_BYTES // max(1, cols * 8))
    residual = 0.0
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        diff = delta[start:stop].to(torch.float64) - b[start:stop].to(torch.float64) @ a64
        residual += float(diff.square().sum())
    norm = float(delta.to(torch.float64).square().sum())
    return math.sqrt(residual / norm) if norm > 0 else 0.0


__all__ = ["Factorization", "LoraExportOptions", "choose_rank", "factorize", "lora_options", "relative_error"]
