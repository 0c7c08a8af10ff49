"""SCE: select, calculate, erase (Wan et al., 2024, "FuseChat"), as mergekit 0.1.5's ``sce`` (docs/methods.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ram_trl.methods.base import ChunkInputs, MergeMethod, Parameter, TensorView
from ram_trl.methods.parameters import INT8_MASK

#: Weight sums below it give every agent the weight ``1 / k`` (mergekit's).
WEIGHT_FLOOR = 1e-6
#: The divisor ``sum_t w_t`` of an element is raised to at least this (mergekit's clamp).
DIVISOR_FLOOR = 1e-6


@dataclass(frozen=True)
class SceTensor:
    """SCE's preparation of one tensor.

    Args:
        keep: Flat boolean mask of the selected elements (``None``: every element, ``select_topk >= 1``).
        weights: Float32 agent weights ``w_t``, shape ``(k, 1)``.
    """

    keep: torch.Tensor | None
    weights: torch.Tensor


def select_mask(taus: torch.Tensor, select_topk: float) -> torch.Tensor:
    """Boolean mask, shape ``(n,)``, of the elements with the largest variance across agents (step 1).

    Args:
        taus: Float32 task vectors, shape ``(k, n)``.
        select_topk: Fraction of the elements with a nonzero variance kept, in ``[0, 1)``.
    """
    if select_topk <= 0:
        return torch.zeros(taus.shape[1], dtype=torch.bool, device=taus.device)
    variance = torch.var(taus, dim=0, unbiased=False)
    # mergekit's k: int(count * select_topk) in float32 tensor arithmetic
    count = int(torch.count_nonzero(variance) * select_topk)
    if count == 0:
        return torch.zeros_like(variance, dtype=torch.bool)
    magnitudes = variance.abs()
    cut = torch.topk(magnitudes, count, largest=True, sorted=False).values.min()
    keep = magnitudes > cut
    missing = count - int(keep.sum())
    if missing > 0:
        equal = torch.nonzero(magnitudes == cut).reshape(-1)[:missing]
        keep[equal] = True
    return keep


def sce_weights(taus: torch.Tensor) -> torch.Tensor:
    """The agents' float32 weights ``w_t``, shape ``(k, 1)`` (step 2), as mergekit: each task vector's mean square,
    normalised.

    Args:
        taus: Float32 (selected) task vectors, shape ``(k, n)``.
    """
    weights = taus.square().mean(dim=1)
    total = torch.sum(weights).item()
    if abs(total) < WEIGHT_FLOOR:
        return (torch.ones_like(weights) / weights.shape[0]).unsqueeze(-1)
    return (weights / total).unsqueeze(-1)


def prepare(view: TensorView) -> SceTensor:
    """SCE's per-tensor preparation hook: the selection and the agents' weights (every task vector in memory)."""
    base = view.base()
    taus = torch.stack([view.model(t).sub_(base) for t in range(view.num_agents)])
    keep = None
    if view.params["select_topk"] < 1:
        keep = select_mask(taus, view.params["select_topk"])
        taus *= keep
    return SceTensor(keep, sce_weights(taus))


def merge(inputs: ChunkInputs) -> torch.Tensor:
    """SCE's chunk kernel: the selection, sign election and weighted disjoint mean (step 3) of one chunk."""
    if inputs.prepared is None:
        raise RuntimeError(f"{inputs.name}: SCE needs the tensor's selection and weights")
    prepared: SceTensor = inputs.prepared
    taus = inputs.deltas
    if prepared.keep is not None:
        taus *= prepared.keep[inputs.start : inputs.start + taus.shape[1]]
    elected = (taus.sum(dim=0) >= 0).to(taus.dtype) * 2 - 1
    agree = taus.sign() == elected
    weights = prepared.weights.to(taus.device) * agree
    return (taus * weights).sum(dim=0) / torch.sum(weights, dim=0).clamp(min=DIVISOR_FLOOR)


def prepare_bytes(num_agents: int) -> int:
    """Bytes per element of a tensor that :func:`prepare` holds at once, ``max(8k + 5, 4k + 25) + 4`` (the planner's
    estimate, checked against the measured peak in the tests).

    Two phases peak: the stacked float32 task vectors with either their float32 copies being stacked or their
    squares for the weights (``8k``), beside the base and the mask (5); or the stack with the base, the variance, the
    magnitudes, the top-k values and indices (up to 12) and the mask (``4k + 25``). Plus one agent's stored values
    being read (up to 4).

    Args:
        num_agents (`int`): The agents ``k``.
    """
    return max(8 * num_agents + 5, 4 * num_agents + 25) + 4


SCE = MergeMethod(
    name="sce",
    pretty_name="SCE",
    description="keep the elements of highest variance across agents, weight agents by mean square, "
    "sign election and weighted disjoint mean",
    parameters=(
        Parameter(
            "select_topk",
            float,
            1.0,
            "global",
            "fraction of the elements (by variance across agents) kept per tensor",
            minimum=0.0,
            maximum=1.0,
            per_tensor=True,
        ),
        INT8_MASK,
    ),
    merge=merge,
    prepare_tensor=prepare,
    prepare_bytes=prepare_bytes,
    reference="https://arxiv.org/abs/2408.07990",
)
