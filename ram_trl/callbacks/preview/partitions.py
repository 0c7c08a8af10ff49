"""The merge preview under DeepSpeed ZeRO-3: each rank merges its own partitions, no rank gathers the policy for the
merge (docs/merge-preview.md, "Distributed")."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ram_trl.callbacks import deepspeed_adapter
from ram_trl.callbacks.preview.scores import training_rng_kept
from ram_trl.callbacks.sparsity import library_versions
from ram_trl.digest import weights_digest
from ram_trl.errors import ConfigError
from ram_trl.stage.save import policy_of

logger = logging.getLogger(__name__)

__all__ = ["PartitionPreview", "check_partitioned", "preview_partitions", "score_gathered", "swapped_partitions"]


@dataclass
class PartitionPreview:
    """What one partition-local preview takes from its callback (so this module never holds the callback)."""

    trainer: Any
    save_dtype: torch.dtype
    merge_config: dict[str, Any]
    history: list[dict[str, Any]]
    tasks: dict[str, Any]
    stage_name: str
    merged_stages: list[str]
    tokenizer: Callable[[], Any]
    evaluation: Any
    share: Callable[[Any], Any]


def check_partitioned(
    resolved_method: Any, deepspeed_config: dict[str, Any], policy: Any, evaluation_dtype: str
) -> None:
    """Refuse, at train begin, what a partition-local preview cannot do (before any training step)."""
    from ram_trl.merging.range_merge import check_range_method

    check_range_method(resolved_method)
    zero = deepspeed_config.get("zero_optimization") or {}
    if zero.get("stage3_gather_16bit_weights_on_model_save") in (None, False, "false", "False"):
        raise ConfigError(
            "the merge preview saves the policy at every preview, which under DeepSpeed ZeRO-3 needs "
            "stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed config's zero_optimization "
            "(zero3_save_16bit_model: true in an accelerate config)"
        )
    if hasattr(policy, "peft_config"):
        raise ConfigError(
            "the merge preview under DeepSpeed ZeRO-3 merges the policy's full weights; a PEFT (LoRA) policy is "
            "not supported there (use DDP or ZeRO-1/2, or train without the preview)"
        )
    dtypes = {p.dtype for p in policy.parameters()}
    wanted = getattr(torch, evaluation_dtype)
    if dtypes != {wanted}:
        logger.warning(
            "merge preview under ZeRO-3: the model is scored in its training dtype (%s), not the evaluation dtype "
            "(%s); the merged weights are those of `ram-trl merge`, the scores may differ from `ram-trl eval` in "
            "the last digits (set evaluation.dtype to the training dtype to make them equal)",
            ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)),
            evaluation_dtype,
        )


def preview_partitions(preview: PartitionPreview, checkpoint: Path, step: int) -> dict[str, Any]:
    """One preview's record under DeepSpeed ZeRO-3 (every rank calls it): each rank merges its own partition of
    every parameter with the global statistics (no parameter gathered); the merged values then replace the
    partitions while the model is scored, and the policy's partitions are restored afterwards."""
    from ram_trl.callbacks.telemetry.base_weights import base_name
    from ram_trl.callbacks.telemetry.shards import iter_local_shards, training_context
    from ram_trl.merging.config.resolve import resolve_config
    from ram_trl.merging.config.schema import load_config
    from ram_trl.merging.range_merge import FlatRange, merge_ranges

    ctx = training_context()
    policy = policy_of(preview.trainer.model)
    shards = list(iter_local_shards(policy))
    saved = [
        FlatRange(
            base_name(s.name),
            s.offset,
            s.values.to(device="cpu", dtype=preview.save_dtype),  # on the host: no copy on the accelerator
            counted=s.partitioned or ctx.is_main,
        )
        for s in shards
    ]
    start = time.perf_counter()
    # the config names the saved policy (the last agent); merge_ranges takes its values from `saved` instead
    resolved = resolve_config(load_config(preview.merge_config)[0])
    result = ctx.guarded(lambda: merge_ranges(resolved, len(resolved.agents) - 1, saved, ctx))
    merge_seconds = time.perf_counter() - start
    agent_digest = preview.share(weights_digest(checkpoint) if ctx.is_main else None)
    merged_scores = {r["merged_sha256"]: r["scores"] for r in preview.history}.get(result.digest)
    agent_score = {r.get("agent_sha256"): r["agent_score"] for r in preview.history}.get(agent_digest)
    with swapped_partitions(preview.trainer.model_wrapped, shards) as swap:
        if agent_score is None:
            swap([r.values for r in saved])
            agent_score = score_gathered(preview, [preview.tasks[preview.stage_name]])[preview.stage_name]
        if merged_scores is None:
            swap(result.values)
            merged_scores = score_gathered(preview, [preview.tasks[name] for name in preview.merged_stages])
    record = {
        "step": step,
        "scores": dict(merged_scores),
        "average": math.fsum(merged_scores.values()) / len(merged_scores),
        "agent_score": agent_score,
        "merged_sha256": result.digest,
        "agent_sha256": agent_digest,
        "merge_seconds": round(merge_seconds, 4),
        "merge_processes": ctx.world_size,
        "merge_kind": "partitions",
    }
    return preview.share(record if ctx.is_main else None)  # the main rank's timings


def score_gathered(preview: PartitionPreview, tasks: list[Any]) -> dict[str, float]:
    """Scores of the model as its partitions now hold it (every rank calls it): the parameters are gathered the
    way TRL gathers them for its training generation, and every rank generates the same completions in step with
    the others (ZeRO-3's forward hooks and ``generate``'s ``synced_gpus`` are collectives); the main rank's scores
    are shared."""
    from trl.models.utils import unwrap_model_for_generation

    from ram_trl.evaluation.scoring import evaluate_loaded

    accelerator = preview.trainer.accelerator
    with unwrap_model_for_generation(preview.trainer.model_wrapped, accelerator) as unwrapped:
        model = policy_of(unwrapped)
        training = model.training
        model.eval()
        try:
            with training_rng_kept():
                scored = evaluate_loaded(model, preview.tokenizer(), tasks, preview.evaluation, progress=False)
        finally:
            model.train(training)
    scores = dict(scored["splits"]["val"]["scores"])
    return preview.share(scores if accelerator.is_main_process else None)


@contextlib.contextmanager
def swapped_partitions(engine: Any, shards: list[Any]):
    """Let values replace a DeepSpeed ZeRO-3 model's local partitions, and restore the partitions on exit."""
    release = deepspeed_adapter.release_gathered(engine)
    if release is None:
        raise ConfigError(
            f"the merge preview under DeepSpeed ZeRO-3 needs the ZeRO-3 optimizer's "
            f"parameter_offload.partition_all_parameters() (DeepSpeed >= 0.10); {type(engine.optimizer).__name__} "
            f"of DeepSpeed {library_versions().get('deepspeed', '(not installed)')} has none"
        )
    backup = [s.values.detach().to("cpu", copy=True) for s in shards]

    def write(values: Sequence[torch.Tensor]) -> None:
        release()
        with torch.no_grad():
            for shard, value in zip(shards, values, strict=True):
                shard.values.copy_(value.to(shard.values.device))

    try:
        yield write
    finally:
        write(backup)
        deepspeed_adapter.regather_persistent(engine)
