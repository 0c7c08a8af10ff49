"""What ``ram-trl run --resume`` may reuse of an earlier attempt's evaluation: a model's scores are kept when
nothing they depend on changed (the model's weights and configuration files, the base an adapter is merged into,
the held-out prompts, the reward functions' source files and the evaluation settings), checked by content digests,
never by file times (the merges are written again on every resume, byte-identical).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path
from typing import Any

__all__ = ["EVALUATION_KEY", "evaluation_key", "model_digest", "reusable_evaluation"]

#: The key of an evaluation file (``RUN/eval/NAME.json``) that holds the digest it was computed for.
EVALUATION_KEY = "inputs_sha256"

#: Small files of a model directory that change what it generates besides its weights.
_MODEL_FILES = (
    "config.json",
    "adapter_config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def model_digest(path: str | Path) -> str:
    """SHA-256 of a model or adapter directory's weights (every tensor, whatever the sharding) and of the files
    that change its generations (configuration, tokenizer, chat template).

    Args:
        path (`str` or `Path`): The model directory.

    Returns:
        `str`: The hex digest.
    """
    from ram_trl.callbacks.preview.scores import weights_digest

    directory = Path(path)
    digest = hashlib.sha256(weights_digest(directory).encode())
    for name in _MODEL_FILES:
        file = directory / name
        if file.is_file():
            digest.update(f"|{name}|".encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def _reward_source(path: str) -> str:
    """The source file of a reward function (``module:function``), or its path when it cannot be found."""
    from ram_trl.evaluation.rewards import import_object

    try:
        return Path(inspect.getfile(import_object(path, "reward function"))).read_text(encoding="utf-8")
    except (OSError, TypeError):
        return path


def evaluation_key(model: str, base: str, tasks: list[Any], settings: dict[str, Any]) -> str:
    """The digest of everything one model's evaluation depends on.

    Args:
        model (`str`): :func:`model_digest` of the model evaluated.
        base (`str`): :func:`model_digest` of the run's base (an adapter is merged into it).
        tasks (`list[EvalTask]`): The held-out prompts and reward functions, stage by stage and split by split.
        settings (`dict[str, Any]`): The evaluation settings (``EvaluationSpec.model_dump()``).

    Returns:
        `str`: The hex digest.
    """
    described = {
        "model": model,
        "base": base,
        "settings": settings,
        "tasks": [
            {
                "stage": task.stage,
                "split": task.split,
                "rows": task.rows,
                "rewards": {p: hashlib.sha256(_reward_source(p).encode()).hexdigest() for p in task.paths},
            }
            for task in tasks
        ],
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def reusable_evaluation(file: Path, key: str) -> dict[str, Any] | None:
    """An earlier evaluation file's scores, when it was computed for ``key``.

    Args:
        file (`Path`): ``RUN/eval/NAME.json``.
        key (`str`): :func:`evaluation_key` of the model now.

    Returns:
        `dict[str, Any]` or `None`: The file's content, ``None`` when it is missing, unreadable or for other inputs.
    """
    try:
        scored = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(scored, dict) or scored.get(EVALUATION_KEY) != key or "splits" not in scored:
        return None
    return scored
