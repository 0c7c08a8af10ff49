"""Task-vector statistics accumulated chunk by chunk over a whole model, the one implementation the merge, its
report, ``ram-trl analyze`` and the telemetry share: which agents change which elements (:mod:`.overlap`) and how
large the active changes are (:mod:`.magnitude`)."""

from ram_trl.statistics.magnitude import MagnitudeStatistics, MagnitudeWorkspace, magnitude_bin_edges, sum_of_squares
from ram_trl.statistics.overlap import MAX_SUBSET_AGENTS, OverlapStatistics, TensorAnalysis, subset_counts

__all__ = [
    "MAX_SUBSET_AGENTS",
    "MagnitudeStatistics",
    "MagnitudeWorkspace",
    "OverlapStatistics",
    "TensorAnalysis",
    "magnitude_bin_edges",
    "subset_counts",
    "sum_of_squares",
]
