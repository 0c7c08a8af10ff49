"""DARE: drop a fraction ``p`` of every task vector's elements at random and rescale survivors by ``1 / (1 - p)``.
Each draw hashes (seed, tensor, agent, element), so order, chunking and processes do not matter (docs/methods.md)."""

from __future__ import annotations

import torch

from ram_trl.digest import key_bytes
from ram_trl.methods import linear, ties
from ram_trl.methods.base import Alias, ChunkInputs, MergeMethod
from ram_trl.methods.parameters import sparsified_parameters

_MASK32 = 0xFFFFFFFF


def dare_key(seed: int, tensor_name: str, agent_index: int) -> tuple[int, int]:
    """Two 32-bit keys (the low and high halves of a BLAKE2b digest of the three) for one (tensor, agent) pair.

    Args:
        seed: The merge's random seed.
        tensor_name: The tensor's name.
        agent_index: The agent's index.
    """
    value = int.from_bytes(key_bytes(f"{seed}\0{tensor_name}\0{agent_index}"), "little")
    return value & _MASK32, value >> 32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (low-bias multiply-xorshift) on int64 holding values below 2**32. Products may wrap
    # in int64; their low 32 bits, all that is kept, are exact.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def hashed_uniform(key: tuple[int, int], start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Float32 uniforms in ``[0, 1)`` (multiples of ``2**-24``) for flat indices ``start .. start + count - 1``.

    Args:
        key: From :func:`dare_key`.
        start: Flat index of the first element.
        count: Number of elements.
        device: Where to compute.
    """
    index = torch.arange(start, start + count, dtype=torch.int64, device=device)
    x = _mix32((index & _MASK32) ^ key[0])
    x = _mix32(x ^ (index >> 32) ^ key[1])
    return (x >> 8).to(torch.float32) * (2.0**-24)


def dare_drop(
    delta: torch.Tensor, density: float, key: tuple[int, int], start: int, rescale: bool = True
) -> torch.Tensor:
    """Randomly keep each element with probability ``density = 1 - p``; rescale survivors by ``1 / density``; in place.

    Args:
        delta: A chunk of one agent's task vector (any shape), float32. Modified in place.
        density: Keep probability ``1 - p``; ``>= 1`` keeps everything.
        key: The (tensor, agent) hash key from :func:`dare_key`.
        start: Flat index (within the whole tensor) of the chunk's first element.
        rescale: Multiply survivors by ``1 / density`` (the DARE paper's rescale).
    """
    if density >= 1:
        return delta
    if density <= 0:
        return delta.zero_()
    keep = hashed_uniform(key, start, delta.numel(), delta.device).reshape(delta.shape) < density
    delta.mul_(keep)
    if rescale:
        delta.div_(density)
    return delta


# ---------------------------------------------------------------------------------------------------------------
# The methods: DARE with task arithmetic or with TIES (registered by :mod:`ram_trl.methods.registry`)


def drop(inputs: ChunkInputs) -> None:
    """Drop (and rescale) every agent's chunk of task vector in place, each with its own density and hash key."""
    densities = inputs.agent_params["density"].tolist()
    for t, density in enumerate(densities):
        key = dare_key(inputs.seed, inputs.name, t)
        dare_drop(inputs.deltas[t], density, key, inputs.start, inputs.params["rescale"])


def merge_linear(inputs: ChunkInputs) -> torch.Tensor:
    """``dare_linear``'s chunk kernel: the drop, then task arithmetic."""
    drop(inputs)
    return linear.merge_task_arithmetic(inputs)


def merge_ties(inputs: ChunkInputs) -> torch.Tensor:
    """``dare_ties``' chunk kernel: the drop, then sign election and the disjoint sum (mean with normalize)."""
    drop(inputs)
    return ties.merge_disjoint(inputs)


def _drops(inputs: ChunkInputs) -> bool:
    return bool((inputs.agent_params["density"] < 1).any())


def unstepped_linear(inputs: ChunkInputs) -> torch.Tensor | None:
    """``dare_linear`` without its drop and rescale (task arithmetic): the ``unstepped`` hook; ``None`` when every
    density keeps everything."""
    return linear.merge_task_arithmetic(inputs) if _drops(inputs) else None


def unstepped_ties(inputs: ChunkInputs) -> torch.Tensor | None:
    """``dare_ties`` without its drop and rescale (the disjoint merge): the ``unstepped`` hook; ``None`` when every
    density keeps everything."""
    return ties.merge_disjoint(inputs) if _drops(inputs) else None


REFERENCE = "https://arxiv.org/abs/2311.03099"
_RESCALE_HELP = "rescale survivors by 1 / density (= 1 / (1 - p))"
_DENSITY_HELP = "fraction of each task vector kept (TIES: by magnitude; DARE: at random, 1 - p)"

DARE_LINEAR = MergeMethod(
    name="dare_linear",
    pretty_name="DARE + Task Arithmetic",
    description="random drop (p = 1 - density), rescale 1/(1-p), then task arithmetic",
    parameters=sparsified_parameters(False, "divide by the sum of weights", True, _RESCALE_HELP, _DENSITY_HELP),
    merge=merge_linear,
    unstepped=unstepped_linear,
    step="drop and rescale",
    reference=REFERENCE,
)
DARE_LINEAR_ALIASES = {"dare_ta": Alias("dare_linear")}

DARE_TIES = MergeMethod(
    name="dare_ties",
    pretty_name="DARE + TIES",
    description="random drop (p = 1 - density), rescale 1/(1-p), then sign election and disjoint sum/mean",
    parameters=sparsified_parameters(
        False, "disjoint mean (divide by the agreeing weights)", True, _RESCALE_HELP, _DENSITY_HELP
    ),
    merge=merge_ties,
    unstepped=unstepped_ties,
    step="drop and rescale",
    reference=REFERENCE,
)
