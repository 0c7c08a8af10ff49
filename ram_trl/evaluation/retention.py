"""Retention ``(merge - base) / (specialist - base)`` and its mean over verticals (docs/recipes-results.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["MIN_GAIN", "mean_retention", "retention"]

MIN_GAIN = 0.02  #: Smallest specialist gain over the base (absolute) for which retention is defined by default.


def retention(merge: float, base: float, specialist: float, min_gain: float = MIN_GAIN) -> float | None:
    """``(merge - base) / (specialist - base)``; ``None`` unless the specialist gained at least ``min_gain`` (> 0)."""
    gain = specialist - base
    if not gain > 0 or gain < min_gain - 1e-12:  # a gain of exactly min_gain counts (up to rounding)
        return None
    return (merge - base) / gain


def mean_retention(values: Mapping[str, float | None] | Sequence[float | None]) -> float | None:
    """Mean of the defined (not ``None``) retentions; ``None`` when none is defined."""
    items = list(values.values()) if isinstance(values, Mapping) else list(values)
    defined = [v for v in items if v is not None]
    return math.fsum(defined) / len(defined) if defined else None
