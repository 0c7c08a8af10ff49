"""SLERP: spherical linear interpolation between the base model and one other model, tensor by tensor.
Details: docs/methods.md."""

from __future__ import annotations

import torch

from ram_trl.methods.base import ChunkInputs, MergeMethod, Parameter, TensorView

#: Above this ``|cos theta|`` the two tensors count as (anti)parallel and are interpolated linearly (mergekit's).
DOT_THRESHOLD = 0.9995
#: Norms at or below it count as zero (the tensor is then not normalised), as mergekit.
NORM_EPS = 1e-8
#: Elements per part of the norms and the dot product (mergekit's ``_CHUNK_ELEMENTS``; it fixes the float32
#: summation order).
PART = 1 << 20


def slerp_coefficients(
    a: torch.Tensor, b: torch.Tensor, t: float, dot_threshold: float = DOT_THRESHOLD, eps: float = NORM_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The coefficients ``(c_a, c_b)`` with ``slerp(a, b, t) = c_a * a + c_b * b``, float32, shape ``(1, 1)``.

    Args:
        a: The base's values of one tensor, float32, flat.
        b: The other model's values of the same tensor, float32, flat.
        t: Interpolation factor: 0 gives ``a``, 1 gives ``b``.
        dot_threshold: ``|cos theta|`` above which the interpolation is linear.
        eps: Norms at or below it are treated as 1 (the tensor is not normalised).

    Example:
        >>> a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
        >>> c_a, c_b = slerp_coefficients(a, b, 0.5)
        >>> (c_a * a + c_b * b).reshape(-1)  # the unit vector halfway round the quarter circle
        tensor([0.7071, 0.7071])
    """
    a, b = a.reshape(1, -1), b.reshape(1, -1)
    factor = torch.tensor(float(t), device=a.device).reshape(-1, 1).to(torch.float32)
    if not a.shape[1]:
        return 1 - factor, factor
    parts = range(0, a.shape[1], PART)
    norm_a = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(a[:, s : s + PART], dim=1, keepdim=True) for s in parts]), dim=0
    )
    norm_b = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(b[:, s : s + PART], dim=1, keepdim=True) for s in parts]), dim=0
    )
    norm_a = torch.where(norm_a > eps, norm_a, 1)
    norm_b = torch.where(norm_b > eps, norm_b, 1)
    dots = [((a[:, s : s + PART] / norm_a) * (b[:, s : s + PART] / norm_b)).sum(dim=1, keepdim=True) for s in parts]
    dot = torch.stack(dots).sum(dim=0).clamp(-1, 1)
    linear = dot.abs() > dot_threshold
    theta = torch.acos(torch.where(linear, 0, dot))
    sin_theta = torch.sin(theta)
    coef_a = torch.where(linear, 1 - factor, torch.sin((1 - factor) * theta) / sin_theta)
    coef_b = torch.where(linear, factor, torch.sin(factor * theta) / sin_theta)
    return coef_a, coef_b


def prepare(view: TensorView) -> tuple[torch.Tensor, torch.Tensor]:
    """SLERP's per-tensor preparation hook: the tensor's two coefficients (:func:`slerp_coefficients`)."""
    return slerp_coefficients(view.base(), view.model(0), view.params["t"])


def merge(inputs: ChunkInputs) -> torch.Tensor:
    """SLERP's chunk kernel: ``c_a * base + c_b * model``, the merged weights of the chunk."""
    if inputs.prepared is None or inputs.models is None:
        raise RuntimeError(f"{inputs.name}: SLERP needs the tensor's coefficients and the model's weights")
    coef_a, coef_b = inputs.prepared
    return (coef_a * inputs.base + coef_b * inputs.models[0]).reshape(-1)


SLERP = MergeMethod(
    name="slerp",
    pretty_name="SLERP",
    description="spherical interpolation from the base (t = 0) to one other model (t = 1), per tensor",
    parameters=(
        Parameter(
            "t",
            float,
            0.5,
            "global",
            "interpolation factor: 0 keeps the base, 1 the other model (mergekit filter rules per tensor)",
            minimum=0.0,
            maximum=1.0,
            per_tensor=True,
        ),
    ),
    merge=merge,
    prepare_tensor=prepare,
    merges_weights=True,
    agents=(1, 1),
    reference="https://en.wikipedia.org/wiki/Slerp",
)
