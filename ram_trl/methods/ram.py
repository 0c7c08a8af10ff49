"""Reinforced Agent Merging (RAM, RAM+, RAM+s): the tensor maths of Algorithm 1 of the RAM paper (docs/methods.md)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from ram_trl import defaults
from ram_trl.errors import ConfigError
from ram_trl.methods.base import Alias, ChunkInputs, MergeMethod, Parameter
from ram_trl.statistics.counting import DEFAULT_EPS, masked_deltas

if TYPE_CHECKING:
    from ram_trl.statistics import OverlapStatistics


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


def ram_merge(deltas: torch.Tensor, lambdas: torch.Tensor | list[float], eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Selective merging (eq. 7) of one chunk of task vectors, shape ``(n,)``: 0 where no agent is active,
    ``lambda_t * tau_t`` where only agent ``t`` is, and elsewhere the mean of the active values (their sum in agent
    order, divided by their count).

    Args:
        deltas: Float32 task vectors of shape ``(num_agents, n)`` (not modified).
        lambdas: Per-agent rescale factors for unique elements, shape ``(num_agents,)``.
        eps: Activity threshold (strict).
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
    """``float32(lambda_t) - 1`` per agent, or ``None`` when ``1 + that`` is not exactly ``float32(lambda_t)`` (it is
    for every float32 ``lambda >= 1``: RAM's factors; others take :func:`ram_merge`'s :func:`torch.where` path)."""
    f32 = torch.tensor(factors, dtype=torch.float32)  # host
    excess = f32 - 1.0
    if not torch.equal(excess + 1.0, f32) or not bool(torch.isfinite(f32).all()):
        return None
    return excess.to(device)


# ---------------------------------------------------------------------------------------------------------------
# The methods: RAM, RAM+ and RAM+s (registered by :mod:`ram_trl.methods.registry`)

EPS = Parameter(
    "eps", float, DEFAULT_EPS, "global", "activity threshold: |tau| > eps (strict)", minimum=0.0, aliases=("epsilon",)
)
RHO_SCOPE = Parameter(
    "rho_scope",
    str,
    "global",
    "global",
    "count shared/unique elements over the whole model (the paper) or per tensor (mergekit's ramplus_tl)",
    choices=("global", "tensor"),
)
R = Parameter("r", float, defaults.R, "global", "rescale strength r of lambda_t = 1 + r * f(rho_t)", minimum=0.0)
ALPHA = Parameter("alpha", float, defaults.ALPHA, "global", "clip bound alpha of rho_t", minimum=0.0)
UNIQUE_SCALE = Parameter(
    "unique_scale",
    float,
    1.0,
    "global",
    "factor of every unique element (1: the paper's RAM; 1/N: the unique region at task arithmetic's 1/N, the "
    "shared mean unchanged)",
    minimum=0.0,
)
AGENT = Parameter("agent", str, "", "global", "the agent whose unique region is kept: its name, or its index from 0")

REFERENCE = "https://arxiv.org/abs/2601.13572"


def merge_plain(inputs: ChunkInputs) -> torch.Tensor:
    """RAM's chunk kernel: :func:`ram_merge` with every ``lambda_t = unique_scale`` (1 unless the config sets it)."""
    scale = float(inputs.params.get("unique_scale", 1.0))
    return ram_merge(inputs.deltas, [scale] * inputs.deltas.shape[0], inputs.params["eps"])


def merge_unscaled(inputs: ChunkInputs) -> torch.Tensor | None:
    """RAM, RAM+ and RAM+s without their unique elements' factors (every ``lambda_t = 1``): the ``unstepped`` hook;
    ``None`` for RAM at ``unique_scale: 1`` (no step)."""
    if float(inputs.params.get("unique_scale", 1.0)) == 1.0 and inputs.factors is None:
        return None
    return ram_merge(inputs.deltas, [1.0] * inputs.deltas.shape[0], inputs.params["eps"])


