"""The analysis result (the content of ``analysis.json``), assembled from the pass's records."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

import torch

import ram_trl
from ram_trl.analysis.inputs import AnalysisInputs
from ram_trl.io.checkpoint import Checkpoint
from ram_trl.merging.context import MergeState, check_densities
from ram_trl.merging.planner import TensorTask
from ram_trl.statistics import MagnitudeStatistics, TensorAnalysis
from ram_trl.statistics.anatomy import classify, summarize


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_summary(checkpoint: Checkpoint) -> dict[str, int]:
    """Elements per stored dtype in a checkpoint, over every tensor (a LoRA adapter's targets count as float32)."""
    out: dict[str, int] = {}
    for meta in checkpoint.tensors.values():
        key = _dtype_name(meta.dtype)
        out[key] = out.get(key, 0) + meta.numel
    return dict(sorted(out.items(), key=lambda item: -item[1]))


def build_result(
    inputs: AnalysisInputs,
    *,
    base: Checkpoint,
    agents: list[Checkpoint],
    tasks: list[TensorTask],
    records: dict[str, TensorAnalysis],
    magnitudes: MagnitudeStatistics,
    wide: list[bool],
) -> dict[str, Any]:
    """Assemble the analysis (the content of ``analysis.json``, without timings and figures)."""
    resolved = inputs.resolved
    n = len(agents)
    ordered = [(t.name, records[t.name]) for t in tasks]
    total = TensorAnalysis.zeros(n, any(wide))
    total.tensors = 0
    for _, record in ordered:
        total = total + record
    stats = total.eps
    state = MergeState(stats=stats)
    check_densities(resolved, state, emit=True)
    lambdas_plus = stats.lambdas(inputs.r, inputs.alpha)
    lambdas_soft = stats.lambdas(inputs.r, None, soft=True)
    bound = magnitudes.relative_bin_width
    entries = []
    for t, (spec, checkpoint) in enumerate(zip(resolved.agents, agents, strict=True)):
        entry: dict[str, Any] = {
            "index": spec.index,
            "name": spec.name,
            "path": str(spec.path),
            "kind": checkpoint.kind,
        }
        entry["dtypes"] = dtype_summary(checkpoint)
        entry.update(stats.as_dict(t))
        entry["overlap_shares"] = stats.overlap_shares(t)
        entry["lambda"] = {"ram_plus": lambdas_plus[t], "ram_plus_soft": lambdas_soft[t]}
        entry["changed"] = total.exact.active(t)
        entry["density_exact"] = total.exact.density(t)
        entry["bf16_view"] = wide[t]
        use_bf16 = wide[t] and total.bf16 is not None
        entry["active_bf16"] = total.bf16.active(t) if use_bf16 else None
        entry["density_bf16"] = total.bf16.density(t) if use_bf16 else None
        entry["magnitude"] = magnitudes.summary(t, numel=stats.numel)
        entries.append(entry)
    edges, counts = magnitudes.coarse_histogram()
    result: dict[str, Any] = {
        "ram_trl_version": ram_trl.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_model": str(resolved.base_path),
        "base_dtypes": dtype_summary(base),
        "parameters": {"eps": inputs.eps, "r": inputs.r, "alpha": inputs.alpha},
        "measured_on": "tau = float32(agent) - float32(base) of the stored values, as the merge computes it",
        "num_agents": n,
        "total_elements": stats.numel,
        "tensors": len(tasks),
        "agents": entries,
        "overall": {
            "union": stats.union(),
            "density_any": stats.union() / stats.numel if stats.numel else 0.0,
            "element_counts": stats.element_counts(),
            "element_counts_exact": total.exact.element_counts(),
            "element_counts_bf16": None if total.bf16 is None else total.bf16.element_counts(),
        },
        "jaccard": stats.jaccard_matrix(),
        "magnitude_estimates": {
            "histogram_bins_per_octave": 2**magnitudes.mantissa_bits,
            "gini_max_error": bound / 4,
            "top_mass_max_relative_error": bound,
            "fourth_power_sum_max_relative_error": magnitudes.fourth_power_relative_error,
            "note": "Gini and top-k mass from a |tau| histogram: gini in [exact - gini_max_error, exact], top-k "
            "mass within a relative top_mass_max_relative_error of exact; the kurtosis takes sum tau**4 (and "
            "tau**3) at each bin's mean, sum tau**4 at most fourth_power_sum_max_relative_error below exact; "
            "count, mean |tau|, mean and standard deviation are exact",
        },
        "magnitude_histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
        "anatomy": summarize(dict(ordered), n),
        "tensors_detail": [
            {
                "name": name,
                "module": classify(name).module,
                "layer": classify(name).layer,
                "numel": record.eps.numel,
                "dtypes": {
                    "base": _dtype_name(base.tensors[name].dtype),
                    "agents": [_dtype_name(a.tensors[name].dtype) if name in a.tensors else None for a in agents],
                },
                "active": [record.eps.active(t) for t in range(n)],
                "changed": [record.exact.active(t) for t in range(n)],
                "active_bf16": None if record.bf16 is None else [record.bf16.active(t) for t in range(n)],
            }
            for name, record in ordered
        ],
        "warnings": list(state.warnings) + list(resolved.notes),
    }
    return clean(result)


def clean(value: Any) -> Any:
    """A JSON-ready copy: infinite floats become ``"inf"`` (as in the merge report) and NaN becomes ``None``."""
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    return value


__all__ = ["build_result", "clean", "dtype_summary"]
