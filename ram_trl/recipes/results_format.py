"""How results.md, the verdict and the terminal table write numbers (pure functions of numbers to text)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ci", "fmt3", "fmt_rho", "pct", "pct_ci", "value_range"]


def fmt3(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def ci(value: float | None, interval: Any, spec: str = ".3f") -> str:
    """A value and its interval, ``0.500 [0.400, 0.600]``; ``-`` without a value."""
    if value is None:
        return "-"
    text = format(value, spec)
    if interval:
        text += f" [{format(interval[0], spec)}, {format(interval[1], spec)}]"
    return text


def pct_ci(value: float | None, interval: Any) -> str:
    """A share as a whole percentage with its interval: ``50% [40%, 60%]``; ``undefined`` when there is none."""
    if value is None:
        return "undefined"
    text = f"{100 * value:.0f}%"
    if interval:
        text += f" [{100 * interval[0]:.0f}%, {100 * interval[1]:.0f}%]"
    return text


def value_range(values: list[float | None], scale: float = 1.0, spec: str = ".0f", unit: str = "") -> str | None:
    """The range of the defined, finite values, scaled: ``5-15%``, or one value when both ends print the same."""
    present = [scale * v for v in values if v is not None and not math.isinf(v)]
    if not present:
        return None
    low, high = min(present), max(present)
    if format(low, spec) == format(high, spec):
        return f"{format(low, spec)}{unit}"
    return f"{format(low, spec)}-{format(high, spec)}{unit}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def fmt_rho(value: float | str | None) -> str:
    """RAM+'s rho with three significant digits, ``inf`` for an agent without unique elements, ``-`` for none."""
    if value is None:
        return "-"
    value = float(value)
    return "inf" if value == float("inf") else f"{value:.3g}"
