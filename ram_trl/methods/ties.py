"""TIES merging: magnitude trimming, sign election, disjoint mean (Yadav et al., 2023).

Trimming keeps exactly ``k = floor(density * numel)`` elements per tensor and agent (at least one when
``0 < density < 1``), ``k`` computed exactly from the decimal ``density`` as written. Among elements whose magnitude
equals the k-th largest, the ones with the lowest flat index are kept, so the result is deterministic and the same
whether a tensor is processed whole or in row chunks (:func:`magnitude_trim` carries the count of ties seen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

import torch


def keep_count(numel: int, density: float) -> int:
    """Number of elements kept by magnitude trimming at ``density``.

    Args:
        numel: Elements in the tensor.
        density: Fraction to keep; ``>= 1`` keeps all, ``<= 0`` keeps none.

    Returns:
        ``max(1, floor(density * numel))`` for ``0 < density < 1``, computed in exact decimal arithmetic on the
        shortest decimal form of ``density`` (so ``0.29`` of 100 elements keeps 29, not 28).
    """
    if density >= 1:
        return numel
    if density <= 0 or numel == 0:
        return 0
    return max(1, math.floor(Decimal(repr(float(density))) * numel))


@dataclass(frozen=True)
class MagnitudeCut:
    """Where magnitude trimming cuts one tensor of one agent.

    Args:
        threshold: The k-th largest magnitude; every element above it is kept.
        keep_equal: How many elements equal to ``threshold`` are kept, lowest flat index first.
        keep_all: Keep every element (``density >= 1``).
    """

    threshold: float
    keep_equal: int
    keep_all: bool = False


def magnitude_cut(magnitudes: torch.Tensor, k: int) -> MagnitudeCut:
    """Find the cut that keeps the ``k`` largest of ``magnitudes`` (a flat float tensor).

    Args:
        magnitudes: ``|tau|`` of one whole tensor, flattened.
        k: Elements to keep (see :func:`keep_count`).

    Returns:
        The :class:`MagnitudeCut`.
    """
    n = magnitudes.numel()
    if k >= n:
        return MagnitudeCut(threshold=0.0, keep_equal=0, keep_all=True)
    if k <= 0:
        return MagnitudeCut(threshold=math.inf, keep_equal=0)
    value = torch.kthvalue(magnitudes, n - k + 1).values
    above = int((magnitudes > value).sum())
    return MagnitudeCut(threshold=float(value), keep_equal=k - above)


def magnitude_trim(delta: torch.Tensor, cut: MagnitudeCut, equal_seen: int = 0) -> tuple[torch.Tensor, int]:
    """Zero every element of a chunk of one agent's task vector that the cut drops.

    Args:
        delta: A row chunk of one tensor's task vector (any shape), float32. Modified in place.
        cut: The tensor's cut from :func:`magnitude_cut`.
        equal_seen: Elements equal to the threshold in earlier chunks of the same tensor.

    Returns:
        ``(delta, equal_in_chunk)``: the trimmed chunk and the number of threshold-equal elements it held.
    """
    if cut.keep_all:
        return delta, 0
    magnitudes = delta.abs()
    keep = magnitudes > cut.threshold
    equal = magnitudes == cut.threshold
    equal_in_chunk = int(equal.sum())
    if equal_in_chunk:
        rank = torch.cumsum(equal.reshape(-1), dim=0).reshape(equal.shape) + equal_seen
        keep |= equal & (rank <= cut.keep_equal)
    return delta.mul_(keep), equal_in_chunk


def elect_sign(weighted: torch.Tensor) -> torch.Tensor:
    """Elected sign per element: the sign of the sum of the (weighted, trimmed) values; a zero sum elects ``+1``."""
    return torch.where(weighted.sum(dim=0) >= 0, 1.0, -1.0).to(weighted.dtype)


def disjoint_merge(
    deltas: torch.Tensor, weights: torch.Tensor, scale: float = 1.0, normalize: bool = True
) -> torch.Tensor:
    """Sign election and disjoint mean over already trimmed (or dropped) task vectors.

    Args:
        deltas: Float32 task vectors of shape ``(num_agents, n)``; entries that trimming removed are 0.
        weights: Per-agent weights, applied before the sign election.
        scale: The global scaling term ``lambda``.
        normalize: Divide by the summed weights of the agents that agree with the elected sign (the disjoint mean);
            otherwise sum the agreeing weighted values.

    Returns:
        The merged task vector, shape ``(n,)``.
    """
    column = weights.to(deltas.dtype).unsqueeze(-1)
    weighted = deltas.mul_(column)
    agree = torch.sign(weighted) == elect_sign(weighted)
    merged = (weighted * agree).sum(dim=0)
    if normalize:
        divisor = (column * agree).sum(dim=0)
        divisor[divisor == 0] = 1
        merged.div_(divisor)
    if scale != 1.0:
        merged.mul_(scale)
    return merged
