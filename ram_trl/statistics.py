"""Task-vector overlap statistics, accumulated chunk by chunk over a whole model.

This is the one implementation of the counts behind RAM's stage 2 (shared / unique / active elements per agent and
the overlap histogram). The merge's statistics pass, the merge report and the sparsity analysis all use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ram_trl.methods import ram


@dataclass
class OverlapStatistics:
    """Per-agent overlap histogram of active task-vector elements.

    ``histogram[t, k]`` counts the elements active in agent ``t`` that exactly ``k`` agents (``t`` included) update,
    for ``k = 1 .. num_agents``; column 0 is unused. Unique elements are ``k == 1``, shared ``k >= 2``.

    Args:
        num_agents: Number of agents.
        histogram: int64 tensor of shape ``(num_agents, num_agents + 1)``.
        numel: Elements counted (the model's size, or the tensor's for per-tensor statistics).
    """

    num_agents: int
    histogram: torch.Tensor
    numel: int = 0

    @classmethod
    def zeros(cls, num_agents: int) -> OverlapStatistics:
        return cls(num_agents, torch.zeros(num_agents, num_agents + 1, dtype=torch.int64), 0)

    def update(self, mask: torch.Tensor) -> None:
        """Add one chunk's activity mask (bool, shape ``(num_agents, n)``)."""
        counts = ram.overlap_counts(mask)
        for k in range(1, self.num_agents + 1):
            self.histogram[:, k] += (mask & (counts == k)).sum(dim=-1)
        self.numel += mask.shape[-1]

    def add(self, other: OverlapStatistics) -> None:
        self.histogram += other.histogram
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

    def lambdas(self, r: float, alpha: float | None, soft: bool = False) -> list[float]:
        """Rescale factors ``lambda_t`` for RAM+ (``soft=False``, clipped at ``alpha``) or RAM+s (``soft=True``)."""
        if soft:
            return [ram.soft_rescale_factor(self.rho(t), r) for t in range(self.num_agents)]
        assert alpha is not None
        return [ram.rescale_factor(self.rho(t), r, alpha) for t in range(self.num_agents)]

    def as_dict(self, t: int) -> dict[str, float | int | list[int]]:
        return {
            "active": self.active(t),
            "unique": self.unique(t),
            "shared": self.shared(t),
            "density": self.density(t),
            "rho": self.rho(t),
            "overlap_histogram": self.histogram[t, 1:].tolist(),
        }