def agent_index(value: str, names: tuple[str, ...] | list[str], where: str) -> int:
    """The index of the agent a parameter names (its name, or its index from 0).

    Args:
        value: The parameter's value.
        names: The agents' names, in merge order.
        where: What names the value, for the error.

    Raises:
        ConfigError: when no agent has that name or index.
    """
    if value in names:
        return list(names).index(value)
    if value.isdigit() and int(value) < len(names):
        return int(value)
    raise ConfigError(
        f"{where}: agent {value!r} is not one of the merged agents ({', '.join(names)}); give one of their names "
        f"or an index from 0 to {len(names) - 1}"
    )


def check_agent(params: dict[str, Any], names: list[str], where: str) -> None:
    """``ram_unique``'s check hook: its ``agent`` names one of the merged agents.

    Args:
        params: The merge's global parameters.
        names: The agents' names, in merge order.
        where: The config, for the error.

    Raises:
        ConfigError: when ``agent`` names none of them.
    """
    agent_index(str(params["agent"]), names, f"{where}: parameters.agent")


def unique_region(deltas: torch.Tensor, t: int, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Agent ``t``'s unique region, shape ``(n,)``: ``tau_t`` where only ``t`` is active (``|tau| > eps``), else 0.

    Args:
        deltas: Float32 task vectors of shape ``(num_agents, n)`` (not modified).
        t: The agent's index.
        eps: Activity threshold (strict).
    """
    active = masked_deltas(deltas, eps)
    counts = _row_sum(torch.ne(active, 0, out=torch.empty_like(active)))
    return torch.where(counts == 1, active[t], torch.zeros_like(active[t]))


def merge_unique(inputs: ChunkInputs) -> torch.Tensor:
    """``ram_unique``'s chunk kernel: :func:`unique_region` of the agent the ``agent`` parameter names."""
    t = agent_index(str(inputs.params["agent"]), inputs.agent_names, inputs.name)
    return unique_region(inputs.deltas, t, inputs.params["eps"])


def merge_rescaled(inputs: ChunkInputs) -> torch.Tensor:
    """RAM+'s and RAM+s's chunk kernel: :func:`ram_merge` with the factors hook's ``lambda_t``."""
    if inputs.factors is None:
        raise RuntimeError(f"{inputs.name}: RAM needs overlap statistics before merging")
    return ram_merge(inputs.deltas, inputs.factors, inputs.params["eps"])


RAM = MergeMethod(
    name="ram",
    pretty_name="Reinforced Agent Merging (RAM)",
    description="mean of shared elements, unique elements kept at full magnitude",
    parameters=(EPS, RHO_SCOPE, UNIQUE_SCALE),
    merge=merge_plain,
    unstepped=merge_unscaled,
    step="unique scale",
    reference=REFERENCE,
)

RAM_UNIQUE = MergeMethod(
    name="ram_unique",
    pretty_name="One agent's unique region (RAM's mechanism probe)",
    description="tau_t where only agent t is active (|tau| > eps), the base elsewhere",
    parameters=(EPS, AGENT),
    merge=merge_unique,
    check=check_agent,
    reference=REFERENCE,
)

RAM_PLUS = MergeMethod(
    name="ram_plus",
    pretty_name="Reinforced Agent Merging Plus (RAM+)",
    description="RAM with unique elements rescaled by lambda_t = 1 + r * clip(rho_t, 0, alpha)",
    parameters=(EPS, R, ALPHA, RHO_SCOPE),
    merge=merge_rescaled,
    factors=clipped_factors,
    unstepped=merge_unscaled,
    step="rescale (lambda_t)",
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
    unstepped=merge_unscaled,
    step="rescale (lambda_t)",
    reference=REFERENCE,
)
RAM_PLUS_SOFT_ALIASES = {
    "ramplus_soft": Alias("ram_plus_soft"),
    "ram+s": Alias("ram_plus_soft"),
    "rams": Alias("ram_plus_soft"),
}
