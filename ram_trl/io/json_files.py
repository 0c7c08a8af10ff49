"""JSON objects read from the files beside tensors (``config.json``, indexes, adapter configs,
manifests), with one clear error naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ram_trl.errors import CheckpointError, RamTrlError


def read_json_object(path: Path, what: str, error: type[RamTrlError] = CheckpointError) -> dict[str, Any]:
    """A JSON file holding an object, or ``error`` naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{what} {path}: not valid JSON ({exc}); fix or remove it") from exc
    if not isinstance(data, dict):
        raise error(f"{what} {path}: must hold a JSON object, got {type(data).__name__}")
    return data


def json_object_or_none(path: Path) -> dict[str, Any] | None:
    """A JSON file's object, or ``None`` when the file is missing, unreadable or holds something else."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None
