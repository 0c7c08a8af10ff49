"""Prompt rows of a stage: drawn from its generator or read from JSON Lines, written once per run so every
process (stage trainers, Fisher estimation, evaluation) sees the same prompts."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ram_trl.errors import ConfigError
from ram_trl.recipes.schema import StageSpec, import_object

__all__ = ["draw_rows", "draw_warm_rows", "read_jsonl", "write_jsonl"]


def read_jsonl(path: str | os.PathLike, what: str = "prompts file") -> list[dict[str, Any]]:
    """Rows of a JSON Lines file; each must be an object with a string ``prompt``.

    Raises:
        ConfigError: naming the file and line of a bad row.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{what} {path}, line {number}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ConfigError(f"{what} {path}, line {number}: expected an object with a string 'prompt'")
        rows.append(row)
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write rows as JSON Lines atomically (temporary sibling, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _resolve(path: str, root: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else root / p


def draw_rows(stage: StageSpec, root: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training and held-out rows of a stage.

    A generator is called as ``fn(train_size, seed, **kwargs)`` and ``fn(eval_size + train_size, seed + 1,
    **kwargs)``; held-out rows whose prompt is a training prompt are dropped and the first ``eval_size`` others
    kept, so held-out prompts are never trained on.

    Raises:
        ConfigError: naming the stage when the generator fails or returns bad rows.
    """
    spec = stage.prompts
    if spec is None:
        return [], []
    where = f"stage {stage.name!r}"
    if spec.generator is None:
        train = read_jsonl(_resolve(spec.train_file, root), f"{where}: train_file") if spec.train_file else []
        held = read_jsonl(_resolve(spec.eval_file, root), f"{where}: eval_file") if spec.eval_file else []
        return train, held
    generate = import_object(spec.generator, f"{where}: prompt generator")
    try:
        train = list(generate(spec.train_size, spec.seed, **spec.kwargs))
        pool = (
            list(generate(spec.eval_size + spec.train_size, spec.seed + 1, **spec.kwargs))
            if spec.eval_size
            else []
        )
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported with the stage's name
        raise ConfigError(f"{where}: prompt generator {spec.generator!r} failed: {exc!r}") from exc
    for row in (*train, *pool):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ConfigError(
                f"{where}: prompt generator {spec.generator!r} must return dicts with a 'prompt' string"
            )
    seen = {row["prompt"] for row in train}
    held = [row for row in pool if row["prompt"] not in seen][: spec.eval_size]
    return train, held


def draw_warm_rows(stage: StageSpec, held: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stage's warm-start rows: ``prompts.warm_size`` rows from its generator (seed ``seed + 2``), none of
    them a held-out prompt (``[]`` without a generator or with ``warm_size: 0``).

    Raises:
        ConfigError: naming the stage when the generator fails.
    """
    spec = stage.prompts
    if spec is None or spec.generator is None or spec.warm_size == 0:
        return []
    where = f"stage {stage.name!r}"
    generate = import_object(spec.generator, f"{where}: prompt generator")
    try:
        pool = list(generate(spec.warm_size + len(held), spec.seed + 2, **spec.kwargs))
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported with the stage's name
        raise ConfigError(
            f"{where}: prompt generator {spec.generator!r} failed drawing warm-start rows: {exc!r}"
        ) from exc
    excluded = {row["prompt"] for row in held}
    return [row for row in pool if row["prompt"] not in excluded][: spec.warm_size]
