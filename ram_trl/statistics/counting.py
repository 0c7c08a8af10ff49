"""The counting maths below both the statistics and the merge methods (so neither imports the other): active elements
(``|tau| > eps``, strict, exact in float32), which agents update each element, the Overlap-Unique Ratio and the
RAM+ / RAM+s factors, and the exact ``k`` of magnitude trimming."""

from __future__ import annotations

import functools
import math
from decimal import Decimal

import numpy as np
import torch
import torch.nn.functional as F

from ram_trl import defaults

DEFAULT_EPS = defaults.EPS

#: Elements per block of the magnitude histograms of :func:`ram_trl.methods.ties.kth_largest_bits` and of the
#: magnitudes the merge fills for them (bounds their temporaries).
HISTOGRAM_BLOCK = 1 << 20


def float32_threshold(eps: float) -> float:
    """The largest float32 value not above ``eps``: for float32 ``x``, ``|x| > eps`` (exactly, as reals) iff
    ``|x| > float32_threshold(eps)``. ``eps`` rounded to nearest is wrong when it rounds up (``0.1``)."""
    value = np.float32(eps)
    if float(value) > eps:
        value = np.nextafter(value, np.float32(-np.inf))
    return float(value)


def active_mask(deltas: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Mask of active task-vector elements, ``|tau| > eps`` (strict; NaN is inactive)."""
    threshold = float32_threshold(eps)
    return (deltas > threshold) | (deltas < -threshold)


def active_flags(deltas: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """:func:`active_mask` as float32 ``1.0`` / ``0.0`` (NaN inactive): on the CPU, comparisons that write floats run
    several times faster than ones that write bools, and the flags feed :func:`subset_codes` directly."""
    return deltas.abs().gt_(float32_threshold(eps))


def masked_deltas(deltas: torch.Tensor, eps: float = DEFAULT_EPS, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The task vectors with inactive elements (``|tau| <= eps``) set to 0, as a new tensor (or in ``out``)."""
    if out is not None:
        return torch.hardshrink(deltas, float32_threshold(eps), out=out)
    return F.hardshrink(deltas, float32_threshold(eps))


def overlap_counts(mask: torch.Tensor) -> torch.Tensor:
    """Number of active agents per element, ``c = sum_t m_t``."""
    dtype = torch.uint8 if mask.shape[0] < 256 else torch.int32
    # one reduction, not one operation per agent (as fast at a few agents, far fewer calls at many)
    return mask.view(torch.uint8).sum(dim=0, dtype=dtype)


def overlap_unique_ratio(shared: int, unique: int) -> float:
    """The Overlap-Unique Ratio ``rho_t = shared_t / unique_t`` (eq. 2): ``inf`` with shared but no unique elements,
    0 with no active element (no unique element for the factor to act on)."""
    if unique > 0:
        return shared / unique
    return math.inf if shared > 0 else 0.0


def rescale_factor(rho: float, r: float, alpha: float) -> float:
    """RAM+ rescale factor ``lambda_t = 1 + r * clip(rho_t, 0, alpha)`` (eq. 6); RAM is ``r = 0``."""
    return 1.0 + r * min(max(rho, 0.0), alpha)


def soft_rescale_factor(rho: float, r: float) -> float:
    """RAM+s rescale factor ``lambda_t = 1 + r * rho_t / (1 + rho_t)`` (appendix E, eq. 8); ``rho = inf`` gives ``1 + r``."""
    saturation = 1.0 if math.isinf(rho) else rho / (1.0 + rho)
    return 1.0 + r * saturation


def subset_codes(mask: torch.Tensor) -> torch.Tensor:
    """Per element, the set of active agents as a bit field (bit ``t`` set when agent ``t`` is active)."""
    num_agents = mask.shape[0]
    dtype = torch.uint8 if num_agents <= 8 else torch.int32
    # sum_t 2**t * m_t: whole numbers below 2**24 (2**53), so the float32 (float64) dot product is exact
    exact = torch.float32 if num_agents <= 24 else torch.float64
    return (_code_weights(num_agents, exact, mask.device) @ mask.to(exact)).to(dtype)


@functools.lru_cache(maxsize=64)
def _code_weights(num_agents: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.pow(2.0, torch.arange(num_agents, dtype=dtype, device=device))


def keep_count(numel: int, density: float) -> int:
    """Number of elements kept by magnitude trimming at ``density``."""
    if density >= 1:
        return numel
    if density <= 0 or numel == 0:
        return 0
    return max(1, math.floor(Decimal(repr(float(density))) * numel))


__all__ = [
    "DEFAULT_EPS",
    "HISTOGRAM_BLOCK",
    "active_flags",
    "active_mask",
    "float32_threshold",
    "keep_count",
    "masked_deltas",
    "overlap_counts",
    "overlap_unique_ratio",
    "rescale_factor",
    "soft_rescale_factor",
    "subset_codes",
]
