"""TIES merging: magnitude trimming, sign election, disjoint mean (Yadav et al., 2023). The exact ``k`` and the tie
rule (lowest flat index first, so whole tensors and row chunks agree): docs/methods.md."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ram_trl.methods.base import ChunkInputs, MergeMethod, TensorView
from ram_trl.methods.parameters import INT8_MASK, LAMBDA, WEIGHT, density, normalize
from ram_trl.statistics.counting import HISTOGRAM_BLOCK, keep_count  # noqa: F401 - re-exported, as before


@dataclass(frozen=True)
class MagnitudeCut:
    """Where magnitude trimming cuts one tensor of one agent.

    Args:
        threshold: The k-th largest magnitude; every element above it is kept.
        keep_equal: How many elements equal to ``threshold`` are kept, lowest flat index first.
        keep_all: Keep every element (``density >= 1``).
    """

    threshold: float
    keep_equal: int
    keep_all: bool = False


def magnitude_cut(magnitudes: torch.Tensor, k: int, map_blocks: BlockMapper | None = None) -> MagnitudeCut:
    """The :class:`MagnitudeCut` that keeps the ``k`` largest of ``magnitudes`` (a flat float tensor).

    The k-th largest magnitude is found by :func:`kth_largest_bits` when every magnitude is a finite float32 (else by
    ``torch.kthvalue``). When it is 0, every nonzero element is kept and the cut keeps everything (the same values:
    zeros stay zeros).

    Args:
        magnitudes: ``|tau|`` of one whole tensor, flattened.
        k: Elements to keep (see :func:`keep_count`).
        map_blocks: Runs a function over a list of blocks and returns its results in order (e.g. on a thread
            pool); default: one after the other.
    """
    n = magnitudes.numel()
    if k >= n:
        return MagnitudeCut(threshold=0.0, keep_equal=0, keep_all=True)
    if k <= 0:
        return MagnitudeCut(threshold=math.inf, keep_equal=0)
    found = kth_largest_bits(magnitudes, k, map_blocks) if magnitudes.dtype == torch.float32 else None
    if found is None:
        value = torch.kthvalue(magnitudes, n - k + 1).values
        above = int((magnitudes > value).sum())
        return MagnitudeCut(threshold=float(value), keep_equal=k - above)
    bits, above = found
    if bits == 0:
        return MagnitudeCut(threshold=0.0, keep_equal=0, keep_all=True)
    threshold = float(torch.tensor(bits, dtype=torch.int32).view(torch.float32))  # host
    return MagnitudeCut(threshold=threshold, keep_equal=k - above)


BlockMapper = Callable[[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]

#: High 16 bits of the float32 bit patterns of infinity and NaN (and above).
_FLOAT32_NONFINITE_HIGH = 0x7F80


def kth_largest_bits(
    magnitudes: torch.Tensor, k: int, map_blocks: BlockMapper | None = None
) -> tuple[int, int] | None:
    """The k-th largest of non-negative finite float32 values, by a radix select on their bit patterns.

    Non-negative float32 values are ordered like their bit patterns read as int32, so two histograms find the k-th
    largest exactly: one of the high 16 bits of every value, then one of the low 16 bits of the values in the bucket
    that holds it (``torch.bincount``, block by block: no sort, no selection, no temporary of the tensor's size).

    Args:
        magnitudes: Non-negative float32 values (``|tau|``: no negative zero), any shape, contiguous.
        k: Rank from the top, ``1 <= k <= numel``.
        map_blocks: See :func:`magnitude_cut`.

    Returns:
        ``(bits, above)``: the int32 bit pattern of the k-th largest value and the number of values strictly above
        it; ``None`` if a value is infinite or NaN (or has its sign bit set), which the caller handles otherwise.
    """
    run = map_blocks or (lambda fn, items: [fn(item) for item in items])
    bits = magnitudes.reshape(-1).view(torch.int32)
    blocks = list(bits.split(HISTOGRAM_BLOCK))
    counts = sum(run(_high_histogram, blocks))
    if int(counts[_FLOAT32_NONFINITE_HIGH:].sum()):
        return None
    bucket, above = _rank_from_top(counts[:_FLOAT32_NONFINITE_HIGH], k)
    inside = sum(run(lambda block: _low_histogram(block, bucket), blocks))
    low, above_inside = _rank_from_top(inside, k - above)
    return (bucket << 16) | low, above + above_inside


def _high_histogram(bits: torch.Tensor) -> torch.Tensor:
    """Counts of the high 16 bits of int32 bit patterns; negative patterns (sign bit set) land in bins from 0x8000."""
    return torch.bincount((bits >> 16) & 0xFFFF, minlength=1 << 16)


def _low_histogram(bits: torch.Tensor, bucket: int) -> torch.Tensor:
    """Counts of the low 16 bits of the int32 patterns whose high 16 bits are ``bucket``; integer arithmetic only (a
    boolean mask is slow to build): patterns below and above the bucket fall in two extra bins, dropped."""
    offsets = (bits - (bucket << 16)).clamp_(-1, 1 << 16).add_(1)
    return torch.bincount(offsets, minlength=(1 << 16) + 2)[1:-1]


def _rank_from_top(counts: torch.Tensor, k: int) -> tuple[int, int]:
    """The bin holding the k-th largest element of a histogram, and how many elements lie in higher bins."""
    from_top = torch.cumsum(counts.flip(0), dim=0)
    position = int(torch.searchsorted(from_top, k))  # first position with at least k elements at or above it
    above = int(from_top[position - 1]) if position else 0
    return counts.numel() - 1 - position, above


def count_at_cut(delta: torch.Tensor, cut: MagnitudeCut) -> int:
    """Elements of a chunk of one agent's task vector whose magnitude equals the cut's threshold (0 for a cut that
    keeps everything): :func:`magnitude_trim`'s ``equal_in_chunk``, without trimming.

    Args:
        delta: A chunk of one agent's task vector, float32, any shape (not modified).
        cut: The tensor's cut from :func:`magnitude_cut`.
    """
    if cut.keep_all:
        return 0
    magnitudes = delta.abs()
    return int(torch.count_nonzero(torch.eq(magnitudes, cut.threshold, out=magnitudes)))


def magnitude_trim(delta: torch.Tensor, cut: MagnitudeCut, equal_seen: int = 0) -> tuple[torch.Tensor, int]:
    """Zero every element of a chunk of one agent's task vector that the cut drops; returns ``(delta,
    equal_in_chunk)``, the trimmed chunk and the number of threshold-equal elements it held.

    Args:
        delta: A row chunk of one tensor's task vector (any shape), float32. Modified in place.
        cut: The tensor's cut from :func:`magnitude_cut`.
        equal_seen: Elements equal to the threshold in earlier chunks of the same tensor.
    """
    if cut.keep_all:
        return delta, 0
    magnitudes = delta.abs()
    # 1.0 / 0.0 flags rather than bools (float-writing comparisons are faster); the products are the same
    keep = torch.gt(magnitudes, cut.threshold, out=torch.empty_like(magnitudes))
    equal = torch.eq(magnitudes, cut.threshold, out=magnitudes)
    equal_in_chunk = int(torch.count_nonzero(equal))  # as count_at_cut
    if equal_in_chunk:
        rank = torch.cumsum(equal.reshape(-1), dim=0, dtype=torch.int64).reshape(equal.shape) + equal_seen
        keep += equal * (rank <= cut.keep_equal)  # disjoint from the elements above the cut
    return delta.mul_(keep), equal_in_chunk


def elect_sign(weighted: torch.Tensor) -> torch.Tensor:
    """Elected sign per element: the sign of the sum of the (weighted, trimmed) values; a zero sum elects ``+1``."""
    # (sum >= 0) * 2 - 1 with float flags: +1 or -1 exactly (NaN sums elect -1, as the comparison is false); several
    # times faster on the CPU than torch.where with a bool condition
    total = weighted.sum(dim=0)
    return torch.ge(total, 0, out=torch.empty_like(total)).mul_(2.0).sub_(1.0)


def disjoint_merge(
    deltas: torch.Tensor, weights: torch.Tensor, scale: float = 1.0, normalize: bool = True
) -> torch.Tensor:
    """Sign election and disjoint mean over already trimmed (or dropped) task vectors; shape ``(n,)``.

    Args:
        deltas: Float32 task vectors of shape ``(num_agents, n)``; entries that trimming removed are 0.
        weights: Per-agent weights, applied before the sign election.
        scale: The global scaling term ``lambda``.
        normalize: Divide by the summed weights of the agents that agree with the elected sign (the disjoint mean);
            otherwise sum the agreeing weighted values.
    """
    column = weights.to(deltas.dtype).unsqueeze(-1)
    weighted = deltas.mul_(column)
    # 1.0 / 0.0 flags rather than bools (float-writing comparisons are faster); the products are the same
    agree = torch.eq(torch.sign(weighted), elect_sign(weighted), out=torch.empty_like(weighted))
    merged = (weighted * agree).sum(dim=0)
    if normalize:
        divisor = (column * agree).sum(dim=0)
        divisor += torch.eq(divisor, 0, out=torch.empty_like(divisor))  # 0 -> 1, every other value unchanged
        merged.div_(divisor)
    if scale != 1.0:
        merged.mul_(scale)
    return merged


def prepare_cuts(view: TensorView) -> list[MagnitudeCut]:
    """TIES' per-tensor preparation hook: each agent's :class:`MagnitudeCut` of one whole tensor.

    An agent whose density keeps everything is not read; otherwise its ``|tau|`` is (one float32 task vector in
    memory at a time), and when it has at most ``k`` nonzero elements the cut keeps everything without a selection.

    Args:
        view: The tensor (each agent's ``density`` for it, and its magnitudes).
    """
    cuts = []
    for t in range(view.num_agents):
        k = keep_count(view.numel, view.agent_value(t, "density"))
        if k >= view.numel:
            cuts.append(MagnitudeCut(0.0, 0, keep_all=True))
            continue
        magnitudes, nonzero = view.magnitudes(t)
        if nonzero <= k:  # every nonzero element is kept (the k-th largest is 0): no selection needed
            cuts.append(MagnitudeCut(0.0, 0, keep_all=True))
        else:
            cuts.append(magnitude_cut(magnitudes, k, view.map_blocks))
        del magnitudes
    return cuts


def scan_ties(deltas: torch.Tensor, cuts: list[MagnitudeCut]) -> list[int]:
    """TIES' scan hook: per agent, the elements of a block equal to its cut's threshold (:func:`count_at_cut`), so
    that every block knows how many tied elements came before it (ties are kept lowest flat index first).

    Args:
        deltas: The block's float32 task vectors, shape ``(num_agents, n)``.
        cuts: The tensor's cut of each agent (the ``prepare_tensor`` hook's result).
    """
    return [count_at_cut(deltas[t], cut) for t, cut in enumerate(cuts)]


# ---------------------------------------------------------------------------------------------------------------
# The method (registered by :mod:`ram_trl.methods.registry`)


def trim(inputs: ChunkInputs) -> None:
    """Trim every agent's chunk of task vector at its cut (in place) and update the running tie counts."""
    if inputs.prepared is None:
        raise RuntimeError(f"{inputs.name}: TIES needs the tensor's magnitude cuts before merging")
    for t, cut in enumerate(inputs.prepared):
        _, equal = magnitude_trim(inputs.deltas[t], cut, inputs.seen[t])
        inputs.seen[t] += equal


