"""What a merge preview merges, how often, and the metric names it logs."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from ram_trl import defaults

PREVIEW_PREFIX = "merge_preview/"

__all__ = ["PREVIEW_PREFIX", "default_preview_every", "preview_merge_config", "preview_metrics"]


def default_preview_every(max_steps: int) -> int:
    """The default interval of the merge preview: ``ceil(max_steps / defaults.PREVIEW_COUNT)``, so a run previews
    about :data:`~ram_trl.defaults.PREVIEW_COUNT` times (the final step always), whatever its length.

    Args:
        max_steps: The run's optimizer steps.

    Returns:
        Optimizer steps between previews (at least 1).
    """
    return max(1, math.ceil(max_steps / defaults.PREVIEW_COUNT))


def preview_merge_config(
    base_model: str | os.PathLike,
    prior_stages: Sequence[str | os.PathLike],
    agent: str | os.PathLike,
    stage_name: str,
    method: str,
    parameters: dict[str, Any],
    seed: int,
) -> dict[str, Any]:
    """The merge config of a preview: the prior stages (by manifest), then the current agent, on the base.

    ``ram-trl merge`` of the same config with ``{"stage": OUTPUT}`` in place of the agent's ``{"model": ...}`` is the
    final merge of the finished stages.

    Args:
        base_model: The base checkpoint.
        prior_stages: Manifests (or their directories) of the earlier stages, in merge order.
        agent: The current agent's checkpoint directory.
        stage_name: The current stage's name (its label in the merge report).
        method: A registered merge method.
        parameters: The method's global parameters.
        seed: Seed of random drops (DARE).

    Returns:
        The config dict for :func:`ram_trl.merging.engine.merge` (written in float32, whatever the base's dtype).
    """
    return {
        "merge_method": method,
        "base_model": str(base_model),
        "models": [{"stage": str(p)} for p in prior_stages] + [{"model": str(agent), "name": stage_name}],
        "parameters": dict(parameters),
        "seed": seed,
        "out_dtype": "float32",
    }


def preview_metrics(record: dict[str, Any], kept_step: int | None) -> dict[str, float]:
    """The metrics logged for one preview's ``record`` (under :data:`PREVIEW_PREFIX`)."""
    p = PREVIEW_PREFIX
    metrics = {f"{p}score/{name}": float(value) for name, value in record["scores"].items()}
    metrics[f"{p}average"] = float(record["average"])
    metrics[f"{p}agent_score"] = float(record["agent_score"])
    metrics.update({f"{p}retention/{n}": float(v) for n, v in record["retention"].items() if v is not None})
    if record["retention_mean"] is not None:
        metrics[f"{p}retention_mean"] = float(record["retention_mean"])
    metrics[f"{p}kept_step"] = float(kept_step)
    metrics[f"{p}seconds"] = float(record["seconds"])
    return metrics
