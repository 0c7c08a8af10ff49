"""How much of a merge survives its output dtype, counted block by block in the merge pass from the float32 merge,
the written values and the base, and summed into the report's ``effect`` section (the counts: docs/methods.md).
Nothing here changes a written value."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ram_trl.distributed import DistContext

STEP_SURVIVAL_WARNING = 0.01  #: Below this share of its elements the written value keeps the step, the report warns.

_COUNTS = ("numel", "changed", "rounded_to_base", "step_elements", "step_written")


@dataclass
class MergeEffect:
    """A merge's effect counts summed over blocks (thread-safe :meth:`add`), and its delta's squared L2 norm."""

    numel: int = 0
    changed: int = 0
    rounded_to_base: int = 0
    step_elements: int = 0
    step_written: int = 0
    delta_sq: float = 0.0  # ||float32 merge - base||^2, summed in float64
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, counts: dict[str, float]) -> None:
        """Add one block's counts (:func:`block_effect`)."""
        with self._lock:
            for key, value in counts.items():
                setattr(self, key, getattr(self, key) + value)

    def all_reduce(self, ctx: DistContext) -> None:
        """Sum every rank's counts (no-op in a single process)."""
        if not ctx.enabled:
            return
        for key in _COUNTS:
            setattr(self, key, ctx.all_reduce_int(getattr(self, key)))
        total = torch.tensor([self.delta_sq], dtype=torch.float64)  # host
        self.delta_sq = float(ctx.all_reduce_sum(total)[0])


def block_effect(
    merged: torch.Tensor,
    written: torch.Tensor,
    base: torch.Tensor,
    unstepped: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> dict[str, float]:
    """One block's counts."""
    delta = merged - base
    changed = int(torch.count_nonzero(torch.ne(merged, base)))  # counting bools: faster than floats
    counts: dict[str, float] = {
        "numel": merged.numel(),
        "changed": changed,
        "delta_sq": float(torch.dot(delta, delta)) if delta.dtype == torch.float32 else 0.0,
    }
    if out_dtype != torch.float32:  # unchanged elements are written as the base's value: count the rest
        same = int(torch.count_nonzero(torch.eq(written, base.to(out_dtype))))
        counts["rounded_to_base"] = same - (merged.numel() - changed)
    if unstepped is not None:
        counts["step_elements"] = int(torch.count_nonzero(torch.ne(unstepped, merged)))
        counts["step_written"] = (
            counts["step_elements"]
            if out_dtype == torch.float32
            else int(torch.count_nonzero(torch.ne(unstepped.to(out_dtype), written)))
        )
    return counts


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def effect_report(effect: MergeEffect, method: Any, out_dtypes: list[torch.dtype]) -> dict[str, Any]:
    """The report's ``effect`` section, with ``warning`` (one line, or ``None``)."""
    dtype = ", ".join(sorted({str(d).removeprefix("torch.") for d in out_dtypes})) or "none"
    section: dict[str, Any] = {
        "out_dtype": dtype,
        "elements": effect.numel,
        "changed": effect.changed,
        "rounded_to_base": effect.rounded_to_base,
        "rounded_to_base_share": _share(effect.rounded_to_base, effect.changed),
        "delta_norm": effect.delta_sq**0.5,
        "warning": None,
    }
    if method.unstepped is None or not effect.step_elements:
        return section
    survival = _share(effect.step_written, effect.step_elements)
    section.update(
        step=method.step,
        step_elements=effect.step_elements,
        step_written=effect.step_written,
        step_survival=survival,
        step_written_share=_share(effect.step_written, effect.numel),
    )
    if dtype != "float32" and survival is not None and survival < STEP_SURVIVAL_WARNING:
        section["warning"] = (
            f"{method.name}: its {method.step} changes {effect.step_elements} elements in float32 but the written "
            f"value of only {effect.step_written} ({100 * survival:.2f}%) in the output dtype ({dtype}); "
            "write out_dtype: float32 to keep it"
        )
    return section


def effect_line(section: dict[str, Any]) -> str:
    """The report's ``effect`` section in one line, for the terminal summary and the merge log."""
    rounded = section["rounded_to_base_share"]
    line = (
        f"effect in {section['out_dtype']}: {section['changed']:,} of {section['elements']:,} elements changed in "
        f"float32, {0.0 if rounded is None else 100 * rounded:.2f}% of them written as the base's value"
    )
    if section.get("step"):
        survival = section["step_survival"]
        line += (
            f"; the {section['step']} changes {section['step_elements']:,} elements in float32 and the written value "
            f"of {section['step_written']:,}"
            + (
                ""
                if survival is None
                else f" ({100 * survival:.2f}%, {100 * section['step_written_share']:.2f}% of all)"
            )
        )
    return line


__all__ = ["STEP_SURVIVAL_WARNING", "MergeEffect", "block_effect", "effect_line", "effect_report"]
