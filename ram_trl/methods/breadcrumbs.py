"""Model Breadcrumbs: drop each task vector's largest outliers and its smallest elements, then merge (Davari &
Belilovsky, 2023). Details: docs/methods.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

import torch

from ram_trl.methods import linear, ties
from ram_trl.methods.base import ChunkInputs, MergeMethod, Parameter, TensorView
from ram_trl.methods.parameters import sparsified_parameters

#: Default share of the largest magnitudes dropped as outliers (mergekit's).
DEFAULT_GAMMA = 0.01
#: Below this L1 norm (before or after the cut) the survivors are not rescaled (mergekit's).
RESCALE_EPS = 1e-7


def floor_count(numel: int, fraction: float) -> int:
    """``floor(fraction * numel)`` computed exactly on the shortest decimal form of ``fraction`` (0 for
    ``fraction <= 0``, ``numel`` for ``fraction >= 1``).

    Args:
        numel: The count the fraction is taken of.
        fraction: The fraction, as written (``0.1`` is the decimal 0.1, not its binary float).
    """
    if fraction <= 0:
        return 0
    if fraction >= 1:
        return numel
    return math.floor(Decimal(repr(float(fraction))) * numel)


@dataclass(frozen=True)
class OutlierCut:
    """Where breadcrumbs cuts one tensor of one agent.

    Args:
        keep: Keeps the ``top + k`` largest magnitudes.
        drop: Keeps the ``top`` largest (the outliers, dropped from what ``keep`` keeps).
        scale: The L1 rescale factor of the survivors (float32, 0-dimensional), or ``None``.
    """

    keep: ties.MagnitudeCut
    drop: ties.MagnitudeCut
    scale: torch.Tensor | None = None


def outlier_cut(magnitudes: torch.Tensor, density: float, gamma: float, rescale: bool, map_blocks=None) -> OutlierCut:
    """The :class:`OutlierCut` of one agent's whole tensor.

    Args:
        magnitudes: ``|tau|`` of the whole tensor, float32, flat; with ``rescale`` it is trimmed in place.
        density: Share of the elements kept, ``k = floor(density * n)``.
        gamma: Share of the largest magnitudes dropped, ``floor(gamma * n)`` (fewer when ``k`` needs them).
        rescale: Compute the L1 rescale factor.
        map_blocks: Runs a function over blocks (see :func:`~ram_trl.methods.ties.magnitude_cut`).
    """
    n = magnitudes.numel()
    k = floor_count(n, density)
    top = min(floor_count(n, gamma), n - k)
    keep = ties.magnitude_cut(magnitudes, top + k, map_blocks)
    drop = ties.magnitude_cut(magnitudes, top, map_blocks)
    scale = None
    if rescale:
        before = magnitudes.sum()
        # the survivors' magnitudes, in place and in blocks (no second whole-tensor buffer), then one sum over the
        # whole tensor as mergekit's masked.abs().sum()
        keep_seen = drop_seen = 0
        for lo in range(0, n, ties.HISTOGRAM_BLOCK):
            _, keep_equal, drop_equal = trim(
                magnitudes[lo : lo + ties.HISTOGRAM_BLOCK], keep, drop, keep_seen, drop_seen
            )
            keep_seen, drop_seen = keep_seen + keep_equal, drop_seen + drop_equal
        after = magnitudes.sum()
        if not (before < RESCALE_EPS or after < RESCALE_EPS):
            scale = before / after
    return OutlierCut(keep, drop, scale)


def trim(
    delta: torch.Tensor, keep: ties.MagnitudeCut, drop: ties.MagnitudeCut, keep_seen: int, drop_seen: int
) -> tuple[torch.Tensor, int, int]:
    """Zero the elements of a chunk of one agent's task vector that breadcrumbs drops (in place); returns ``(delta,
    keep_equal, drop_equal)``, the chunk and its elements tied at each threshold.

    Args:
        delta: A chunk of the task vector, float32.
        keep: The cut keeping the ``top + k`` largest.
        drop: The cut keeping the ``top`` largest (the outliers).
        keep_seen: Elements tied at ``keep``'s threshold in earlier chunks of the tensor.
        drop_seen: Elements tied at ``drop``'s threshold in earlier chunks of the tensor.
    """
    outliers, drop_equal = ties.magnitude_trim(delta.clone(), drop, drop_seen)
    _, keep_equal = ties.magnitude_trim(delta, keep, keep_seen)
    # 1.0 where the element is no outlier (an outlier is nonzero: zeros are never among the kept largest)
    delta.mul_(torch.eq(outliers, 0, out=outliers))
    return delta, keep_equal, drop_equal


def prepare(view: TensorView) -> list[OutlierCut | None]:
    """Breadcrumbs' per-tensor preparation hook: each agent's :class:`OutlierCut` (``None``: density 1 keeps all)."""
    cuts: list[OutlierCut | None] = []
    for t in range(view.num_agents):
        density = view.agent_value(t, "density")
        if density >= 1:
            cuts.append(None)
            continue
        magnitudes, _ = view.magnitudes(t)
        cuts.append(
            outlier_cut(magnitudes, density, view.agent_value(t, "gamma"), view.params["rescale"], view.map_blocks)
        )
        del magnitudes
    return cuts


def scan(deltas: torch.Tensor, cuts: list[OutlierCut | None]) -> list[int]:
    """Breadcrumbs' scan hook: per agent, in agent order, the block's elements equal to its keep threshold, then to
    its drop threshold.

    Args:
        deltas: The block's float32 task vectors, shape ``(num_agents, n)``.
        cuts: The tensor's cut of each agent (``None``: the agent is not cut).
    """
    counts = []
    for t, cut in enumerate(cuts):
        if cut is None:
            counts += [0, 0]
        else:
            counts += [ties.count_at_cut(deltas[t], cut.keep), ties.count_at_cut(deltas[t], cut.drop)]
    return counts


def sparsify(inputs: ChunkInputs) -> None:
    """Apply every agent's cut (and rescale) to the chunk's task vectors, in place; update the running tie counts."""
    if inputs.prepared is None:
        raise RuntimeError(f"{inputs.name}: breadcrumbs needs the tensor's cuts before merging")
    for t, cut in enumerate(inputs.prepared):
        if cut is None:
            continue
        _, keep_equal, drop_equal = trim(
            inputs.deltas[t], cut.keep, cut.drop, inputs.seen[2 * t], inputs.seen[2 * t + 1]
        )
        inputs.seen[2 * t] += keep_equal
        inputs.seen[2 * t + 1] += drop_equal
        if cut.scale is not None:
            inputs.deltas[t].mul_(cut.scale)


def merge_linear(inputs: ChunkInputs) -> torch.Tensor:
    """``breadcrumbs``' chunk kernel: the cut, then task arithmetic."""
    sparsify(inputs)
    return linear.merge_task_arithmetic(inputs)


