"""Merge-aware RL: preview, while a stage trains, the merge of the current policy with the earlier stages' agents.

:class:`MergePreviewCallback` is the task-vector telemetry callback
(:class:`~ram_trl.callbacks.TaskVectorSparsityCallback`, whose tracker, prior stages, metric path and stage manifest it
shares) plus a merge preview. Every ``preview_every`` optimizer steps (default ``ceil(max_steps / 4)``), and at the
final step, it

1. saves the current policy in the stage's ``save_dtype`` exactly as the run will leave it
   (:func:`~ram_trl.callbacks.save_agent`) into a scratch directory beside the output,
2. merges it with the prior stages' agents (read from their manifests) with the real merge engine
   (:func:`ram_trl.merging.engine.merge`: global statistics, float32 arithmetic, the output in float32 by default), so the
   preview *is* the ``ram-trl merge`` of these checkpoints, bit for bit,
3. scores the merged model and the policy itself on every stage's validation prompts (a seeded subset of
   ``prompts`` per stage, 24 by default, recorded) with the evaluation the recipes use
   (:func:`ram_trl.evaluation.scoring.evaluate_model`, greedy by default, the RNG state of the training restored),

and logs, through the trainer's metric path (``log_history`` and every reporting integration), the merged score per
stage, the retention per stage ``(merged - base) / (specialist - base)`` and its mean, the merged average and the
policy's own score. With ``keep="best"`` the checkpoint at the step with the highest merged validation average is
the one left in the output directory (the last step's goes to ``OUTPUT/last``), and the manifest records which step
was kept and why (``extra["preview"]``), so ``ram-trl merge`` of the manifests reproduces the logged preview::

    cb = MergePreviewCallback(
        base_model="models/base", prior_stages=["runs/coding"], stage_name="tools",
        tasks=[EvalTask("coding", coding_val, ["pkg.rewards:coding"], "val"),
               EvalTask("tools", tools_val, ["pkg.rewards:tools"], "val")],
    )
    trainer = GRPOTrainer(..., callbacks=[cb]); cb.bind(trainer); trainer.train()

Cost: one preview writes the policy once (its size in ``save_dtype``) and the merged model once (float32 by default) to
disk beside the output, reads the prior agents, and loads the merged model and the policy once each on the CPU in
the evaluation dtype for generation; nothing is added on the accelerator. Under DDP the main rank writes the checkpoint,
every rank takes part in the merge (the engine's distributed merge: each rank merges its share of the tensors with the
global statistics), the main rank scores while the others wait, and every rank receives the scores. Under DeepSpeed
ZeRO-3 no rank gathers the policy for the merge: each merges its own partitions with the global statistics
(:func:`ram_trl.merging.range_merge.merge_ranges`), the merged values replace the partitions while the model is scored through
ZeRO-3's generation gathering, then the policy's partitions are restored (see docs/merge-preview.md). FSDP is refused
for now. Each trainer checkpoint holds the preview's state
(``checkpoint-N/ram_preview``), which a resumed run restores. The engine and the evaluation are imported when the
callback is built, so ``import ram_trl.callbacks.sparsity`` stays light.
"""

from __future__ import annotations

from ram_trl.callbacks.preview.callback import (
    PREVIEW_PREFIX,
    MergePreviewCallback,
    default_preview_every,
    preview_merge_config,
)
from ram_trl.callbacks.preview.scores import preview_prompt_indices
from ram_trl.callbacks.preview.state import CHECKPOINT_DIR, LAST_DIR, STATE_FILE, WORK_DIR, check_last_dir
from ram_trl.digest import weights_digest

__all__ = [
    "CHECKPOINT_DIR",
    "LAST_DIR",
    "PREVIEW_PREFIX",
    "STATE_FILE",
    "WORK_DIR",
    "MergePreviewCallback",
    "check_last_dir",
    "default_preview_every",
    "preview_merge_config",
    "preview_prompt_indices",
    "weights_digest",
]
