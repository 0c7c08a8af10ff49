"""The epilogue of the merge kernels after the method's ``merge`` hook (base added back, signed zeros kept, overflow
refused, rounding to the output dtype), shared by the merge-and-write pass and the range merge."""

from __future__ import annotations

import dataclasses
import math

import torch

from ram_trl.errors import NonFiniteError
from ram_trl.merging.config.settings import ResolvedConfig
from ram_trl.methods import ChunkInputs
from ram_trl.statistics.effect import MergeEffect, block_effect

_NEGATIVE_ZERO_BITS = -(2**31)  # float32 -0.0 viewed as int32


def kernel_output(
    resolved: ResolvedConfig,
    inputs: ChunkInputs,
    out_dtype: torch.dtype,
    rows: tuple[int, int],
    out: torch.Tensor | None = None,
    effect: MergeEffect | None = None,
) -> torch.Tensor:
    """Run the method's kernel on one block and return the merged weights in ``out_dtype``: the merged task vector
    added to the base (signed zeros kept), overflow refused, rounded to ``out_dtype`` as ``Tensor.to`` rounds;
    ``effect`` counts how much of the merge survives ``out_dtype`` (the written values are the same without it)."""
    method = resolved.method
    unstepped = None
    if effect is not None and method.unstepped is not None:
        unstepped = method.unstepped(unstepped_inputs(inputs))
        if unstepped is not None:
            unstepped.add_(inputs.base)
    merged = method.merge(inputs)
    if not method.merges_weights:
        merged.add_(inputs.base)
        keep_signed_zeros(merged, inputs.base)
    if not resolved.allow_nonfinite:
        check_finite_output(merged, inputs.name, *rows)
    result = merged.to(out_dtype) if out is None else out.copy_(merged)  # copy_ rounds as .to() does
    if out_dtype == torch.float16 and not resolved.allow_nonfinite:  # the one narrower range than float32
        check_finite_output(result, inputs.name, *rows, " in float16 (|x| > 65504)")
    if effect is not None:
        effect.add(block_effect(merged, result, inputs.base, unstepped, out_dtype))
    return result


def unstepped_inputs(inputs: ChunkInputs) -> ChunkInputs:
    """A copy of a block's kernel inputs the ``unstepped`` hook may modify (the kernel still sees the originals)."""
    return dataclasses.replace(inputs, deltas=inputs.deltas.clone(), seen=list(inputs.seen))


def keep_signed_zeros(merged: torch.Tensor, base_values: torch.Tensor) -> None:
    """Give merged elements that are zero where the base is zero the base's own zero (``-0.0`` stays ``-0.0``)."""
    if base_values.dtype != torch.float32 or int(base_values.view(torch.int32).min()) != _NEGATIVE_ZERO_BITS:
        return  # -0.0 is the smallest int32 bit pattern: no -0.0 in this block
    zero = (merged == 0) & (base_values == 0)
    torch.where(zero, base_values, merged, out=merged)


def check_finite_output(merged: torch.Tensor, name: str, start: int, stop: int, where: str = "") -> None:
    """Refuse merged values that overflowed (every input was finite: the parameters scaled them too far)."""
    if math.isfinite(float(merged.sum(dtype=torch.float32))):
        return
    bad = int((~torch.isfinite(merged)).sum())
    if bad:
        raise NonFiniteError(
            f"tensor {name!r}: {bad} merged values overflow{where or ' float32'} (rows {start}:{stop}); the inputs "
            "are finite, so the weights / lambda / r scale the task vectors too far (or the output dtype is too "
            "narrow): use smaller values or another out_dtype"
        )


__all__ = ["check_finite_output", "keep_signed_zeros", "kernel_output"]
