"""Overlap statistics of task vectors, accumulated chunk by chunk over a whole model: the counts behind RAM's stage 2
(active / unique / shared elements per agent, the overlap histogram, pairwise co-activity), shared by the merge, its
report, the analysis and the telemetry."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ram_trl.statistics import counting

if TYPE_CHECKING:
    from ram_trl.distributed import DistContext

MAX_SUBSET_AGENTS = 12  #: Up to this many agents, a chunk is counted by one subset code per element, one bincount.


@functools.cache
def _subset_tables(num_agents: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every subset code, its member agents ``(2**N, N)`` and its size one-hot ``(2**N, N + 1)``, as int64."""
    codes = torch.arange(2**num_agents, dtype=torch.int64)  # host
    members = (codes.unsqueeze(1) >> torch.arange(num_agents)) & 1  # host
    sizes = torch.nn.functional.one_hot(members.sum(dim=1), num_agents + 1)
    return members, sizes


def subset_counts(mask: torch.Tensor) -> torch.Tensor:
    """``out[code]``: the elements whose active agents are the bits of ``code`` (:func:`.counting.subset_codes`)."""
    num_agents = mask.shape[0]
    if num_agents > MAX_SUBSET_AGENTS:
        raise ValueError(f"subset counts take at most {MAX_SUBSET_AGENTS} agents, got {num_agents}")
    code = counting.subset_codes(mask)
    return torch.bincount(code.reshape(-1), minlength=2**num_agents).to(torch.int64)


