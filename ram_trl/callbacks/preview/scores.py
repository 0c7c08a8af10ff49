"""The merge preview's evaluation: which validation prompts it scores, the reference scores (the base and the prior
agents), the scores of one preview and retention, all through the recipes' :mod:`ram_trl.evaluation.scoring`
(docs/merge-preview.md)."""

from __future__ import annotations

import contextlib
import math
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ram_trl.digest import weights_digest
from ram_trl.errors import ConfigError

__all__ = [
    "preview_prompt_indices",
    "record_retention",
    "reference_scores",
    "score_preview",
    "training_rng_kept",
    "validation_tasks",
]


def preview_prompt_indices(total: int, prompts: int | None, seed: int) -> list[int]:
    """Which validation prompts of a stage a preview scores: all when ``prompts`` is ``None`` or at least
    ``total``, else ``prompts`` of them drawn without replacement with ``random.Random(seed)``, in file order."""
    if prompts is None or prompts >= total:
        return list(range(total))
    return sorted(random.Random(seed).sample(range(total), prompts))


def validation_tasks(
    tasks: Sequence[Any], stages: Sequence[str], prompts: int | None, seed: int
) -> tuple[dict[str, Any], dict[str, list[int]], dict[str, int]]:
    """The validation prompts a preview scores, per merged stage (a seeded subset, :func:`preview_prompt_indices`),
    with every stage's reward functions imported now (errors before any training)."""
    from ram_trl.evaluation.scoring import EvalTask

    by_stage: dict[str, Any] = {}
    for task in tasks:
        if not isinstance(task, EvalTask):
            raise ConfigError(f"tasks: expected ram_trl.evaluation.EvalTask, got {type(task).__name__}")
        if task.stage in by_stage:
            raise ConfigError(f"tasks: stage {task.stage!r} appears more than once")
        by_stage[task.stage] = EvalTask(task.stage, list(task.rows), list(task.paths), split="val")
    indices: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for name in stages:
        task = by_stage.get(name)
        if task is None or not task.rows:
            raise ConfigError(
                f"merge preview: stage {name!r} has no validation prompts; give every merged stage's validation "
                "split in tasks=[EvalTask(stage, rows, reward_paths), ...] (a recipe stage needs prompts.val_size)"
            )
        if not task.paths:
            raise ConfigError(f"merge preview: stage {name!r} has no reward functions to score its prompts")
        task.functions()  # import errors now, not at the first preview
        indices[name] = preview_prompt_indices(len(task.rows), prompts, seed)
        sizes[name] = len(task.rows)
        by_stage[name] = EvalTask(name, [task.rows[i] for i in indices[name]], task.paths, split="val")
    return by_stage, indices, sizes


def reference_scores(
    base_model: str | os.PathLike, tasks: dict[str, Any], stages: Sequence[str], priors: Sequence[Any], evaluation: Any
) -> tuple[dict[str, float], dict[str, float]]:
    """The base's validation score on every merged stage and each prior agent's on its own stage (retention's
    reference points; this stage's specialist is the current policy)."""
    from ram_trl.evaluation.scoring import evaluate_model

    scored = [tasks[name] for name in stages]
    base = evaluate_model(base_model, scored, evaluation, progress=False)["splits"]["val"]["scores"]
    specialists = {}
    for prior in priors:
        scored = evaluate_model(prior.checkpoint, [tasks[prior.name]], evaluation, base=base_model, progress=False)
        specialists[prior.name] = scored["splits"]["val"]["scores"][prior.name]
    return dict(base), specialists


def score_preview(
    merged: Path,
    checkpoint: Path,
    step: int,
    tasks: dict[str, Any],
    stages: Sequence[str],
    evaluation: Any,
    base_model: str | os.PathLike,
    history: list[dict[str, Any]],
) -> dict[str, Any]:
    """The merged model's validation scores on every merged stage and the policy's on its own stage. Weights
    scored at an earlier preview (equal digests: bit-for-bit the same model) are not generated again: the
    evaluation is seeded, so their scores are the earlier ones."""
    from ram_trl.evaluation.scoring import evaluate_model

    merged_digest, agent_digest = weights_digest(merged), weights_digest(checkpoint)
    earlier = {r["merged_sha256"]: r for r in history}
    if merged_digest in earlier:
        scores = dict(earlier[merged_digest]["scores"])
    else:
        merged_tasks = [tasks[name] for name in stages]
        scored = evaluate_model(merged, merged_tasks, evaluation, base=base_model, progress=False)
        scores = dict(scored["splits"]["val"]["scores"])
    earlier = {r.get("agent_sha256"): r for r in history}
    if agent_digest in earlier:
        agent_score = earlier[agent_digest]["agent_score"]
    else:
        stage_name = stages[-1]
        own = evaluate_model(checkpoint, [tasks[stage_name]], evaluation, base=base_model, progress=False)
        agent_score = own["splits"]["val"]["scores"][stage_name]
    return {
        "step": step,
        "scores": scores,
        "average": math.fsum(scores.values()) / len(scores),
        "agent_score": agent_score,
        "merged_sha256": merged_digest,
        "agent_sha256": agent_digest,
    }


def record_retention(
    record: dict[str, Any],
    base_scores: dict[str, float],
    specialist_scores: dict[str, float],
    stages: Sequence[str],
    min_gain: float,
) -> dict[str, float | None]:
    """Per merged stage, the retention of a preview (:func:`ram_trl.evaluation.retention.retention`); this stage's
    specialist is the policy (the record's ``agent_score``)."""
    from ram_trl.evaluation.retention import retention

    specialists = {**specialist_scores, stages[-1]: record["agent_score"]}
    return {name: retention(record["scores"][name], base_scores[name], specialists[name], min_gain) for name in stages}


def training_rng_kept() -> contextlib.AbstractContextManager:
    """Save torch's CPU and CUDA random states and restore them on exit (the evaluation seeds torch)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    return torch.random.fork_rng(devices=devices)