def merge_disjoint(inputs: ChunkInputs) -> torch.Tensor:
    """:func:`disjoint_merge` of a chunk's (already sparsified) task vectors with the method's ``weight``,
    ``lambda`` and ``normalize``: the merge step of TIES, DARE-TIES, Breadcrumbs-TIES and DELLA."""
    return disjoint_merge(
        inputs.deltas, inputs.agent_params["weight"], inputs.params["lambda"], inputs.params["normalize"]
    )


def merge_ties(inputs: ChunkInputs) -> torch.Tensor:
    """TIES' chunk kernel: the magnitude trim, then sign election and the disjoint mean."""
    trim(inputs)
    return merge_disjoint(inputs)


def merge_untrimmed(inputs: ChunkInputs) -> torch.Tensor | None:
    """TIES without its trim (sign election and disjoint mean of the whole task vectors): the ``unstepped`` hook;
    ``None`` when every cut keeps everything (density 1)."""
    if inputs.prepared is not None and all(cut.keep_all for cut in inputs.prepared):
        return None
    return merge_disjoint(inputs)


TIES = MergeMethod(
    name="ties",
    pretty_name="TIES",
    description="per-tensor magnitude trim, sign election by sum, disjoint mean",
    parameters=(
        LAMBDA,
        normalize(True, "disjoint mean (divide by the agreeing weights)"),
        WEIGHT,
        density("fraction of each task vector kept (TIES: by magnitude; DARE: at random, 1 - p)"),
        INT8_MASK,
    ),
    merge=merge_ties,
    prepare_tensor=prepare_cuts,
    scan=scan_ties,
    unstepped=merge_untrimmed,
    step="trim",
    reference="https://arxiv.org/abs/2306.01708",
)
