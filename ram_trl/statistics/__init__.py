"""Task-vector statistics, accumulated chunk by chunk over a whole model: the one implementation of the counts
that the merge, its report, ``ram-trl analyze`` and the telemetry share.

- :mod:`ram_trl.statistics.overlap`: which agents change which elements (:class:`OverlapStatistics`, RAM's
  shared / unique counts, the overlap histogram, pairwise co-activity; :class:`TensorAnalysis`).
- :mod:`ram_trl.statistics.magnitude`: how large the active changes are (:class:`MagnitudeStatistics`: mean
  ``|tau|``, excess kurtosis, Gini coefficient, top-k L1 mass; exact and histogram estimators).
"""

from ram_trl.statistics.magnitude import (
    MagnitudeStatistics,
    MagnitudeWorkspace,
    magnitude_bin,
    magnitude_bin_edges,
    sum_of_squares,
)
from ram_trl.statistics.overlap import MAX_SUBSET_AGENTS, OverlapStatistics, TensorAnalysis, subset_counts

__all__ = [
    "MAX_SUBSET_AGENTS",
    "MagnitudeStatistics",
    "MagnitudeWorkspace",
    "OverlapStatistics",
    "TensorAnalysis",
    "magnitude_bin",
    "magnitude_bin_edges",
    "subset_counts",
    "sum_of_squares",
]
