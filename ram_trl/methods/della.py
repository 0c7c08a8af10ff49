"""DELLA: drop task-vector elements at random with a keep probability that grows with their magnitude's rank, then
merge (Deep et al., 2024; mergekit's ``della_magprune``). Details: docs/methods.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ram_trl.errors import ConfigError
from ram_trl.methods import dare, linear, ties
from ram_trl.methods.base import ChunkInputs, MergeMethod, Parameter, TensorView
from ram_trl.methods.parameters import sparsified_parameters

#: Default half-width of the keep probabilities around ``density`` (mergekit's).
DEFAULT_EPSILON = 0.15
#: Below this L1 norm (before or after the drop) the survivors are not rescaled (mergekit's).
RESCALE_EPS = 1e-7
#: Elements per block of the preparation's mask (bounds its temporaries).
BLOCK = 1 << 20


def rank_fraction(magnitudes: torch.Tensor) -> torch.Tensor:
    """Each element's magnitude rank along dimension 1, as ``rank / (size - 1)`` in [0, 1] (0 for size 1), float32.

    Args:
        magnitudes: ``|tau|``, shape ``(rows, size, ...)``; ties are ranked lowest index first.
    """
    size = magnitudes.shape[1]
    order = torch.sort(magnitudes, dim=1, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(
        1,
        order,
        torch.arange(size, device=magnitudes.device).reshape((1, size) + (1,) * (order.dim() - 2)).expand_as(order),
    )
    if size == 1:
        return torch.zeros(magnitudes.shape, dtype=torch.float32, device=magnitudes.device)
    return ranks.to(torch.float32) / (size - 1)


def keep_mask(
    delta: torch.Tensor, fraction: torch.Tensor, density: float, epsilon: float, key: tuple[int, int], start: int
) -> torch.Tensor:
    """Float32 1.0 / 0.0 flags, flat: element ``i`` (flat index ``start + i``) is kept when its hashed uniform draw
    is below ``(density - epsilon) + 2 epsilon fraction_i``.

    Args:
        delta: A chunk of one agent's task vector (its element count and device are used).
        fraction: Each element's magnitude rank fraction in ``[0, 1]`` (:func:`rank_fraction`).
        density: The mean keep probability.
        epsilon: Half-width of the keep probabilities.
        key: The agent's hash key for the tensor (:func:`~ram_trl.methods.dare.dare_key`).
        start: Flat index of the chunk's first element in the tensor.
    """
    probability = fraction.reshape(-1) * (2 * epsilon) + (density - epsilon)
    draws = dare.hashed_uniform(key, start, delta.numel(), delta.device)
    return torch.lt(draws, probability, out=draws)


@dataclass(frozen=True)
class DellaCut:
    """What the chunks of one tensor need for one agent.

    Args:
        density: Mean keep probability.
        epsilon: Half-width of the keep probabilities.
        key: The agent's hash key for the tensor.
        scale: The L1 rescale factor (float32, 0-dimensional), or ``None``.
        fraction: For a tensor of one dimension (one row: its ranks span chunks): every element's rank fraction.
    """

    density: float
    epsilon: float
    key: tuple[int, int]
    scale: torch.Tensor | None
    fraction: torch.Tensor | None


def _rows(values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return values.reshape(1, -1) if len(shape) < 2 else values.reshape((-1, *shape[1:]))


def prepare(view: TensorView) -> tuple[tuple[int, ...], list[DellaCut | None]]:
    """DELLA's per-tensor preparation hook: the tensor's shape and each agent's :class:`DellaCut` (``None``: density
    1 keeps everything)."""
    cuts: list[DellaCut | None] = []
    shape = view.shape
    for t in range(view.num_agents):
        density, epsilon = view.agent_value(t, "density"), view.agent_value(t, "epsilon")
        if density >= 1:
            cuts.append(None)
            continue
        if density + epsilon >= 1 or density - epsilon <= 0:
            raise ConfigError(
                f"tensor {view.name!r}, agent {t}: della needs 0 < density - epsilon and density + epsilon < 1, got "
                f"density {density:g}, epsilon {epsilon:g}"
            )
        key = dare.dare_key(view.seed, view.name, t)
        magnitudes, _ = view.magnitudes(t)
        fraction = rank_fraction(_rows(magnitudes, shape)).reshape(-1) if len(shape) < 2 else None
        scale = None
        if view.params["rescale"]:
            row = max(1, view.numel // max(shape[0], 1)) if len(shape) >= 2 else view.numel
            step = max(row, (BLOCK // row) * row)
            before = magnitudes.sum(dtype=torch.float64)
            after = torch.zeros((), dtype=torch.float64, device=magnitudes.device)
            for lo in range(0, view.numel, step):
                part = magnitudes[lo : lo + step]
                part_fraction = fraction[lo : lo + step] if fraction is not None else rank_fraction(_rows(part, shape))
                after += (part * keep_mask(part, part_fraction, density, epsilon, key, lo)).sum(dtype=torch.float64)
            if not (before < RESCALE_EPS or after < RESCALE_EPS):
                scale = (before / after).to(torch.float32)
        del magnitudes
        cuts.append(DellaCut(density, epsilon, key, scale, fraction))
    return shape, cuts


def sparsify(inputs: ChunkInputs) -> None:
    """Drop (and rescale) every agent's chunk of task vector in place."""
    if inputs.prepared is None:
        raise RuntimeError(f"{inputs.name}: DELLA needs the tensor's keep probabilities before merging")
    shape, cuts = inputs.prepared
    n = inputs.deltas.shape[1]
    for t, cut in enumerate(cuts):
        if cut is None:
            continue
        delta = inputs.deltas[t]
        if cut.fraction is not None:
            fraction = cut.fraction[inputs.start : inputs.start + n]
        else:
            fraction = rank_fraction(_rows(delta.abs(), shape))
        delta.mul_(keep_mask(delta, fraction, cut.density, cut.epsilon, cut.key, inputs.start))
        if cut.scale is not None:
            delta.mul_(cut.scale)


