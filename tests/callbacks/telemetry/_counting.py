"""Counting helpers shared by the distributed workers and the single-process reference of the shard tests.

Both sides count with :mod:`ram_trl.statistics` (the one implementation); this module only pairs trained and base
values and turns the statistics into JSON.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ram_trl.statistics import MagnitudeStatistics, OverlapStatistics

EPS = 1e-5


class Counts:
    """Task-vector counts of one agent: overlap + magnitude statistics and active elements per parameter."""

    def __init__(self) -> None:
        self.overlap = OverlapStatistics.zeros(1)
        self.magnitude = MagnitudeStatistics.zeros(1)
        self.per_parameter: dict[str, int] = {}

    def add(self, name: str, trained: torch.Tensor, base: torch.Tensor) -> None:
        tau = (trained.to(torch.float32) - base.to(torch.float32)).reshape(1, -1)
        mask = tau.abs() > EPS
        self.overlap.update(mask)
        self.magnitude.update(tau, mask)
        self.per_parameter[name] = self.per_parameter.get(name, 0) + int(mask.sum())

    def add_all(self, pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]]) -> Counts:
        for name, trained, base in pairs:
            self.add(name, trained, base)
        return self

    def as_json(self) -> dict:
        counts, sums = self.magnitude.counts[0].tolist(), self.magnitude.sums[0].tolist()  # each folds every bin
        return {
            "histogram": self.overlap.histogram.tolist(),
            "pairwise": self.overlap.pairwise.tolist(),
            "numel": self.overlap.numel,
            "magnitude_bins": {i: [count, sums[i]] for i, count in enumerate(counts) if count},
            "power_sums": self.magnitude.power_sums[0].tolist(),
            "per_parameter": dict(self.per_parameter),
        }
