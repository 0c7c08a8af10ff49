"""Reinforced Agent Merging (RAM, RAM+, RAM+s): the tensor maths of Algorithm 1 of the RAM paper.

Stage 1 (probing) marks element ``i`` of agent ``t`` active when ``|tau_t[i]| > eps`` (strict) and counts the active
agents per element, ``c[i]``. Stage 2 turns each agent's shared (``c >= 2``) and unique (``c == 1``) counts over
the whole model into ``rho_t = shared_t / unique_t`` and a rescale factor ``lambda_t``. Stage 3 merges element by
element: 0 where ``c == 0``, ``lambda_t * tau_t`` where only ``t`` is active, the mean of the active values where
``c >= 2``.

These functions are stateless and work on one chunk at a time; :mod:`ram_trl.statistics` accumulates the counts of
stage 2 over a whole model.
"""

from __future__ import annotations

import math

import torch

DEFAULT_EPS = 1e-5


def active_mask(deltas: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Mask of active task-vector elements, ``|tau| > eps`` (strict).

    Args:
        deltas: Task vectors, any shape (usually ``(num_agents, n)``), float32.
        eps: Threshold; an element equal to ``eps`` in magnitude is inactive.

    Returns:
        A bool tensor of the same shape.
    """
    return deltas.abs() > eps


def overlap_counts(mask: torch.Tensor) -> torch.Tensor:
    """Number of active agents per element, ``c = sum_t m_t``.

    Args:
        mask: Bool tensor of shape ``(num_agents, n)``.

    Returns:
        An int64 tensor of shape ``(n,)``.
    """
    return mask.sum(dim=0)


def overlap_unique_ratio(shared: int, unique: int) -> float:
    """The Overlap-Unique Ratio ``rho_t = shared_t / unique_t`` (eq. 2).

    An agent with shared but no unique elements gets ``inf``; an agent with no active element at all gets 0 (it has
    no unique element for the factor to act on, so its value does not matter).
    """
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


def ram_merge(
    deltas: torch.Tensor, lambdas: torch.Tensor | list[float], eps: float = DEFAULT_EPS
) -> torch.Tensor:
    """Selective merging (eq. 7) of one chunk of task vectors.

    Args:
        deltas: Float32 task vectors of shape ``(num_agents, n)``. Modified in place (inactive entries zeroed).
        lambdas: Per-agent rescale factors for unique elements, shape ``(num_agents,)``.
        eps: Activity threshold (strict).

    Returns:
        The merged task vector of shape ``(n,)``: 0 where no agent is active, ``lambda_t * tau_t`` where only agent
        ``t`` is, and the mean of the active values elsewhere.
    """
    mask = active_mask(deltas, eps)
    counts = overlap_counts(mask)
    deltas.mul_(mask)
    total = deltas.sum(dim=0)
    unique = torch.zeros_like(total)
    for t, lam in enumerate(lambdas.tolist() if isinstance(lambdas, torch.Tensor) else lambdas):
        unique.add_(deltas[t], alpha=float(lam))
    shared_mean = total.div_(counts.clamp(min=1))
    return torch.where(counts == 1, unique, shared_mean)
