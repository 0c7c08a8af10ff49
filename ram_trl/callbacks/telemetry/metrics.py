"""The metrics one telemetry measurement reports, from its counts summed over processes.
Details: docs/telemetry.md ("What the callback logs")."""

from __future__ import annotations

import torch

from ram_trl.callbacks.telemetry.priors import PriorMasks
from ram_trl.statistics import MagnitudeStatistics, OverlapStatistics, TensorAnalysis
from ram_trl.statistics.anatomy import summarize

MAGNITUDE_KEYS = ("mean_abs", "std", "excess_kurtosis", "gini", "top_1pct_mass", "top_5pct_mass")


def _single(active: int, numel: int) -> OverlapStatistics:
    """One agent's overlap statistics from its active count (all its active elements are unique)."""
    return OverlapStatistics(
        1,
        torch.tensor([[0, active]], dtype=torch.int64),  # host
        torch.tensor([[active]], dtype=torch.int64),  # host
        numel,
    )


def measurement_metrics(
    names: list[str],
    counts: torch.Tensor,
    magnitudes: MagnitudeStatistics | None,
    overlap: OverlapStatistics,
    priors: PriorMasks | None,
    r: float,
    alpha: float,
) -> dict[str, float]:
    """The metrics (without prefix) from per-tensor ``counts`` rows ``(active, changed, active_saved, numel)``."""
    totals = counts.sum(dim=0).tolist()
    active, changed, active_saved, numel = (int(v) for v in totals)
    out: dict[str, float] = {
        "density": active / numel if numel else 0.0,
        "density_exact": changed / numel if numel else 0.0,
        "density_saved": active_saved / numel if numel else 0.0,
        "active": float(active),
        "changed": float(changed),
        "active_saved": float(active_saved),
        "numel": float(numel),
    }
    records = {
        name: TensorAnalysis(
            _single(int(c[0]), int(c[3])), _single(int(c[1]), int(c[3])), _single(int(c[2]), int(c[3]))
        )
        for name, c in zip(names, counts, strict=True)
    }
    buckets = summarize(records, 1)
    for bucket in buckets["modules"]:
        out[f"module/{bucket['module']}/density"] = bucket["density_bf16"][0]
    for bucket in buckets["layers"]:
        out[f"layer/{bucket['layer']}/density"] = bucket["density_bf16"][0]
    if magnitudes is not None:
        summary = magnitudes.summary(0)
        for key in MAGNITUDE_KEYS:
            out[f"magnitude/{key}"] = summary[key]
    if priors is not None:
        t = priors.num_priors
        mine = overlap.active(t)
        out["prior/overlap"] = overlap.shared(t) / mine if mine else 0.0
        for p, stage in enumerate(priors.stages):
            out[f"prior/{stage.name}/overlap"] = int(overlap.pairwise[t, p]) / mine if mine else 0.0
        out["prior/rho"] = overlap.rho(t)
        out["prior/lambda_ram_plus"] = overlap.lambdas(r, alpha)[t]
        out["prior/lambda_ram_plus_soft"] = overlap.lambdas(r, None, soft=True)[t]
    return out


__all__ = ["MAGNITUDE_KEYS", "measurement_metrics"]
