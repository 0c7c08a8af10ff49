"""What ``ram-trl run --resume`` may reuse of an earlier evaluation, by content digests (docs/recipes.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ram_trl.digest import file_digest, hasher, text_digest, weights_digest
from ram_trl.io.json_files import json_object_or_none

__all__ = ["EVALUATION_KEY", "evaluation_key", "model_digest", "reusable_evaluation", "reward_digests"]

EVALUATION_KEY = "inputs_sha256"  #: The key of ``RUN/eval/NAME.json`` that holds the digest it was computed for.

_NOT_READ = ("ram_*.json", "*.md", ".*")  #: Files no loader reads: ram_trl's records (they hold times), model cards.
#: Weight files, keyed by their tensors (:func:`~ram_trl.digest.weights_digest`), whatever the sharding.
_WEIGHTS = ("*.safetensors", "*.safetensors.index.json")


def model_digest(path: str | Path) -> str:
    """SHA-256 of a model directory's tensors (whatever the sharding) and every other file a loader may read."""
    directory = Path(path)
    digest = hasher()
    digest.update(weights_digest(directory).encode())
    for file in sorted(directory.iterdir()):
        if not file.is_file() or any(file.match(p) for p in _NOT_READ + _WEIGHTS):
            continue
        digest.update(f"|{file.name}|{file_digest(file)}".encode())
    return digest.hexdigest()


def reward_digests(tasks: list[Any]) -> tuple[dict[str, str] | None, str | None]:
    """The code digest of every reward function of ``tasks`` (:func:`~ram_trl.recipes.code_digest.reward_digest`)."""
    from ram_trl.evaluation.rewards import import_object
    from ram_trl.recipes.code_digest import UnsoundKey, reward_digest

    digests: dict[str, str] = {}
    for path in sorted({p for task in tasks for p in task.paths}):
        try:
            digests[path] = reward_digest(path, import_object(path, "reward function"))
        except UnsoundKey as exc:
            return None, f"reward {path}: {exc}"
    return digests, None


def evaluation_key(
    model: str, base: str, tasks: list[Any], settings: dict[str, Any], rewards: dict[str, str] | None = None
) -> str | None:
    """The digest of what one model's evaluation depends on; ``None`` when the rewards cannot be keyed."""
    from ram_trl.recipes.code_digest import library_versions

    if rewards is None:
        rewards, _ = reward_digests(tasks)
        if rewards is None:
            return None
    described = {
        "model": model,
        "base": base,
        "settings": settings,
        "libraries": library_versions(),
        "tasks": [
            {
                "stage": task.stage,
                "split": task.split,
                "rows": task.rows,
                "rewards": {p: rewards[p] for p in task.paths},
            }
            for task in tasks
        ],
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return text_digest(text)


def reusable_evaluation(file: Path, key: str | None) -> dict[str, Any] | None:
    """An earlier evaluation file's scores, when it was computed for ``key``."""
    if key is None:
        return None
    scored = json_object_or_none(file)
    return scored if scored and scored.get(EVALUATION_KEY) == key and "splits" in scored else None
