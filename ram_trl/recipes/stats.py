"""The statistics of a recipe's results: 95% intervals, retention, the merge to ship (docs/recipes-results.md)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from ram_trl.evaluation.retention import MIN_GAIN, mean_retention, retention

__all__ = [
    "LEVEL",
    "MIN_GAIN",
    "RESAMPLES",
    "bootstrap_means",
    "bootstrap_scores",
    "interval_of",
    "mean_retention",
    "percentile_interval",
    "resample_indices",
    "retention",
    "retention_samples",
    "select_best",
    "t_interval",
    "t_quantile",
]

LEVEL = 0.95  #: Coverage of every interval.
RESAMPLES = 2000  #: Bootstrap resamples by default.

# t(0.975, df) for df = 1..30 (scipy.stats.t.ppf, 6 decimals).
_T975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
    2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
    2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
)  # fmt: skip
_Z975 = 1.959963984540054


def t_quantile(df: int) -> float:
    """97.5th percentile of Student's t (exact to 6 decimals for df <= 30, then Cornish-Fisher, within 1e-5)."""
    if df < 1:
        raise ValueError(f"t_quantile: degrees of freedom {df} < 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def t_interval(values: Sequence[float]) -> tuple[float, float | None, float | None]:
    """Mean and 95% Student t interval of ``values`` (e.g. one score per seed)."""
    n = len(values)
    if n == 0:
        raise ValueError("t_interval: no values")
    mean = math.fsum(values) / n
    if n < 2:
        return mean, None, None
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def resample_indices(n: int, resamples: int = RESAMPLES, seed: int = 0, stream: int = 0) -> np.ndarray:
    """Bootstrap indices, ``resamples x n``, from ``numpy.random.default_rng([seed, stream])``."""
    rng = np.random.default_rng([seed, stream])
    return rng.integers(0, n, size=(resamples, n))


def bootstrap_means(values: Sequence[float], indices: np.ndarray) -> np.ndarray:
    """The mean of ``values`` under each row of ``indices`` (one bootstrap mean per resample)."""
    return np.asarray(values, dtype=np.float64)[indices].mean(axis=1)


def percentile_interval(samples: Sequence[float] | np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The ``(1 -+ level) / 2`` quantiles of ``samples`` (``numpy.quantile``, linear)."""
    array = np.asarray(samples, dtype=np.float64)
    low, high = np.quantile(array, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def bootstrap_scores(
    rewards: Mapping[str, Mapping[str, Sequence[float]]],
    stages: Sequence[str],
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> dict[str, dict[str, np.ndarray]]:
    """Paired bootstrap means of every model on every stage, and of its average over stages."""
    indices: dict[str, np.ndarray] = {}
    for stage in stages:
        sizes = {len(r[stage]) for r in rewards.values() if r.get(stage)}
        if len(sizes) > 1:
            raise ValueError(f"stage {stage!r}: models were scored on different numbers of prompts {sorted(sizes)}")
        if sizes:
            indices[stage] = resample_indices(sizes.pop(), resamples, seed, stream=zlib.crc32(stage.encode()))
    out: dict[str, dict[str, np.ndarray]] = {}
    for model, per_stage in rewards.items():
        means = {s: bootstrap_means(per_stage[s], indices[s]) for s in stages if per_stage.get(s)}
        if means:
            means["average"] = np.mean(np.stack(list(means.values())), axis=0)
        out[model] = means
    return out


def retention_samples(
    merge: Mapping[str, np.ndarray],
    base: Mapping[str, np.ndarray],
    specialists: Mapping[str, Mapping[str, np.ndarray]],
    verticals: Sequence[str],
) -> np.ndarray:
    """Per sample, the mean retention over ``verticals``; NaN where a specialist's gain is not positive."""
    ratios = []
    for v in verticals:
        gain = np.asarray(specialists[v][v]) - np.asarray(base[v])
        safe = np.where(gain > 0, gain, 1.0)
        ratios.append(np.where(gain > 0, (np.asarray(merge[v]) - np.asarray(base[v])) / safe, np.nan))
    return np.mean(np.stack(ratios), axis=0)


def interval_of(samples: np.ndarray, kind: str, level: float = LEVEL) -> tuple[float, float] | None:
    """The percentile interval (``"bootstrap"``) or the Student t interval of the mean (``"seeds"``)."""
    array = np.asarray(samples, dtype=np.float64)
    missing = np.isnan(array)
    if kind == "bootstrap":
        if not len(array) or missing.mean() > (1 - level) / 2:
            return None
        return percentile_interval(array[~missing], level)
    if kind != "seeds":
        raise ValueError(f"interval kind {kind!r}: use 'bootstrap' or 'seeds'")
    if missing.any() or len(array) < 2:
        return None
    _, low, high = t_interval([float(v) for v in array])
    return low, high  # type: ignore[return-value]


def select_best(candidates: Mapping[str, float | None]) -> str | None:
    """The key with the highest value (first among ties), ``None``-valued keys never picked."""
    best: str | None = None
    for key, value in candidates.items():
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if best is None or value > candidates[best]:
            best = key
    return best
