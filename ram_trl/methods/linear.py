"""Weighted sums of task vectors: task arithmetic and linear (weighted average) merging."""

from __future__ import annotations

import torch

from ram_trl.methods.base import Alias, ChunkInputs, MergeMethod
from ram_trl.methods.parameters import INT8_MASK, LAMBDA, WEIGHT, normalize


def weighted_sum(deltas: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_t w_t * tau_t``, shape ``(n,)``.

    Args:
        deltas: Float32 task vectors ``tau_t``, shape ``(num_agents, n)``.
        weights: Per-agent weights ``w_t`` of shape ``(num_agents,)`` (cast to the task vectors' dtype).
    """
    # element-wise products summed in agent order, no matmul: the same on every device, no reduced-precision paths
    return (deltas * weights.to(deltas.dtype).unsqueeze(-1)).sum(dim=0)


def task_arithmetic(
    deltas: torch.Tensor, weights: torch.Tensor, scale: float = 1.0, normalize: bool = False
) -> torch.Tensor:
    """Task arithmetic: ``lambda * sum_t w_t tau_t`` (optionally divided by ``sum_t w_t``), shape ``(n,)``.

    Args:
        deltas: Float32 task vectors, shape ``(num_agents, n)``.
        weights: Per-agent weights ``w_t``.
        scale: The global scaling term ``lambda``.
        normalize: Divide by the sum of weights (left as is when that sum is below 1e-8 in magnitude, as mergekit).
    """
    merged = weighted_sum(deltas, weights)
    if normalize:
        total = float(weights.sum())
        if abs(total) >= 1e-8:
            merged.div_(total)
    if scale != 1.0:
        merged.mul_(scale)
    return merged


def linear(deltas: torch.Tensor, base: torch.Tensor, weights: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Linear merging (a weighted average of the models), returned as a task vector on ``base``, shape ``(n,)``.

    With ``normalize`` the result is ``sum_t w_t theta_t / sum_t w_t``, i.e. ``base + sum_t w_t tau_t / sum_t w_t``.
    Without it, ``sum_t w_t theta_t = base + sum_t w_t tau_t + (sum_t w_t - 1) * base``.

    Args:
        deltas: Float32 task vectors, shape ``(num_agents, n)``.
        base: Float32 base values, shape ``(n,)``.
        weights: Per-model weights.
        normalize: Divide by the sum of weights.
    """
    merged = weighted_sum(deltas, weights)
    total = float(weights.sum())
    if normalize:
        if abs(total) < 1e-8:
            raise ValueError("linear merge with normalize: the weights sum to zero")
        return merged.div_(total)
    if total != 1.0:
        merged.add_(base, alpha=total - 1.0)
    return merged


# ---------------------------------------------------------------------------------------------------------------
# The methods: task arithmetic and linear (registered by :mod:`ram_trl.methods.registry`)


def merge_task_arithmetic(inputs: ChunkInputs) -> torch.Tensor:
    """Task arithmetic's chunk kernel (also the merge step of DARE, Breadcrumbs and DELLA's linear variants)."""
    return task_arithmetic(
        inputs.deltas, inputs.agent_params["weight"], inputs.params["lambda"], inputs.params["normalize"]
    )


def unscaled_task_arithmetic(inputs: ChunkInputs) -> torch.Tensor | None:
    """Task arithmetic at ``lambda = 1``: its ``unstepped`` hook; ``None`` when ``lambda`` is 1 (no step)."""
    if inputs.params["lambda"] == 1.0:
        return None
    return task_arithmetic(inputs.deltas, inputs.agent_params["weight"], 1.0, inputs.params["normalize"])


def merge_linear(inputs: ChunkInputs) -> torch.Tensor:
    """Linear merging's chunk kernel."""
    return linear(inputs.deltas, inputs.base, inputs.agent_params["weight"], inputs.params["normalize"])


TASK_ARITHMETIC = MergeMethod(
    name="task_arithmetic",
    pretty_name="Task Arithmetic",
    description="lambda * sum_t w_t tau_t",
    parameters=(LAMBDA, normalize(False, "divide by the sum of weights"), WEIGHT, INT8_MASK),
    merge=merge_task_arithmetic,
    unstepped=unscaled_task_arithmetic,
    step="lambda",
    reference="https://arxiv.org/abs/2212.04089",
)
TASK_ARITHMETIC_ALIASES = {"ta": Alias("task_arithmetic")}

LINEAR = MergeMethod(
    name="linear",
    pretty_name="Linear (weighted average)",
    description="sum_t w_t theta_t / sum_t w_t",
    parameters=(normalize(True, "divide by the sum of weights"), WEIGHT),
    merge=merge_linear,
    keeps_base_entries=True,
    divides_by_weight_sum=True,
    reference="https://arxiv.org/abs/2203.05482",
)
LINEAR_ALIASES = {"average": Alias("linear"), "model_soup": Alias("linear")}