def merge_ties(inputs: ChunkInputs) -> torch.Tensor:
    """``della``'s chunk kernel: the drop, then sign election and the disjoint mean (sum without normalize)."""
    sparsify(inputs)
    return ties.merge_disjoint(inputs)


def merge_linear(inputs: ChunkInputs) -> torch.Tensor:
    """``della_linear``'s chunk kernel: the drop, then task arithmetic."""
    sparsify(inputs)
    return linear.merge_task_arithmetic(inputs)


_EPSILON = Parameter(
    "epsilon",
    float,
    DEFAULT_EPSILON,
    "agent",
    "keep probabilities run from density - epsilon (smallest) to density + epsilon (largest)",
    minimum=0.0,
    maximum=1.0,
)


def _parameters(normalize: bool, normalize_help: str) -> tuple[Parameter, ...]:
    return sparsified_parameters(
        normalize,
        normalize_help,
        True,
        "rescale the survivors to the task vector's L1 norm",
        "mean keep probability",
        _EPSILON,
    )


REFERENCE = "https://arxiv.org/abs/2406.11617"

DELLA = MergeMethod(
    name="della",
    pretty_name="DELLA",
    description="random drop with magnitude-ranked keep probabilities, L1 rescale; TIES sign election and mean",
    parameters=_parameters(True, "disjoint mean (divide by the agreeing weights)"),
    merge=merge_ties,
    prepare_tensor=prepare,
    reference=REFERENCE,
)

DELLA_LINEAR = MergeMethod(
    name="della_linear",
    pretty_name="Linear DELLA",
    description="random drop with magnitude-ranked keep probabilities, L1 rescale; task arithmetic",
    parameters=_parameters(False, "divide by the sum of weights"),
    merge=merge_linear,
    prepare_tensor=prepare,
    reference=REFERENCE,
)
