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

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from ram_trl import defaults
from ram_trl.methods.base import Alias, ChunkInputs, MergeMethod, Parameter

if TYPE_CHECKING:
    from ram_trl.statistics import OverlapStatistics

DEFAULT_EPS = defaults.EPS


def float32_threshold(eps: float) -> float:
    """The largest float32 value not above ``eps``.

    For a float32 ``x``, ``|x| > eps`` (compared exactly, as real numbers) holds exactly when
    ``|x| > float32_threshold(eps)`` in float32. Comparing against ``eps`` rounded to nearest would be wrong whenever
    ``eps`` rounds up (e.g. ``0.1``): a task vector element equal to ``float32(0.1)`` exceeds 0.1 but not itself.
    """
    value = np.float32(eps)
    if float(value) > eps:
        value = np.nextafter(value, np.float32(-np.inf))
    return float(value)


def active_mask(deltas: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Mask of active task-vector elements, ``|tau| > eps`` (strict; NaN is inactive).

    Args:
        deltas: Float32 task vectors, any shape (usually ``(num_agents, n)``).
        eps: Threshold; an element equal to ``eps`` in magnitude is inactive.

    Returns:
        A bool tensor of the same shape.
    """
    threshold = float32_threshold(eps)
    return (deltas > threshold) | (deltas < -threshold)


def active_flags(deltas: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """:func:`active_mask` as float32 ``1.0`` / ``0.0`` (``|tau| > eps``, strict; NaN is inactive).

    Comparisons that write floats run several times faster on the CPU than comparisons that write bools; the flags
    feed :func:`subset_codes` directly.

    Args:
        deltas: Float32 task vectors, any shape (usually ``(num_agents, n)``).
        eps: Threshold; an element equal to ``eps`` in magnitude is inactive.

    Returns:
        A float32 tensor of the same shape.
    """
    return deltas.abs().gt_(float32_threshold(eps))


def masked_deltas(
    deltas: torch.Tensor, eps: float = DEFAULT_EPS, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The task vectors with inactive elements (``|tau| <= eps``) set to 0, as a new tensor (or in ``out``).

    Args:
        deltas: Float32 task vectors, any shape.
        eps: Threshold (default :data:`DEFAULT_EPS`); an element equal to ``eps`` in magnitude is inactive.
        out: A float32 tensor of the same shape the result is written into (default ``None``: a new one).

    Returns:
        The masked task vectors (``out`` when given).
    """
    if out is not None:
        return torch.hardshrink(deltas, float32_threshold(eps), out=out)
    return F.hardshrink(deltas, float32_threshold(eps))


def overlap_counts(mask: torch.Tensor) -> torch.Tensor:
    """Number of active agents per element, ``c = sum_t m_t``.

    Args:
        mask: Bool tensor of shape ``(num_agents, n)``.

    Returns:
        An integer tensor of shape ``(n,)`` (uint8 for up to 255 agents, int32 beyond).
    """
    dtype = torch.uint8 if mask.shape[0] < 256 else torch.int32
    rows = mask.view(torch.uint8) if dtype == torch.uint8 else mask.to(dtype)
    counts = rows[0].to(dtype, copy=True)
    for row in rows[1:]:
        counts += row
    return counts


def overlap_unique_ratio(shared: int, unique: int) -> float:
    """The Overlap-Unique Ratio ``rho_t = shared_t / unique_t`` (eq. 2).

    An agent with shared but no unique elements gets ``inf``; an agent with no active element at all gets 0 (it has
    no unique element for the factor to act on, so its value does not matter).

    Args:
        shared: The agent's active elements that another agent also updates.
        unique: Its active elements no other agent updates.

    Returns:
        ``rho_t``.
    """
    if unique > 0:
        return shared / unique
    return math.inf if shared > 0 else 0.0


def rescale_factor(rho: float, r: float, alpha: float) -> float:
    """RAM+ rescale factor ``lambda_t = 1 + r * clip(rho_t, 0, alpha)`` (eq. 6); RAM is ``r = 0``.

    Args:
        rho: The agent's Overlap-Unique Ratio (:func:`overlap_unique_ratio`).
        r: The rescale strength.
        alpha: The upper clip of ``rho``.

    Returns:
        ``lambda_t``.
    """
    return 1.0 + r * min(max(rho, 0.0), alpha)


def soft_rescale_factor(rho: float, r: float) -> float:
    """RAM+s rescale factor ``lambda_t = 1 + r * rho_t / (1 + rho_t)`` (appendix E, eq. 8); ``rho = inf`` gives ``1 + r``.

    Args:
        rho: The agent's Overlap-Unique Ratio (:func:`overlap_unique_ratio`).
        r: The rescale strength.

    Returns:
        ``lambda_t``.
    """
    saturation = 1.0 if math.isinf(rho) else rho / (1.0 + rho)
    return 1.0 + r * saturation


def clipped_factors(stats: OverlapStatistics, params: dict[str, Any]) -> list[float]:
    """RAM+'s factors hook: ``lambda_t = 1 + r * clip(rho_t, 0, alpha)`` per agent from overlap statistics.

    Args:
        stats: The overlap statistics (of the whole model, or of one tensor with ``rho_scope: tensor``).
        params: The global parameters (``r``, ``alpha``).
    """
    return stats.lambdas(params["r"], params["alpha"])


def soft_factors(stats: OverlapStatistics, params: dict[str, Any]) -> list[float]:
    """RAM+s's factors hook: ``lambda_t = 1 + r * rho_t / (1 + rho_t)`` per agent from overlap statistics.

    Args:
        stats: The overlap statistics (of the whole model, or of one tensor with ``rho_scope: tensor``).
        params: The global parameters (``r``).
    """
    return stats.lambdas(params["r"], None, soft=True)


def ram_merge(
    deltas: torch.Tensor, lambdas: torch.Tensor | list[float], eps: float = DEFAULT_EPS
) -> torch.Tensor:
    """Selective merging (eq. 7) of one chunk of task vectors.

    Args:
        deltas: Float32 task vectors of shape ``(num_agents, n)`` (not modified).
        lambdas: Per-agent rescale factors for unique elements, shape ``(num_agents,)``.
        eps: Activity threshold (strict).

    Returns:
        The merged task vector of shape ``(n,)``: 0 where no agent is active, ``lambda_t * tau_t`` where only agent
        ``t`` is, and the mean of the active values elsewhere (their sum in agent order, divided by their count).
    """
    factors = [float(f) for f in (lambdas.tolist() if isinstance(lambdas, torch.Tensor) else lambdas)]
    active = masked_deltas(deltas, eps)
    total = active[0].clone()
    for t in range(1, active.shape[0]):
        total += active[t]
    flags = torch.ne(active, 0, out=torch.empty_like(active))  # 1.0 where active (|tau| > eps)
    counts = _row_sum(flags)  # active agents per element: whole numbers, exact in float32
    excess = _unique_excess(tuple(factors), deltas.device)
    if excess is None:
        return torch.where(counts == 1, _rescaled_sum(active, factors), total.div_(counts.clamp_(min=1)))
    # The factor of each element is 1 + (lambda_t - 1) where only agent t is active, else 1 + 0: exactly lambda_t or
    # 1 (see _unique_excess). Where only t is active the sum is tau_t exactly, so (sum / 1) * lambda_t ==
    # lambda_t * tau_t; elsewhere (sum / c) * 1 == the mean: bit for bit eq. 7, with no per-element table look-up.
    scale = (excess @ flags).mul_(torch.eq(counts, 1, out=torch.empty_like(counts))).add_(1.0)
    return total.div_(counts.clamp_(min=1)).mul_(scale)


def _rescaled_sum(active: torch.Tensor, factors: list[float]) -> torch.Tensor:
    """``sum_t lambda_t * active_t``: where one agent is active, its rescaled value (the others contribute 0)."""
    out = active[0] * factors[0]
    for t in range(1, active.shape[0]):
        out.add_(active[t], alpha=factors[t])
    return out


def _row_sum(rows: torch.Tensor) -> torch.Tensor:
    """``rows[0] + rows[1] + ...`` as a new tensor (faster on the CPU than a reduction over the first dimension)."""
    out = rows[0].clone()
    for row in rows[1:]:
        out += row
    return out


@functools.lru_cache(maxsize=64)
def _unique_excess(factors: tuple[float, ...], device: torch.device) -> torch.Tensor | None:
    """``float32(lambda_t) - 1`` per agent, or ``None`` when ``1 + that`` is not exactly ``float32(lambda_t)``.

    For a float32 ``lambda >= 1`` (every RAM, RAM+ and RAM+s factor) the difference is exact, and so is adding 1
    back; other factors take the :func:`torch.where` path of :func:`ram_merge`.
    """
    f32 = torch.tensor(factors, dtype=torch.float32)  # host
    excess = f32 - 1.0
    if not torch.equal(excess + 1.0, f32) or not bool(torch.isfinite(f32).all()):
        return None
    return excess.to(device)


def subset_codes(mask: torch.Tensor) -> torch.Tensor:
    """Per element, the set of active agents as a bit field (bit ``t`` set when agent ``t`` is active).

    Args:
        mask: Bool tensor, or float tensor of ``0`` / ``1`` flags (:func:`active_flags`), of shape
            ``(num_agents, n)``, at most 31 agents.

    Returns:
        Shape ``(n,)``; uint8 for up to 8 agents, int32 beyond.
    """
    num_agents = mask.shape[0]
    dtype = torch.uint8 if num_agents <= 8 else torch.int32
    # sum_t 2**t * m_t: whole numbers below 2**24 (2**53), so the float32 (float64) dot product is exact
    exact = torch.float32 if num_agents <= 24 else torch.float64
    return (_code_weights(num_agents, exact, mask.device) @ mask.to(exact)).to(dtype)


@functools.lru_cache(maxsize=64)
def _code_weights(num_agents: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.pow(2.0, torch.arange(num_agents, dtype=dtype, device=device))


# ---------------------------------------------------------------------------------------------------------------
# The methods: RAM, RAM+ and RAM+s (registered by :mod:`ram_trl.methods.registry`)

EPS = Parameter(
    "eps",
    float,
    DEFAULT_EPS,
    "global",
    "activity threshold: |tau| > eps (strict)",
    minimum=0.0,
    aliases=("epsilon",),
)
RHO_SCOPE = Parameter(
    "rho_scope",
    str,
    "global",
    "global",
    "count shared/unique elements over the whole model (the paper) or per tensor (mergekit's ramplus_tl)",
    choices=("global", "tensor"),
)
R = Parameter(
    "r", float, defaults.R, "global", "rescale strength r of lambda_t = 1 + r * f(rho_t)", minimum=0.0
)
ALPHA = Parameter("alpha", float, defaults.ALPHA, "global", "clip bound alpha of rho_t", minimum=0.0)

REFERENCE = "https://arxiv.org/abs/2601.13572"


def merge_plain(inputs: ChunkInputs) -> torch.Tensor:
    """RAM's chunk kernel: :func:`ram_merge` with every ``lambda_t = 1``."""
    return ram_merge(inputs.deltas, [1.0] * inputs.deltas.shape[0], inputs.params["eps"])


def merge_rescaled(inputs: ChunkInputs) -> torch.Tensor:
    """RAM+'s and RAM+s's chunk kernel: :func:`ram_merge` with the factors hook's ``lambda_t``."""
    if inputs.factors is None:
        raise RuntimeError(f"{inputs.name}: RAM needs overlap statistics before merging")
    return ram_merge(inputs.deltas, inputs.factors, inputs.params["eps"])


RAM = MergeMethod(
    name="ram",
    pretty_name="Reinforced Agent Merging (RAM)",
    description="mean of shared elements, unique elements kept at full magnitude",
    parameters=(EPS, RHO_SCOPE),
    merge=merge_plain,
    reference=REFERENCE,
)

RAM_PLUS = MergeMethod(
    name="ram_plus",
    pretty_name="Reinforced Agent Merging Plus (RAM+)",
    description="RAM with unique elements rescaled by lambda_t = 1 + r * clip(rho_t, 0, alpha)",
    parameters=(EPS, R, ALPHA, RHO_SCOPE),
    merge=merge_rescaled,
    factors=clipped_factors,
    reference=REFERENCE,
)
RAM_PLUS_ALIASES = {
    "ramplus": Alias("ram_plus"),
    "ram+": Alias("ram_plus"),
    "ramplus_tl": Alias(
        "ram_plus",
        {"rho_scope": "tensor", "alpha": defaults.MERGEKIT_TL_ALPHA},
        "mergekit's tensor-local RAM+: rho per tensor, alpha default 0.2",
    ),
}

RAM_PLUS_SOFT = MergeMethod(
    name="ram_plus_soft",
    pretty_name="Reinforced Agent Merging Plus, soft saturation (RAM+s)",
    description="RAM with unique elements rescaled by lambda_t = 1 + r * rho_t / (1 + rho_t)",
    parameters=(EPS, R, RHO_SCOPE),
    merge=merge_rescaled,
    factors=soft_factors,
    reference=REFERENCE,
)
RAM_PLUS_SOFT_ALIASES = {
    "ramplus_soft": Alias("ram_plus_soft"),
    "ram+s": Alias("ram_plus_soft"),
    "rams": Alias("ram_plus_soft"),
}