@dataclass
class OverlapStatistics:
    """Per-agent overlap histogram and pairwise co-activity of active task-vector elements (``pairwise`` is ``(0, 0)``
    when not counted: the merge never reads it, so that its cost stays linear in the number of agents; ``histogram``
    has three bins, none / unique / shared, when only those are counted, see :meth:`summary`)."""

    num_agents: int
    histogram: torch.Tensor
    pairwise: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int64))  # host
    numel: int = 0

    @classmethod
    def zeros(cls, num_agents: int, pairwise: bool = True, histogram: bool = True) -> OverlapStatistics:
        size = num_agents if pairwise else 0
        bins = num_agents + 1 if histogram else min(num_agents + 1, 3)
        return cls(
            num_agents,
            torch.zeros(num_agents, bins, dtype=torch.int64),  # host
            torch.zeros(size, size, dtype=torch.int64),  # host
            0,
        )

    @classmethod
    def summary(cls, num_agents: int) -> OverlapStatistics:
        """The counts a merge keeps, at a cost linear in the number of agents: per agent active / unique / shared
        elements, the whole overlap histogram only up to :data:`MAX_SUBSET_AGENTS` agents, no pairwise counts."""
        return cls.zeros(num_agents, pairwise=False, histogram=num_agents <= MAX_SUBSET_AGENTS)

    @property
    def counts_pairs(self) -> bool:
        return self.pairwise.numel() > 0 or self.num_agents == 0

    @property
    def full_histogram(self) -> bool:
        """Whether :attr:`histogram` has a bin per number of active agents (else: none, unique, shared)."""
        return self.histogram.shape[1] == self.num_agents + 1

    def update(self, mask: torch.Tensor) -> None:
        """Add one chunk's activity mask (bool, or float ``0`` / ``1`` flags; shape ``(num_agents, n)``)."""
        n_agents = self.num_agents
        if n_agents <= MAX_SUBSET_AGENTS:
            self.add_subset_counts(subset_counts(mask), mask.shape[-1])
            return
        mask = mask.to(torch.bool)
        counts = counting.overlap_counts(mask)
        # the chunk's counts on the mask's device, added to the host totals once (one owner of the boundary)
        if not self.full_histogram:
            active = mask.sum(dim=1)
            unique = torch.logical_and(mask, counts == 1).sum(dim=1)
            self.histogram[:, 1:] += torch.stack([unique, active - unique], dim=1).cpu()
            self.numel += mask.shape[-1]
            return
        # histogram[t, k]: one bincount of (t, c) over the active elements, O(N n) (not one pass per k)
        cells = torch.arange(n_agents, device=mask.device).unsqueeze(1) * (n_agents + 1) + counts.to(torch.int64)
        histogram = torch.bincount(cells[mask], minlength=n_agents * (n_agents + 1)).view(n_agents, n_agents + 1)
        self.histogram += histogram.cpu()
        if self.counts_pairs:
            # pairwise[s, t]: one matrix product of the 0/1 rows, exact in float64 (a chunk holds < 2**53 elements)
            flags = mask.to(torch.float64)
            self.pairwise += (flags @ flags.T).round().to(torch.int64).cpu()
        self.numel += mask.shape[-1]

    def add_subset_counts(self, subsets: torch.Tensor, numel: int) -> None:
        """Add the elements counted per subset of active agents (:func:`subset_counts`) over ``numel`` elements."""
        members, sizes = _subset_tables(self.num_agents)
        weighted = members * subsets.cpu().to(torch.int64).unsqueeze(1)
        self.histogram += _binned(weighted.T @ sizes, self.histogram.shape[1])
        if self.counts_pairs:
            self.pairwise += weighted.T @ members
        self.histogram[:, 0] = 0
        self.numel += numel

    def add(self, other: OverlapStatistics) -> None:
        """Add ``other``'s counts (pairs, or a whole histogram, stay counted only when both have them)."""
        if self.histogram.shape == other.histogram.shape:
            self.histogram += other.histogram
        else:
            bins = min(self.histogram.shape[1], other.histogram.shape[1])
            self.histogram = _binned(self.histogram, bins) + _binned(other.histogram, bins)
        if self.counts_pairs and other.counts_pairs:
            self.pairwise += other.pairwise
        else:
            self.pairwise = self.pairwise.new_zeros(0, 0)
        self.numel += other.numel

    def __add__(self, other: OverlapStatistics) -> OverlapStatistics:
        """The counts of both, as a new object (e.g. to aggregate per-tensor statistics by module type)."""
        bins = min(self.histogram.shape[1], other.histogram.shape[1])
        return OverlapStatistics(
            self.num_agents,
            _binned(self.histogram, bins) + _binned(other.histogram, bins),
            self.pairwise + other.pairwise
            if self.counts_pairs and other.counts_pairs
            else self.pairwise.new_zeros(0, 0),
            self.numel + other.numel,
        )

    def active(self, t: int) -> int:
        return int(self.histogram[t, 1:].sum())

    def unique(self, t: int) -> int:
        return int(self.histogram[t, 1])

    def shared(self, t: int) -> int:
        return int(self.histogram[t, 2:].sum())

    def density(self, t: int) -> float:
        return self.active(t) / self.numel if self.numel else 0.0

    def rho(self, t: int) -> float:
        return counting.overlap_unique_ratio(self.shared(t), self.unique(t))

    def jaccard(self, s: int, t: int) -> float:
        """Jaccard index of the active sets of agents ``s`` and ``t``."""
        union = int(self.pairwise[s, s] + self.pairwise[t, t] - self.pairwise[s, t])
        return int(self.pairwise[s, t]) / union if union else 0.0

    def lambdas(self, r: float, alpha: float | None, soft: bool = False) -> list[float]:
        """Rescale factors ``lambda_t`` for RAM+ (``soft=False``, clipped at ``alpha``) or RAM+s (``soft=True``)."""
        if soft:
            return [counting.soft_rescale_factor(self.rho(t), r) for t in range(self.num_agents)]
        assert alpha is not None
        return [counting.rescale_factor(self.rho(t), r, alpha) for t in range(self.num_agents)]

    def overlap_shares(self, t: int) -> list[float]:
        """Share of agent ``t``'s active elements that exactly ``0, 1, ..., num_agents - 1`` OTHER agents also update
        (the RAM paper's figure 2, right); all zeros for an agent with no active element."""
        self._need_full_histogram()
        active = self.active(t)
        return [int(c) / active if active else 0.0 for c in self.histogram[t, 1:].tolist()]

    def element_counts(self) -> list[int]:
        """Elements updated by exactly ``k`` agents, for ``k = 0 .. num_agents`` (they sum to ``numel``)."""
        self._need_full_histogram()
        per_k = [int(self.histogram[:, k].sum()) // k for k in range(1, self.num_agents + 1)]
        return [self.numel - sum(per_k), *per_k]

    def _need_full_histogram(self) -> None:
        if not self.full_histogram:
            raise ValueError("these counts have no whole overlap histogram (OverlapStatistics.summary)")

    def union(self) -> int:
        """Elements updated by at least one agent."""
        return self.numel - self.element_counts()[0]

    def jaccard_matrix(self) -> list[list[float]]:
        """Pairwise Jaccard indices of the active sets (:meth:`jaccard`); 1 on the diagonal of an active agent."""
        return [[self.jaccard(s, t) for t in range(self.num_agents)] for s in range(self.num_agents)]

    def all_reduce(self, ctx: DistContext) -> None:
        """Sum the counts of every rank of a distributed run into this object (no-op in a single process)."""
        if not ctx.enabled:
            return
        ctx.all_reduce_sum(self.histogram)
        if self.counts_pairs:
            ctx.all_reduce_sum(self.pairwise)
        self.numel = ctx.all_reduce_int(self.numel)

    def as_dict(self, t: int) -> dict[str, float | int | list[int]]:
        return {
            "active": self.active(t),
            "unique": self.unique(t),
            "shared": self.shared(t),
            "density": self.density(t),
            "rho": self.rho(t),
            "overlap_histogram": self.histogram[t, 1:].tolist() if self.full_histogram else None,
        }


def _binned(histogram: torch.Tensor, bins: int) -> torch.Tensor:
    """A histogram over ``0 .. N`` active agents with its bins from 2 up summed into one when ``bins`` is 3."""
    if histogram.shape[1] == bins:
        return histogram
    return torch.cat([histogram[:, :2], histogram[:, 2:].sum(dim=1, keepdim=True)], dim=1)


@dataclass
class TensorAnalysis:
    """Overlap statistics of one tensor (or of a bucket of tensors) in the three views of the analysis."""

    eps: OverlapStatistics
    exact: OverlapStatistics
    bf16: OverlapStatistics | None
    tensors: int = 1

    @classmethod
    def zeros(cls, num_agents: int, bf16: bool) -> TensorAnalysis:
        """Empty statistics of ``num_agents`` agents in every view."""
        return cls(
            OverlapStatistics.zeros(num_agents),
            OverlapStatistics.zeros(num_agents),
            OverlapStatistics.zeros(num_agents) if bf16 else None,
        )

    def __add__(self, other: TensorAnalysis) -> TensorAnalysis:
        bf16 = self.bf16 + other.bf16 if self.bf16 is not None and other.bf16 is not None else None
        return TensorAnalysis(self.eps + other.eps, self.exact + other.exact, bf16, self.tensors + other.tensors)
