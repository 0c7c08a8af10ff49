"""Task-vector overlap statistics, accumulated chunk by chunk over a whole model.

This is the one implementation of the counts behind RAM's stage 2 (shared / unique / active elements per agent,
the overlap histogram, pairwise co-activity). The merge's statistics pass, the merge report and the sparsity
analysis all use it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ram_trl.methods import ram
from ram_trl.methods.ties import keep_count

if TYPE_CHECKING:
    from ram_trl.distributed import DistContext

#: Up to this many agents, a chunk's masks are encoded as one subset code per element and counted with one bincount.
MAX_SUBSET_AGENTS = 12


@functools.cache
def _subset_tables(num_agents: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every subset code, its member agents ``(2**N, N)`` and its size one-hot ``(2**N, N + 1)``, as int64."""
    codes = torch.arange(2**num_agents, dtype=torch.int64)
    members = (codes.unsqueeze(1) >> torch.arange(num_agents)) & 1
    sizes = torch.nn.functional.one_hot(members.sum(dim=1), num_agents + 1)
    return members, sizes


@dataclass
class OverlapStatistics:
    """Per-agent overlap histogram and pairwise co-activity of active task-vector elements.

    ``histogram[t, k]`` counts the elements active in agent ``t`` that exactly ``k`` agents (``t`` included) update,
    for ``k = 1 .. num_agents``; column 0 is always 0. Unique elements are ``k == 1``, shared ``k >= 2``.
    ``pairwise[s, t]`` counts the elements active in both ``s`` and ``t`` (its diagonal is each agent's active count).

    Args:
        num_agents: Number of agents.
        histogram: int64 tensor of shape ``(num_agents, num_agents + 1)``.
        pairwise: int64 tensor of shape ``(num_agents, num_agents)``.
        numel: Elements counted (the model's size, or the tensor's for per-tensor statistics).
    """

    num_agents: int
    histogram: torch.Tensor
    pairwise: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int64))
    numel: int = 0

    @classmethod
    def zeros(cls, num_agents: int) -> OverlapStatistics:
        return cls(
            num_agents,
            torch.zeros(num_agents, num_agents + 1, dtype=torch.int64),
            torch.zeros(num_agents, num_agents, dtype=torch.int64),
            0,
        )

    def update(self, mask: torch.Tensor) -> None:
        """Add one chunk's activity mask (bool, shape ``(num_agents, n)``)."""
        n_agents = self.num_agents
        if n_agents <= MAX_SUBSET_AGENTS:
            code = ram.subset_codes(mask)
            subsets = torch.bincount(code.reshape(-1), minlength=2**n_agents).to(torch.int64)
            members, sizes = _subset_tables(n_agents)
            weighted = members * subsets.unsqueeze(1)
            self.histogram += weighted.T @ sizes
            self.pairwise += weighted.T @ members
        else:
            counts = ram.overlap_counts(mask)
            for k in range(1, n_agents + 1):
                at_k = counts == k
                for t in range(n_agents):
                    self.histogram[t, k] += torch.count_nonzero(mask[t] & at_k)
            for s in range(n_agents):
                for t in range(s, n_agents):
                    both = torch.count_nonzero(mask[s] & mask[t])
                    self.pairwise[s, t] += both
                    if s != t:
                        self.pairwise[t, s] += both
        self.histogram[:, 0] = 0
        self.numel += mask.shape[-1]

    def add(self, other: OverlapStatistics) -> None:
        self.histogram += other.histogram
        self.pairwise += other.pairwise
        self.numel += other.numel

    def active(self, t: int) -> int:
        return int(self.histogram[t, 1:].sum())

    def unique(self, t: int) -> int:
        return int(self.histogram[t, 1])

    def shared(self, t: int) -> int:
        return int(self.histogram[t, 2:].sum())

    def density(self, t: int) -> float:
        return self.active(t) / self.numel if self.numel else 0.0

    def rho(self, t: int) -> float:
        return ram.overlap_unique_ratio(self.shared(t), self.unique(t))

    def jaccard(self, s: int, t: int) -> float:
        """Jaccard index of the active sets of agents ``s`` and ``t``."""
        union = int(self.pairwise[s, s] + self.pairwise[t, t] - self.pairwise[s, t])
        return int(self.pairwise[s, t]) / union if union else 0.0

    def lambdas(self, r: float, alpha: float | None, soft: bool = False) -> list[float]:
        """Rescale factors ``lambda_t`` for RAM+ (``soft=False``, clipped at ``alpha``) or RAM+s (``soft=True``)."""
        if soft:
            return [ram.soft_rescale_factor(self.rho(t), r) for t in range(self.num_agents)]
        assert alpha is not None
        return [ram.rescale_factor(self.rho(t), r, alpha) for t in range(self.num_agents)]

    def overlap_shares(self, t: int) -> list[float]:
        """Share of agent ``t``'s active elements that exactly ``0, 1, ..., num_agents - 1`` OTHER agents also update
        (the RAM paper's figure 2, right); all zeros for an agent with no active element."""
        active = self.active(t)
        return [int(c) / active if active else 0.0 for c in self.histogram[t, 1:].tolist()]

    def element_counts(self) -> list[int]:
        """Elements updated by exactly ``k`` agents, for ``k = 0 .. num_agents`` (they sum to ``numel``).

        An element updated by ``k >= 1`` agents appears in ``k`` rows of column ``k`` of the histogram.
        """
        per_k = [int(self.histogram[:, k].sum()) // k for k in range(1, self.num_agents + 1)]
        return [self.numel - sum(per_k), *per_k]

    def union(self) -> int:
        """Elements updated by at least one agent."""
        return self.numel - self.element_counts()[0]

    def jaccard_matrix(self) -> list[list[float]]:
        """Pairwise Jaccard indices of the active sets (:meth:`jaccard`); the diagonal is 1 for an agent with any
        active element."""
        return [[self.jaccard(s, t) for t in range(self.num_agents)] for s in range(self.num_agents)]

    def all_reduce(self, ctx: DistContext) -> None:
        """Sum the counts of every rank of a distributed run into this object (no-op in a single process)."""
        if not ctx.enabled:
            return
        ctx.all_reduce_sum(self.histogram)
        ctx.all_reduce_sum(self.pairwise)
        self.numel = ctx.all_reduce_int(self.numel)

    def as_dict(self, t: int) -> dict[str, float | int | list[int]]:
        return {
            "active": self.active(t),
            "unique": self.unique(t),
            "shared": self.shared(t),
            "density": self.density(t),
            "rho": self.rho(t),
            "overlap_histogram": self.histogram[t, 1:].tolist(),
        }
