"""Fisher merging: task vectors averaged element by element with diagonal Fisher weights (Matena & Raffel, 2022).
Details: docs/methods.md and docs/fisher.md."""

from __future__ import annotations

from pathlib import Path

import torch

from ram_trl import defaults
from ram_trl.methods.base import Alias, ChunkInputs, MergeMethod, Parameter
from ram_trl.methods.parameters import LAMBDA

#: Matena & Raffel's default ``fisher_floor``.
DEFAULT_FISHER_FLOOR = defaults.FISHER_FLOOR


def fisher_merge(
    deltas: torch.Tensor,
    fishers: torch.Tensor,
    weights: torch.Tensor,
    scale: float = 1.0,
    floor: float = DEFAULT_FISHER_FLOOR,
) -> torch.Tensor:
    """Fisher-weighted average of task vectors: the merged task vector, shape ``(n,)``.

    Args:
        deltas: Float32 task vectors ``tau_t``, shape ``(num_agents, n)``; left unchanged.
        fishers: Float32 diagonal Fishers ``F_t`` (non-negative), shape ``(num_agents, n)``; overwritten (used as
            the buffer of ``w_t F'_t``).
        weights: Per-agent weights ``w_t >= 0``, shape ``(num_agents,)``.
        scale: The global scaling term ``lambda`` applied to the merged task vector.
        floor: ``fisher_floor``: Fisher values below it are raised to it (0 disables the floor).
    """
    weighted = fishers.clamp_(min=floor) if floor > 0 else fishers
    weighted.mul_(weights.to(weighted.dtype).unsqueeze(-1))
    denominator = weighted.sum(dim=0)
    merged = weighted.mul_(deltas).sum(dim=0).div_(denominator)
    empty = denominator == 0
    if bool(empty.any()):
        total = float(weights.sum())
        if total > 0:
            mean = (deltas[:, empty] * weights.to(deltas.dtype).unsqueeze(-1)).sum(dim=0).div_(total)
        else:
            mean = torch.zeros(int(empty.sum()), dtype=deltas.dtype, device=deltas.device)
        merged[empty] = mean
    if scale != 1.0:
        merged.mul_(scale)
    return merged


# ---------------------------------------------------------------------------------------------------------------
# The method (registered by :mod:`ram_trl.methods.registry`)


def merge_chunk(inputs: ChunkInputs) -> torch.Tensor:
    """Fisher merging's chunk kernel: :func:`fisher_merge` with the agents' Fisher values streamed beside them."""
    if inputs.fishers is None:
        raise RuntimeError(f"{inputs.name}: Fisher merging needs the agents' Fisher values")
    return fisher_merge(
        inputs.deltas,
        inputs.fishers,
        inputs.agent_params["weight"],
        inputs.params["lambda"],
        inputs.params["fisher_floor"],
    )


FISHER = MergeMethod(
    name="fisher",
    pretty_name="Fisher merging",
    description="lambda * sum_t w_t F_t tau_t / sum_t w_t F_t with each agent's diagonal Fisher F_t",
    parameters=(
        LAMBDA,
        Parameter(
            "fisher_floor",
            float,
            DEFAULT_FISHER_FLOOR,
            "global",
            "Fisher values below it are raised to it (Matena & Raffel's fisher_floor; 0: none)",
            minimum=0.0,
        ),
        Parameter("weight", float, defaults.WEIGHT, "agent", "per-agent weight w_t", minimum=0.0),
        Parameter(
            "fisher",
            Path,
            "",
            "agent",
            "the agent's Fisher file (default: fisher.safetensors in the agent's directory)",
        ),
    ),
    merge=merge_chunk,
    needs_fisher=True,
    reference="https://arxiv.org/abs/2111.09832",
)
FISHER_ALIASES = {"fisher_merging": Alias("fisher")}