def merge_ties(inputs: ChunkInputs) -> torch.Tensor:
    """``breadcrumbs_ties``' chunk kernel: the cut, then sign election and the disjoint sum (mean with normalize)."""
    sparsify(inputs)
    return ties.merge_disjoint(inputs)


_GAMMA = Parameter(
    "gamma",
    float,
    DEFAULT_GAMMA,
    "agent",
    "fraction of the largest magnitudes dropped as outliers",
    minimum=0.0,
    maximum=1.0,
)


def _parameters(normalize_help: str) -> tuple[Parameter, ...]:
    return sparsified_parameters(
        False,
        normalize_help,
        False,
        "rescale the survivors to the task vector's L1 norm",
        "fraction of each task vector kept, after the outliers",
        _GAMMA,
    )


REFERENCE = "https://arxiv.org/abs/2312.06795"

BREADCRUMBS = MergeMethod(
    name="breadcrumbs",
    pretty_name="Model Breadcrumbs",
    description="drop the largest (gamma) and smallest magnitudes per tensor, keep density; task arithmetic",
    parameters=_parameters("divide by the sum of weights"),
    merge=merge_linear,
    prepare_tensor=prepare,
    scan=scan,
    scan_width=2,
    reference=REFERENCE,
)

BREADCRUMBS_TIES = MergeMethod(
    name="breadcrumbs_ties",
    pretty_name="Model Breadcrumbs with TIES",
    description="breadcrumbs' outlier and magnitude cut, then TIES sign election and disjoint merge",
    parameters=_parameters("disjoint mean (divide by the agreeing weights)"),
    merge=merge_ties,
    prepare_tensor=prepare,
    scan=scan,
    scan_width=2,
    reference=REFERENCE,
)
