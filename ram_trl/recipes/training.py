"""Each stage's telemetry while it trained, read from its ``trainer_state.json`` log history, for the results."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["TRAINER_STATE", "TRAINING_KEYS", "read_training", "training_curve"]

TRAINER_STATE = "trainer_state.json"  #: Written by the stage process with ``TrainerState.save_to_json``.

#: Telemetry keys (after the callback's prefix) kept per measurement, with the short name they get.
TRAINING_KEYS = {
    "density": "density",
    "density_saved": "density_saved",
    "density_exact": "density_exact",
    "magnitude/gini": "gini",
    "magnitude/top_1pct_mass": "top_1pct_mass",
}


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def training_curve(log_history: list[dict[str, Any]], prefix: str = "task_vector/") -> list[dict[str, Any]]:
    """The telemetry measurements in step order, each with the batch reward logged last at or before it."""
    rewards = sorted((int(e["step"]), _finite(e["reward"])) for e in log_history if "reward" in e and "step" in e)
    points = []
    for entry in log_history:
        if prefix + "density" not in entry:
            continue
        step = int(entry.get("step", len(points)))
        earlier = [value for at, value in rewards if at <= step]
        point: dict[str, Any] = {"step": step, "reward": earlier[-1] if earlier else None}
        for key, short in TRAINING_KEYS.items():
            point[short] = _finite(entry.get(prefix + key))
        points.append(point)
    return sorted(points, key=lambda p: p["step"])


def read_training(stage_dirs: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """Per stage, the telemetry curve of its ``trainer_state.json`` (stages without one left out)."""
    out = {}
    for name, directory in stage_dirs.items():
        path = Path(directory) / TRAINER_STATE
        if not path.is_file():
            continue
        try:
            history = json.loads(path.read_text(encoding="utf-8")).get("log_history") or []
        except (OSError, ValueError, AttributeError):
            continue
        curve = training_curve(history)
        if curve:
            out[name] = curve
    return out
