"""A stage's prompt rows, drawn or read once per run and written so every process sees the same prompts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ram_trl.errors import ConfigError
from ram_trl.evaluation.rewards import import_object
from ram_trl.output import atomic_file
from ram_trl.recipes.schema import StageSpec

__all__ = ["draw_splits", "draw_warm_rows", "read_jsonl", "split_check_rows", "write_jsonl"]


def read_jsonl(path: str | os.PathLike, what: str = "prompts file") -> list[dict[str, Any]]:
    """Rows of a JSON Lines file; each must be an object with a string ``prompt``."""
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


#: Keyword arguments TRL passes to reward functions itself: a prompt column of one of these names would clash.
RESERVED_COLUMNS = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"})


def check_rows(rows: Any, where: str, what: str, expected: int | None = None) -> list[dict[str, Any]]:
    """Validate prompt rows: objects with a non-empty string ``prompt``, JSON-writable, no TRL-reserved column."""
    if isinstance(rows, dict | str | bytes) or rows is None or not hasattr(rows, "__iter__"):
        raise ConfigError(f"{where}: {what} must return a list of rows, got {type(rows).__name__}")
    rows = list(rows)
    for index, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ConfigError(
                f"{where}: {what}: row {index} must be an object with a non-empty string 'prompt', got {row!r:.80}"
            )
        clash = sorted(RESERVED_COLUMNS & set(row))
        if clash:
            raise ConfigError(
                f"{where}: {what}: row {index} has column {clash[0]!r}, a name TRL passes to reward functions "
                "itself; rename the column"
            )
        try:
            json.dumps(row, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {what}: row {index} cannot be written as JSON ({exc})") from None
    if expected is not None and len(rows) < expected:
        raise ConfigError(f"{where}: {what} returned {len(rows)} rows, {expected} were asked for")
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write rows as JSON Lines atomically (temporary sibling, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "prompts file") as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True) + "\n")
    return path


def _resolve(path: str, root: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else root / p


def draw_splits(
    stage: StageSpec, root: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The training, held-out test and validation rows of a stage."""
    spec = stage.prompts
    if spec is None:
        return [], [], []
    where = f"stage {stage.name!r}"
    val_size = spec.validation_size
    if spec.generator is None:
        files = {}
        for key in ("train_file", "eval_file", "val_file"):
            name = getattr(spec, key)
            path = _resolve(name, root) if name else None
            files[key] = check_rows(read_jsonl(path, f"{where}: {key}"), where, f"{key} {path}") if path else []
        train, held, val = files["train_file"], files["eval_file"], files["val_file"]
        if spec.train_file and not train:
            raise ConfigError(f"{where}: train_file {spec.train_file} holds no rows")
        leaked = {r["prompt"] for r in held} & {r["prompt"] for r in train}
        if leaked:
            raise ConfigError(
                f"{where}: {len(leaked)} eval_file prompts are also training prompts (e.g. {sorted(leaked)[0]!r}); "
                "test prompts must be held out: remove them from one of the files"
            )
        clash = {r["prompt"] for r in val} & ({r["prompt"] for r in train} | {r["prompt"] for r in held})
        if clash:
            raise ConfigError(
                f"{where}: {len(clash)} val_file prompts are also training or eval_file prompts "
                f"(e.g. {sorted(clash)[0]!r}); validation prompts must be disjoint from both"
            )
        return train, held, val
    generate = import_object(spec.generator, f"{where}: prompt generator")
    what = f"prompt generator {spec.generator!r}"
    wanted = spec.eval_size + val_size
    try:
        train = generate(spec.train_size, spec.seed, **spec.kwargs)
        pool = generate(wanted + spec.train_size, spec.seed + 1, **spec.kwargs) if wanted else []
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported with the stage's name
        raise ConfigError(f"{where}: {what} failed: {exc!r}") from exc
    train = check_rows(train, where, what, expected=spec.train_size)
    pool = check_rows(pool, where, what)
    seen = {row["prompt"] for row in train}
    others = []
    for row in pool:
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            others.append(row)
    held, val = others[: spec.eval_size], others[spec.eval_size : spec.eval_size + val_size]
    if len(held) < spec.eval_size:
        raise ConfigError(
            f"{where}: only {len(held)} of prompts.eval_size={spec.eval_size} test prompts are distinct from the "
            f"{len(train)} training prompts; lower eval_size or train_size, or make the generator vary its prompts"
        )
    if len(val) < val_size:
        raise ConfigError(
            f"{where}: only {len(val)} of prompts.val_size={val_size} validation prompts are distinct from the "
            f"{len(train)} training and {len(held)} test prompts; lower val_size or train_size"
        )
    return train, held, val


def draw_warm_rows(stage: StageSpec, held: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stage's ``prompts.warm_size`` warm-start rows (generator seed ``seed + 2``), none a prompt of ``held``."""
    spec = stage.prompts
    if spec is None or spec.generator is None or spec.warm_size == 0:
        return []
    where = f"stage {stage.name!r}"
    generate = import_object(spec.generator, f"{where}: prompt generator")
    try:
        pool = generate(spec.warm_size + len(held), spec.seed + 2, **spec.kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported with the stage's name
        raise ConfigError(
            f"{where}: prompt generator {spec.generator!r} failed drawing warm-start rows: {exc!r}"
        ) from exc
    pool = check_rows(pool, where, f"prompt generator {spec.generator!r} (warm-start rows)")
    excluded = {row["prompt"] for row in held}
    return [row for row in pool if row["prompt"] not in excluded][: spec.warm_size]


def split_check_rows(
    warm: list[dict[str, Any]], train: list[dict[str, Any]], size: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split off the warm start's check rows: the first ``size`` warm rows that are not training prompts."""
    training = {row["prompt"] for row in train}
    check: list[dict[str, Any]] = []
    for row in warm:
        if len(check) == size:
            break
        if row["prompt"] not in training:
            check.append(row)
    held = {row["prompt"] for row in check}
    return [row for row in warm if row["prompt"] not in held], check
