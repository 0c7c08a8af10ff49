"""Model Stock: interpolate between the base and the agents' average by how aligned their task vectors are (Jang
et al., 2024). Details: docs/methods.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ram_trl.methods.base import ChunkInputs, MergeMethod, Parameter, TensorView

#: Norm products below it are raised to it (mergekit's clamp).
NORM_FLOOR = 1e-6
#: Where ``|1 + (k - 1) * cos|`` is below it, ``t = 0`` (the base; mergekit's).
SINGULAR = 1e-6


@dataclass(frozen=True)
class StockFactor:
    """The interpolation factor of one tensor.

    Args:
        t: Float32, shape ``(1,)`` (one factor per tensor) or ``(vectors, 1)`` (``filter_wise``: one per vector
            along the last dimension).
        vector: Elements per vector (the last dimension) with ``filter_wise``, else the tensor's size.
    """

    t: torch.Tensor
    vector: int


def stock_factor(count: int, pairs: list[torch.Tensor]) -> torch.Tensor:
    """``t = k * cos / (1 + (k - 1) * cos)`` from the pairwise cosines (mergekit's formula, float32).

    Args:
        count: Number of agents ``k``.
        pairs: Each pair's cosine (shape ``()`` or ``(vectors,)``), in mergekit's pair order.
    """
    cos_theta = torch.stack(pairs).mean(dim=0).unsqueeze(-1)
    denominator = 1 + (count - 1) * cos_theta
    singular = denominator.abs() < SINGULAR
    safe = torch.where(singular, torch.ones_like(denominator), denominator)
    return torch.where(singular, torch.zeros_like(cos_theta), (count * cos_theta) / safe)


def cosine(a: torch.Tensor, b: torch.Tensor, norm_a: torch.Tensor, norm_b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity along the last dimension (reduced), as mergekit: ``sum(a * b) / max(|a| |b|, 1e-6)``,
    clamped to ``[-1, 1]``.

    Args:
        a: One task vector (rows of it, with ``filter_wise``).
        b: The other, same shape.
        norm_a: ``|a|`` along the last dimension.
        norm_b: ``|b|`` along the last dimension.
    """
    return ((a * b).sum(dim=-1) / (norm_a * norm_b).clamp(min=NORM_FLOOR)).clamp(-1, 1)


def prepare(view: TensorView) -> StockFactor:
    """Model Stock's per-tensor preparation hook: the tensor's factor ``t`` (two task vectors in memory at a time)."""
    filter_wise = view.params["filter_wise"]
    shape = view.shape if filter_wise and len(view.shape) >= 2 else (1, view.numel) if filter_wise else (view.numel,)
    base = view.base()

    def offset(t: int) -> torch.Tensor:
        return view.model(t).sub_(base).reshape(shape)

    count = view.num_agents
    norms: list[torch.Tensor] = []
    pairs: list[torch.Tensor] = []
    for i in range(count):
        a = offset(i)
        if i == len(norms):
            norms.append(torch.norm(a, dim=-1))
        for j in range(i + 1, count):
            b = offset(j)
            if j == len(norms):
                norms.append(torch.norm(b, dim=-1))
            pairs.append(cosine(a, b, norms[i], norms[j]))
            del b
        del a
    return StockFactor(stock_factor(count, pairs).reshape(-1, 1), shape[-1] if filter_wise else view.numel)


def merge(inputs: ChunkInputs) -> torch.Tensor:
    """Model Stock's chunk kernel: ``t * mean(models) + (1 - t) * base``, the merged weights of the chunk."""
    if inputs.prepared is None or inputs.models is None:
        raise RuntimeError(f"{inputs.name}: Model Stock needs the tensor's factor and the models' weights")
    factor: StockFactor = inputs.prepared
    models = inputs.models
    average = models[0] + 0  # as mergekit's sum(): 0 + w_1 (-0.0 becomes +0.0), then + w_2 ...
    for row in models[1:]:
        average += row
    average /= models.shape[0]
    n = inputs.base.numel()
    if factor.t.shape[0] == 1:
        t = factor.t.reshape(1)
        return t * average + (1 - t) * inputs.base
    first = inputs.start // factor.vector
    t = factor.t[first : first + n // factor.vector]
    shape = (-1, factor.vector)
    return (t * average.reshape(shape) + (1 - t) * inputs.base.reshape(shape)).reshape(-1)


MODEL_STOCK = MergeMethod(
    name="model_stock",
    pretty_name="Model Stock",
    description="t * mean of the models + (1 - t) * base, t from the task vectors' mean pairwise cosine",
    parameters=(
        Parameter(
            "filter_wise",
            bool,
            False,
            "global",
            "one factor per vector along the last dimension (per row) instead of per tensor",
        ),
    ),
    merge=merge,
    prepare_tensor=prepare,
    merges_weights=True,
    agents=(2, None),
    prepare_bytes=20,  # the base, two task vectors, their product, one agent's stored values
    reference="https://arxiv.org/abs/2403.19522",
)
