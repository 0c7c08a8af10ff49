"""Merge-aware RL: preview, while a stage trains, the merge of the current policy with the earlier stages' agents.

:class:`MergePreviewCallback` is the task-vector telemetry callback
(:class:`~ram_trl.callbacks.TaskVectorSparsityCallback`, whose tracker, prior stages, metric path and stage manifest it
shares) plus a merge preview. Every ``preview_every`` optimizer steps (default ``ceil(max_steps / 4)``), and at the
final step, it

1. saves the current policy in the stage's ``save_dtype`` exactly as the run will leave it
   (:func:`~ram_trl.callbacks.save_agent`) into a scratch directory beside the output,
2. merges it with the prior stages' agents (read from their manifests) with the real merge engine
   (:func:`ram_trl.engine.merge`: global statistics, float32 arithmetic, the output in the base's dtype), so the
   preview *is* the ``ram-trl merge`` of these checkpoints, bit for bit,
3. scores the merged model and the policy itself on every stage's validation prompts (a seeded subset of
   ``prompts`` per stage, 24 by default, recorded) with the recipes' evaluation
   (:func:`ram_trl.recipes.evaluate.evaluate_model`, greedy by default, the RNG state of the training restored),

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

Cost: one preview writes the policy once (its size in ``save_dtype``) and the merged model once (the base's dtype) to
disk beside the output, reads the prior agents, and loads the merged model and the policy once each on the CPU in
the evaluation dtype for generation; nothing is added on the accelerator. Under DDP the main rank writes the checkpoint,
every rank takes part in the merge (the engine's distributed merge: each rank merges its share of the tensors with the
global statistics), the main rank scores while the others wait, and every rank receives the scores. Under DeepSpeed
ZeRO-3 no rank gathers the policy for the merge: each merges its own partitions with the global statistics
(:func:`ram_trl.range_merge.merge_ranges`), the merged values replace the partitions while the model is scored through
ZeRO-3's generation gathering, then the policy's partitions are restored (see docs/merge-preview.md). FSDP is refused
for now. Each trainer checkpoint holds the preview's state
(``checkpoint-N/ram_preview``), which a resumed run restores. The engine and the evaluation are imported when the
callback is built, so ``import ram_trl.callbacks`` stays light.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from ram_trl import defaults
from ram_trl.callbacks import (
    TaskVectorSparsityCallback,
    agent_output,
    last_reward_metrics,
    library_versions,
    policy_of,
    save_agent,
)
from ram_trl.errors import ConfigError
from ram_trl.manifest import StageManifest
from ram_trl.telemetry.priors import read_prior_stages
from ram_trl.telemetry.shards import training_context

logger = logging.getLogger(__name__)

#: Prefix of the preview's metric names.
PREVIEW_PREFIX = "merge_preview/"
#: Name of the scratch directory inside the output directory (removed at train end).
WORK_DIR = ".ram_preview"
#: Where the last step's agent goes when an earlier step is kept.
LAST_DIR = "last"
#: The preview's state inside each trainer checkpoint (``checkpoint-N/ram_preview``): its history and the best and
#: last previewed checkpoints (hard links), so a resumed run keeps the argmax over the whole run.
CHECKPOINT_DIR = "ram_preview"
STATE_FILE = "state.json"

__all__ = [
    "CHECKPOINT_DIR",
    "LAST_DIR",
    "PREVIEW_PREFIX",
    "MergePreviewCallback",
    "default_preview_every",
    "check_last_dir",
    "preview_merge_config",
    "preview_prompt_indices",
    "weights_digest",
]


def default_preview_every(max_steps: int) -> int:
    """The default interval of the merge preview: ``ceil(max_steps / defaults.PREVIEW_COUNT)``, so a run previews
    about :data:`~ram_trl.defaults.PREVIEW_COUNT` times (the final step always), whatever its length.

    Args:
        max_steps: The run's optimizer steps.

    Returns:
        Optimizer steps between previews (at least 1).
    """
    return max(1, math.ceil(max_steps / defaults.PREVIEW_COUNT))


def preview_prompt_indices(total: int, prompts: int | None, seed: int) -> list[int]:
    """Which validation prompts of a stage a preview scores: all when ``prompts`` is ``None`` or at least
    ``total``, else ``prompts`` of them drawn without replacement with ``random.Random(seed)``, in file order.

    Args:
        total: The stage's validation prompts.
        prompts: How many to score (``None``: all).
        seed: Seed of the draw (the callback's ``seed``).

    Returns:
        The sorted row indices.
    """
    if prompts is None or prompts >= total:
        return list(range(total))
    return sorted(random.Random(seed).sample(range(total), prompts))


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
        The config dict for :func:`ram_trl.engine.merge`.
    """
    return {
        "merge_method": method,
        "base_model": str(base_model),
        "models": [{"stage": str(p)} for p in prior_stages] + [{"model": str(agent), "name": stage_name}],
        "parameters": dict(parameters),
        "seed": seed,
    }


class MergePreviewCallback(TaskVectorSparsityCallback):
    """Task-vector telemetry plus a preview of the merge with the prior stages, keeping the step that merges best.

    Args:
        trainer (`transformers.Trainer`, *optional*):
            The trainer (or :meth:`bind` it later).
        base_model (`str` or `os.PathLike`):
            The base checkpoint on disk (required: the merge reads it).
        prior_stages (`Sequence[str | os.PathLike]`, *optional*, defaults to `()`):
            Manifests (or their directories) of the stages merged with this one, in merge order. May be empty (the
            preview is then the merge of this agent alone).
        stage_name (`str`):
            This stage's name (required: it names its validation task).
        tasks (`Sequence[EvalTask]`):
            Validation prompts and reward functions of every stage merged (each prior stage and this one), as
            :class:`~ram_trl.recipes.evaluate.EvalTask` (their ``split`` is ignored: all are scored as validation).
            Keyword only, like every argument after it.
        evaluation (`EvaluationSpec` or `dict`, *optional*):
            How prompts are scored (:class:`~ram_trl.recipes.schema.EvaluationSpec` or its fields; default greedy
            decoding, 32 new tokens).
        method (`str`, *optional*, defaults to `"ram_plus"`):
            The merge method (any registered name or alias; default RAM+ at the paper's settings).
        parameters (`dict[str, Any]`, *optional*):
            The method's global parameters (default: the method's defaults).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the merge's random drops (DARE, DELLA).
        preview_every (`int`, *optional*):
            Preview every this many optimizer steps; the final step is always previewed. Default
            :func:`default_preview_every` of the run's ``max_steps`` (about
            :data:`~ram_trl.defaults.PREVIEW_COUNT` previews per run).
        prompts (`int`, *optional*, defaults to `24`):
            Validation prompts scored per stage: a seeded subset (:func:`preview_prompt_indices`, recorded in the
            manifest) of each stage's validation split; ``None`` scores them all. Generation is most of a preview's
            cost.
        keep (`str`, *optional*, defaults to `"best"`):
            ``"best"``: leave the checkpoint with the highest merged validation average in the output directory
            (ties: the earliest), the last step's in ``OUTPUT/last``; ``"last"``: leave the last step's.
        **telemetry:
            The arguments of :class:`~ram_trl.callbacks.TaskVectorSparsityCallback` (``every_n_steps``, ``eps``,
            ``save_dtype``, ``domain``, ...).

    Example::

        from ram_trl.preview import MergePreviewCallback
        from ram_trl.recipes.evaluate import EvalTask

        tasks = [EvalTask("coding", coding_val_rows, ["my_rewards:coding"]),
                 EvalTask("tools", tool_val_rows, ["my_rewards:tools"])]
        callback = MergePreviewCallback(base_model=BASE, prior_stages=["runs/coding"], stage_name="tools",
                                        tasks=tasks, preview_every=20)
        trainer = GRPOTrainer(model=BASE, args=args, callbacks=[callback], ...)
        callback.bind(trainer)
        trainer.train()

    Raises:
        ConfigError: at construction, for invalid arguments, a missing base, a prior stage trained from another base,
            an unknown method or parameter, or a stage without validation prompts or rewards; at train begin, under
            FSDP, and under ZeRO-3 for a method that needs whole tensors or a PEFT policy.
    """

    def __init__(
        self,
        trainer: Any = None,
        base_model: str | os.PathLike | None = None,
        *,
        prior_stages: Sequence[str | os.PathLike] = (),
        stage_name: str | None = None,
        tasks: Sequence[Any],
        evaluation: Any = None,
        method: str = defaults.PREVIEW_METHOD,
        parameters: dict[str, Any] | None = None,
        seed: int = 0,
        preview_every: int | None = None,
        prompts: int | None = defaults.PREVIEW_PROMPTS,
        keep: Literal["best", "last"] = "best",
        **telemetry: Any,
    ) -> None:
        from ram_trl.recipes.schema import EvaluationSpec

        if base_model is None:
            raise ConfigError(
                "MergePreviewCallback needs base_model=PATH: the merge reads the base checkpoint"
            )
        if not stage_name:
            raise ConfigError(
                "MergePreviewCallback needs stage_name=...: it names this stage's validation prompts"
            )
        for name, value in (("preview_every", preview_every), ("prompts", prompts)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name}={value!r} must be a positive integer (or None for the default)")
        if keep not in ("best", "last"):
            raise ConfigError(f"keep={keep!r}: use 'best' or 'last'")
        super().__init__(trainer, base_model, prior_stages=prior_stages, stage_name=stage_name, **telemetry)
        if not self.save_agent:
            raise ConfigError(
                "MergePreviewCallback saves the agent it previews: save_agent=False is not supported"
            )
        if isinstance(evaluation, EvaluationSpec):
            self.evaluation = evaluation
        else:
            try:
                self.evaluation = EvaluationSpec.model_validate(evaluation or {})
            except Exception as exc:  # noqa: BLE001 - pydantic's message, with the argument named
                raise ConfigError(f"MergePreviewCallback evaluation={evaluation!r}: {exc}") from None
        self.priors = read_prior_stages(prior_stages)
        # transformers' DeepSpeed config, set again after the reference scores (see _without_zero3_init)
        self.hf_deepspeed_config: Any = None
        self.prior_files = [p.manifest_file for p in self.priors]
        self.method = method
        self.parameters = dict(parameters or {})
        self.seed = seed
        self.preview_every = preview_every
        # the default interval is resolved at train begin (it needs max_steps)
        self.every = preview_every or 1
        self.prompts = prompts
        self.keep = keep
        self.prompt_indices: dict[str, list[int]] = {}
        self.validation_sizes: dict[str, int] = {}
        self.tasks = self._validation_tasks(tasks)
        # the whole config is validated now (method, parameters, each prior's base), with the base as a stand-in
        # for the agent: the errors come before any training
        from ram_trl.config import load_config, resolve_config

        self._resolved_method = resolve_config(load_config(self.merge_config(self.base_model))[0]).method
        self.history: list[dict[str, Any]] = []
        self.base_scores: dict[str, float] = {}
        self.specialist_scores: dict[str, float] = {}
        self.reference_seconds: float | None = None
        self.resumed_from: int | None = None
        self.kept_step: int | None = None
        self._best: Path | None = None
        self._best_average = -math.inf
        self._last: Path | None = None
        self._last_step: int | None = None
        self.partitioned = False

    def _validation_tasks(self, tasks: Sequence[Any]) -> dict[str, Any]:
        from ram_trl.recipes.evaluate import EvalTask

        by_stage: dict[str, Any] = {}
        for task in tasks:
            if not isinstance(task, EvalTask):
                raise ConfigError(
                    f"tasks: expected ram_trl.recipes.evaluate.EvalTask, got {type(task).__name__}"
                )
            if task.stage in by_stage:
                raise ConfigError(f"tasks: stage {task.stage!r} appears more than once")
            by_stage[task.stage] = EvalTask(task.stage, list(task.rows), list(task.paths), split="val")
        for name in [p.name for p in self.priors] + [self.stage_name]:
            task = by_stage.get(name)
            if task is None or not task.rows:
                raise ConfigError(
                    f"merge preview: stage {name!r} has no validation prompts; give every merged stage's validation "
                    "split in tasks=[EvalTask(stage, rows, reward_paths), ...] (a recipe stage needs prompts.val_size)"
                )
            if not task.paths:
                raise ConfigError(
                    f"merge preview: stage {name!r} has no reward functions to score its prompts"
                )
            task.functions()  # import errors now, not at the first preview
            indices = preview_prompt_indices(len(task.rows), self.prompts, self.seed)
            self.prompt_indices[name] = indices
            self.validation_sizes[name] = len(task.rows)
            by_stage[name] = EvalTask(name, [task.rows[i] for i in indices], task.paths, split="val")
        return by_stage

    # -- events --------------------------------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        super().on_train_begin(args, state, control, **kwargs)
        check_last_dir(args.output_dir)
        accelerator = self.trainer.accelerator
        plugin = getattr(accelerator.state, "deepspeed_plugin", None)
        self.partitioned = plugin is not None and getattr(plugin, "zero_stage", 0) == 3
        if self.partitioned:
            self._check_partitioned(plugin.deepspeed_config)
        if (
            getattr(accelerator, "is_fsdp2", False)
            or getattr(accelerator.state, "fsdp_plugin", None) is not None
        ):
            raise ConfigError(
                "the merge preview does not support FSDP yet; use DDP or train without the preview"
            )
        self.every = self.preview_every or default_preview_every(state.max_steps)
        self.work_dir = Path(args.output_dir) / WORK_DIR
        saved = self._saved_state(args, state) if state.global_step > 0 else None
        if accelerator.is_main_process:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.work_dir.mkdir(parents=True)
            if saved is not None:
                self._restore_checkpoints(saved)
        accelerator.wait_for_everyone()
        if saved is not None:
            self._restore(saved)
            return
        if accelerator.is_main_process:
            start = time.perf_counter()
            with _training_rng_kept(), _without_zero3_init(self):
                references = self._reference_scores()
            references = (*references, round(time.perf_counter() - start, 4))
        else:
            references = None
        self.base_scores, self.specialist_scores, self.reference_seconds = self._share(references)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        step = state.global_step
        final = step >= state.max_steps or control.should_training_stop
        metrics: dict[str, float] = {}
        if step % self.interval(args, state) == 0 or final:
            model = policy_of(kwargs.get("model") or self.trainer.model)
            metrics.update(self.tracker.measure(model, step))
        if step % self.every == 0 or final:
            metrics.update(self.preview(state))
        if metrics:
            self.emit(metrics)
        return control

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self.tracker.ready:
            return
        if self._last_step != state.global_step:  # training stopped between previews
            self.emit(self.preview(state))
        if self.trainer.accelerator.is_main_process:
            self._commit(args, state)
        self.trainer.accelerator.wait_for_everyone()

    def _commit(self, args: TrainingArguments, state: TrainerState) -> None:
        """Leave the kept checkpoint (and the last step's in ``OUTPUT/last``) and the manifest in the output
        directory with the agent directory's commit protocol (:func:`~ram_trl.callbacks.agent_output`: all or
        nothing, the manifest last), then remove the scratch directory."""
        from ram_trl.manifest import (
            MANIFEST_NAME,
            check_save_target,
            describe_files,
            weight_files,
            write_manifest,
        )

        assert self._last is not None and self._best is not None
        out_dir = Path(args.output_dir)
        kept = self._best if self.keep == "best" else self._last
        output = agent_output(out_dir)
        tmp = output.begin()
        try:
            for file in kept.iterdir():
                os.replace(file, tmp / file.name)
            if kept != self._last:
                os.replace(self._last, tmp / LAST_DIR)
            if self.write_stage and state.is_world_process_zero:
                manifest = self.manifest(args, state)
                manifest.files = describe_files(tmp)
                write_manifest(manifest, tmp)
                self.manifest_file = out_dir / MANIFEST_NAME
            remove = check_save_target(out_dir, weight_files(tmp))
            if not (tmp / LAST_DIR).exists() and check_last_dir(out_dir):
                remove.append(LAST_DIR)  # an earlier preview's last step, not this run's
            output.commit(remove=remove)
        except BaseException:
            output.abort()
            raise
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Keep the preview's state in the trainer checkpoint just saved (``checkpoint-N/ram_preview``): the history
        and hard links to the best and last previewed checkpoints, for :meth:`on_train_begin` of a resumed run."""
        if not self.trainer.accelerator.is_main_process or not self.history:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not checkpoint.is_dir():
            return
        target = checkpoint / CHECKPOINT_DIR
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        for directory in {self._best, self._last} - {None}:
            _link_tree(directory, target / directory.name)
        saved = {
            "settings": self._settings(),
            "history": self.history,
            "best": self._best.name if self._best else None,
            "last": self._last.name if self._last else None,
            "base_scores": self.base_scores,
            "specialist_scores": self.specialist_scores,
            "reference_seconds": self.reference_seconds,
        }
        (target / STATE_FILE).write_text(json.dumps(saved, indent=1) + "\n")

    def _settings(self) -> dict[str, Any]:
        """What makes two runs' previews comparable (a resumed run must preview as the interrupted one did)."""
        return {
            "method": self.method,
            "parameters": self.parameters,
            "seed": self.seed,
            "stages": self.merged_stages,
            "prior_stages": [str(f) for f in self.prior_files],
            "prompt_indices": self.prompt_indices,
            "evaluation": self.evaluation.model_dump(mode="json"),
        }

    def _saved_state(self, args: TrainingArguments, state: TrainerState) -> dict[str, Any] | None:
        """The preview state of the checkpoint a run resumes from (``None``, with a warning, when it has none)."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}" / CHECKPOINT_DIR
        file = folder / STATE_FILE
        if not file.is_file():
            logger.warning(
                "merge preview: the run resumes at step %d without a preview state in %s; the previews before it are "
                "unknown, and the step kept is chosen among the previews from now on",
                state.global_step,
                folder,
            )
            return None
        saved = json.loads(file.read_text())
        if saved["settings"] != json.loads(json.dumps(self._settings())):
            raise ConfigError(
                f"merge preview: the checkpoint {folder.parent} was previewed with other settings "
                f"({saved['settings']}) than this run's ({self._settings()}); resume with the same method, "
                "parameters, seed, prior stages, prompts and evaluation"
            )
        saved["folder"] = str(folder)
        return saved

    def _restore_checkpoints(self, saved: dict[str, Any]) -> None:
        """Link the saved best and last previewed checkpoints back into the scratch directory (main process)."""
        folder = Path(saved["folder"])
        for name in {saved["best"], saved["last"]} - {None}:
            _link_tree(folder / name, self.work_dir / name)

    def _restore(self, saved: dict[str, Any]) -> None:
        self.history = list(saved["history"])
        self.base_scores = saved["base_scores"]
        self.specialist_scores = saved["specialist_scores"]
        self.reference_seconds = saved["reference_seconds"]
        self.resumed_from = int(Path(saved["folder"]).parent.name.rsplit("-", 1)[1])
        if saved["best"] is not None:
            self._best = self.work_dir / saved["best"]
            self._best_average = max(r["average"] for r in self.history)
        if saved["last"] is not None:
            self._last = self.work_dir / saved["last"]
            self._last_step = self.history[-1]["step"]
        best = max(self.history, key=lambda r: r["average"])
        self.kept_step = best["step"] if self.keep == "best" else self._last_step

    # -- the preview ---------------------------------------------------------------------------------------------

    def preview(self, state: TrainerState) -> dict[str, float]:
        """Preview the merge at the current step (every rank calls this): save the agent, merge it with the prior
        stages, score the merge on every stage's validation prompts, and keep the step if it merges best.

        Args:
            state (`TrainerState`): The trainer's state (its ``global_step`` names the preview).

        Returns:
            `dict[str, float]`: The metrics logged (under ``merge_preview/``).
        """
        step = state.global_step
        start = time.perf_counter()
        accelerator = self.trainer.accelerator
        checkpoint = self.work_dir / f"step-{step}"
        save_agent(self.trainer, checkpoint, self.save_dtype)  # every rank: a sharded model is gathered
        accelerator.wait_for_everyone()
        if self.partitioned:
            record = self._preview_partitions(checkpoint, step)  # every rank: its own partitions
        else:
            merged, merge_seconds, processes = self._merge(checkpoint)  # every rank: a share each under DDP
            if accelerator.is_main_process:
                with _training_rng_kept():
                    record = self._score(merged, checkpoint, step)
                record["merge_seconds"] = round(merge_seconds, 4)
                record["merge_processes"] = processes
            else:
                record = None
            record = self._share(record)
        record["reward"] = self._share(
            last_reward_metrics(state.log_history).get("reward") if accelerator.is_main_process else None
        )
        from ram_trl.recipes.stats import mean_retention

        record["retention"] = self.retention(record)
        record["retention_mean"] = mean_retention(record["retention"])
        record["seconds"] = round(time.perf_counter() - start, 4)
        self.history.append(record)
        if accelerator.is_main_process:
            self._keep(checkpoint, record)
        best = max(self.history, key=lambda r: r["average"])  # max keeps the earliest of equal averages
        self.kept_step = best["step"] if self.keep == "best" else step
        self._last_step = step
        return self._metrics(record)

    def merge_config(self, agent: str | os.PathLike) -> dict[str, Any]:
        """The preview's merge config (:func:`preview_merge_config`) with ``agent`` as this stage's checkpoint.

        Args:
            agent (`str` or `os.PathLike`): The current policy's checkpoint directory.

        Returns:
            `dict[str, Any]`: The config for :func:`ram_trl.engine.merge`.
        """
        return preview_merge_config(
            self.base_model, self.prior_files, agent, self.stage_name, self.method, self.parameters, self.seed
        )

    def _merge(self, checkpoint: Path) -> tuple[Path, float, int]:
        """``ram-trl merge`` of the prior stages and ``checkpoint`` into the scratch directory; returns the merged
        model's directory, the seconds taken and the processes that merged. Every rank calls it: in a multi-process run (``WORLD_SIZE`` > 1) it
        is the engine's distributed merge, each rank merging its share of the tensors with the global statistics."""
        from ram_trl.engine import merge

        merged = self.work_dir / "merged"
        config = self.merge_config(checkpoint)
        start = time.perf_counter()
        report = merge(
            config, merged, overwrite=True, progress=False
        )  # prints nothing: the record says it all
        return merged, time.perf_counter() - start, int(report.get("processes", 1))

    def _check_partitioned(self, deepspeed_config: dict[str, Any]) -> None:
        """Refuse, at train begin, what a partition-local preview cannot do (before any training step)."""
        from ram_trl.range_merge import check_range_method

        check_range_method(self._resolved_method)
        zero = deepspeed_config.get("zero_optimization") or {}
        if zero.get("stage3_gather_16bit_weights_on_model_save") in (None, False, "false", "False"):
            raise ConfigError(
                "the merge preview saves the policy at every preview, which under DeepSpeed ZeRO-3 needs "
                "stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed config's zero_optimization "
                "(zero3_save_16bit_model: true in an accelerate config)"
            )
        if hasattr(policy_of(self.trainer.model), "peft_config"):
            raise ConfigError(
                "the merge preview under DeepSpeed ZeRO-3 merges the policy's full weights; a PEFT (LoRA) policy is "
                "not supported there (use DDP or ZeRO-1/2, or train without the preview)"
            )
        dtypes = {p.dtype for p in policy_of(self.trainer.model).parameters()}
        wanted = getattr(torch, self.evaluation.dtype)
        if dtypes != {wanted}:
            logger.warning(
                "merge preview under ZeRO-3: the model is scored in its training dtype (%s), not the evaluation dtype "
                "(%s); the merged weights are those of `ram-trl merge`, the scores may differ from `ram-trl eval` in "
                "the last digits (set evaluation.dtype to the training dtype to make them equal)",
                ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)),
                self.evaluation.dtype,
            )

    def _preview_partitions(self, checkpoint: Path, step: int) -> dict[str, Any]:
        """The preview under DeepSpeed ZeRO-3 (every rank calls it): each rank merges its own partition of every
        parameter with the global statistics (:func:`ram_trl.range_merge.merge_ranges`, one all-reduce of integer
        counts, no parameter gathered); the merged values then replace the partitions while the model is scored
        through ZeRO-3's own gathering for generation (as TRL gathers for training generation), and the policy's
        partitions are restored afterwards."""
        from ram_trl.config import load_config, resolve_config
        from ram_trl.range_merge import FlatRange, merge_ranges
        from ram_trl.telemetry.base_weights import base_name
        from ram_trl.telemetry.shards import iter_local_shards, training_context

        ctx = training_context()
        policy = policy_of(self.trainer.model)
        shards = list(iter_local_shards(policy))
        saved = [
            FlatRange(
                base_name(s.name),
                s.offset,
                s.values.to(device="cpu", dtype=self.save_dtype),  # on the host: no copy on the accelerator
                counted=s.partitioned or ctx.is_main,
            )
            for s in shards
        ]
        start = time.perf_counter()
        # the config names the saved policy (the last agent); merge_ranges takes its values from `saved` instead
        resolved = resolve_config(load_config(self.merge_config(checkpoint))[0])
        result = ctx.guarded(lambda: merge_ranges(resolved, len(resolved.agents) - 1, saved, ctx))
        merge_seconds = time.perf_counter() - start
        agent_digest = self._share(weights_digest(checkpoint) if ctx.is_main else None)
        merged_scores = {r["merged_sha256"]: r["scores"] for r in self.history}.get(result.digest)
        agent_score = {r.get("agent_sha256"): r["agent_score"] for r in self.history}.get(agent_digest)
        with _swapped_partitions(self.trainer.model_wrapped, shards) as swap:
            if agent_score is None:
                swap([r.values for r in saved])
                agent_score = self._score_gathered([self.tasks[self.stage_name]])[self.stage_name]
            if merged_scores is None:
                swap(result.values)
                merged_scores = self._score_gathered([self.tasks[name] for name in self.merged_stages])
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
        return self._share(record if ctx.is_main else None)  # the main rank's timings

    def _score_gathered(self, tasks: list[Any]) -> dict[str, float]:
        """Scores of the model as its partitions now hold it (every rank calls it): the parameters are gathered the
        way TRL gathers them for its training generation, and every rank generates the same completions in step with
        the others (ZeRO-3's forward hooks and ``generate``'s ``synced_gpus`` are collectives); the main rank's scores
        are shared."""
        from trl.models.utils import unwrap_model_for_generation

        from ram_trl.recipes.evaluate import evaluate_loaded

        accelerator = self.trainer.accelerator
        with unwrap_model_for_generation(self.trainer.model_wrapped, accelerator) as unwrapped:
            model = policy_of(unwrapped)
            training = model.training
            model.eval()
            try:
                with _training_rng_kept():
                    scored = evaluate_loaded(model, self._tokenizer(), tasks, self.evaluation, progress=False)
            finally:
                model.train(training)
        scores = dict(scored["splits"]["val"]["scores"])
        return self._share(scores if accelerator.is_main_process else None)

    def _tokenizer(self) -> Any:
        """The base's tokenizer set up for generation (what ``ram-trl eval`` of the merge uses: the merge copies
        the base's tokenizer)."""
        if getattr(self, "_generation_tokenizer", None) is None:
            from transformers import AutoTokenizer

            from ram_trl.recipes.evaluate import generation_tokenizer

            self._generation_tokenizer = generation_tokenizer(AutoTokenizer.from_pretrained(self.base_model))
        return self._generation_tokenizer

    def _score(self, merged: Path, checkpoint: Path, step: int) -> dict[str, Any]:
        """The merged model's validation scores on every merged stage and the policy's on its own stage. Weights
        scored at an earlier preview (equal digests: bit-for-bit the same model) are not generated again: the
        evaluation is seeded, so their scores are the earlier ones."""
        from ram_trl.recipes.evaluate import evaluate_model

        merged_digest, agent_digest = weights_digest(merged), weights_digest(checkpoint)
        earlier = {r["merged_sha256"]: r for r in self.history}
        if merged_digest in earlier:
            scores = dict(earlier[merged_digest]["scores"])
        else:
            tasks = [self.tasks[name] for name in self.merged_stages]
            scored = evaluate_model(merged, tasks, self.evaluation, base=self.base_model, progress=False)
            scores = dict(scored["splits"]["val"]["scores"])
        earlier = {r.get("agent_sha256"): r for r in self.history}
        if agent_digest in earlier:
            agent_score = earlier[agent_digest]["agent_score"]
        else:
            own = evaluate_model(
                checkpoint,
                [self.tasks[self.stage_name]],
                self.evaluation,
                base=self.base_model,
                progress=False,
            )
            agent_score = own["splits"]["val"]["scores"][self.stage_name]
        return {
            "step": step,
            "scores": scores,
            "average": math.fsum(scores.values()) / len(scores),
            "agent_score": agent_score,
            "merged_sha256": merged_digest,
            "agent_sha256": agent_digest,
        }

    def _reference_scores(self) -> tuple[dict[str, float], dict[str, float]]:
        """The base's validation score on every merged stage and each prior agent's on its own stage (retention's
        reference points; this stage's specialist is the current policy)."""
        from ram_trl.recipes.evaluate import evaluate_model

        tasks = [self.tasks[name] for name in self.merged_stages]
        base = evaluate_model(self.base_model, tasks, self.evaluation, progress=False)["splits"]["val"][
            "scores"
        ]
        specialists = {}
        for prior in self.priors:
            scored = evaluate_model(
                prior.checkpoint,
                [self.tasks[prior.name]],
                self.evaluation,
                base=self.base_model,
                progress=False,
            )
            specialists[prior.name] = scored["splits"]["val"]["scores"][prior.name]
        return dict(base), specialists

    @property
    def merged_stages(self) -> list[str]:
        """The stages in the merge, in merge order (the priors, then this one)."""
        return [p.name for p in self.priors] + [self.stage_name]

    def retention(self, record: dict[str, Any]) -> dict[str, float | None]:
        """Per merged stage, the retention of a preview (:func:`ram_trl.recipes.stats.retention`).

        Args:
            record (`dict[str, Any]`): One preview's record (its ``scores`` per stage and ``agent_score``).

        Returns:
            `dict[str, float | None]`: Stage name to retention, ``None`` where the specialist did not gain enough
            over the base.
        """
        from ram_trl.recipes.stats import retention

        specialists = {**self.specialist_scores, self.stage_name: record["agent_score"]}
        return {
            name: retention(
                record["scores"][name],
                self.base_scores[name],
                specialists[name],
                self.evaluation.retention_min_gain,
            )
            for name in self.merged_stages
        }

    def _metrics(self, record: dict[str, Any]) -> dict[str, float]:
        p = PREVIEW_PREFIX
        metrics = {f"{p}score/{name}": float(value) for name, value in record["scores"].items()}
        metrics[f"{p}average"] = float(record["average"])
        metrics[f"{p}agent_score"] = float(record["agent_score"])
        metrics.update(
            {f"{p}retention/{n}": float(v) for n, v in record["retention"].items() if v is not None}
        )
        if record["retention_mean"] is not None:
            metrics[f"{p}retention_mean"] = float(record["retention_mean"])
        metrics[f"{p}kept_step"] = float(self.kept_step)
        metrics[f"{p}seconds"] = float(record["seconds"])
        return metrics

    def _keep(self, checkpoint: Path, record: dict[str, Any]) -> None:
        """Keep the preview's checkpoint while it is the best or the last; delete the ones neither."""
        previous_best, previous_last = self._best, self._last
        if previous_best is None or record["average"] > self._best_average:
            self._best, self._best_average = checkpoint, record["average"]
        self._last = checkpoint
        for old in {previous_best, previous_last} - {self._best, self._last, None}:
            shutil.rmtree(old, ignore_errors=True)

    def _share(self, value: Any) -> Any:
        """The main process's ``value`` on every rank (a no-op in one process)."""
        return training_context().broadcast_object(value)

    # -- the stage -----------------------------------------------------------------------------------------------

    def manifest(self, args: TrainingArguments, state: TrainerState) -> StageManifest:
        """The stage manifest, with the preview's record in ``extra["preview"]``: the step kept and why, the method
        and every preview's scores.

        Args:
            args (`TrainingArguments`): The trainer's arguments.
            state (`TrainerState`): The trainer's state.

        Returns:
            `StageManifest`: The manifest.
        """
        manifest = super().manifest(args, state)
        kept_last = self.kept_step == self._last_step
        best = max(self.history, key=lambda r: r["average"])
        manifest.extra["preview"] = {
            "kept_step": self.kept_step,
            "keep": self.keep,
            "reason": (
                f"highest merged validation average ({best['average']:.6g}) over {len(self.history)} previews"
                if self.keep == "best"
                else "the last step (keep='last')"
            ),
            "checkpoint": ".",
            "last_checkpoint": "." if kept_last else LAST_DIR,
            "last_step": self._last_step,
            "method": self.method,
            "parameters": self.parameters,
            "seed": self.seed,
            "prior_stages": [str(f) for f in self.prior_files],
            "stages": self.merged_stages,
            "preview_every": self.every,
            "prompts": {
                name: {"scored": len(indices), "of": self.validation_sizes[name], "indices": indices}
                for name, indices in self.prompt_indices.items()
            },
            "evaluation": self.evaluation.model_dump(mode="json"),
            "reference_seconds": self.reference_seconds,
            "resumed_from_step": self.resumed_from,
            "base_scores": self.base_scores,
            "specialist_scores": self.specialist_scores,
            "history": self.history,
        }
        if not kept_last:
            manifest.extra["preview"]["note"] = (
                "the telemetry and rewards of this manifest are those of the last step; the kept checkpoint is "
                f"step {self.kept_step}'s"
            )
        return manifest


def check_last_dir(output_dir: str | os.PathLike) -> bool:
    """Whether ``OUTPUT/last`` exists as an earlier preview's (its ``ram_stage.json`` says so); refuse one that
    does not, before training: the preview would replace it.

    Args:
        output_dir (`str` or `os.PathLike`): The trainer's output directory.

    Returns:
        `bool`: ``True`` when ``OUTPUT/last`` is an earlier preview's, ``False`` when there is none.

    Raises:
        ConfigError: naming ``OUTPUT/last`` when it exists and no preview manifest there claims it.
    """
    from ram_trl.manifest import MANIFEST_NAME, read_manifest

    last = Path(output_dir) / LAST_DIR
    if not (last.exists() or last.is_symlink()):
        return False
    try:
        record = read_manifest(Path(output_dir) / MANIFEST_NAME).extra.get("preview") or {}
    except ConfigError:
        record = {}
    if isinstance(record, dict) and record.get("last_checkpoint") == LAST_DIR and last.is_dir():
        return True
    raise ConfigError(
        f"{last} exists and is not an earlier merge preview's last step; MergePreviewCallback writes the last step's "
        "agent there. Move it away or choose another output_dir"
    )


def weights_digest(model_dir: str | os.PathLike) -> str:
    """SHA-256 of a model directory's weights: every tensor of its safetensors files, in name order, as its name,
    dtype, shape and raw bytes. Equal digests mean bit-for-bit equal weights, whatever the sharding.

    Args:
        model_dir: A directory of ``*.safetensors`` files.

    Returns:
        The hex digest.
    """
    import hashlib

    from safetensors import safe_open

    handles = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        handle = safe_open(str(file), framework="pt")
        handles.update({name: handle for name in handle.keys()})  # noqa: SIM118 - safe_open has no __iter__
    digest = hashlib.sha256()
    for name in sorted(handles):
        tensor = handles[name].get_tensor(name)
        digest.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _training_rng_kept() -> contextlib.AbstractContextManager:
    """Save torch's CPU and CUDA random states and restore them on exit (the evaluation seeds torch)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    return torch.random.fork_rng(devices=devices)


def _link_tree(source: Path, target: Path) -> None:
    """Hard-link the files of the flat directory ``source`` into ``target`` (created); copies where the file system
    cannot link."""
    target.mkdir(parents=True)
    for file in source.iterdir():
        try:
            os.link(file, target / file.name)
        except OSError:
            shutil.copy2(file, target / file.name)


@contextlib.contextmanager
def _swapped_partitions(engine: Any, shards: list[Any]):
    """Let values replace a DeepSpeed ZeRO-3 model's local partitions, and restore the partitions on exit.

    Yields a function ``swap(values)`` writing one flat tensor per shard (of
    :func:`~ram_trl.telemetry.shards.iter_local_shards`) into the partitions. Before each write every gathered
    parameter is released (ZeRO-3 re-gathers from the partitions at the next use); on exit the saved partitions are
    written back and the persistent parameters re-gathered, as DeepSpeed does after an optimizer step. The saved
    copy is one partition per parameter, on the CPU.
    """
    optimizer = engine.optimizer
    # DeepSpeed's ZeRO-3 optimizer releases every gathered parameter through its offload manager's public method
    release = getattr(getattr(optimizer, "parameter_offload", None), "partition_all_parameters", None)
    if release is None:
        raise ConfigError(
            f"the merge preview under DeepSpeed ZeRO-3 needs the ZeRO-3 optimizer's "
            f"parameter_offload.partition_all_parameters() (DeepSpeed >= 0.10); {type(optimizer).__name__} of "
            f"DeepSpeed {library_versions().get('deepspeed', '(not installed)')} has none"
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
        persistent = getattr(optimizer, "persistent_parameters", [])
        if persistent:
            persistent[0].all_gather(persistent)


@contextlib.contextmanager
def _without_zero3_init(owner: Any):
    """Let one process of a DeepSpeed ZeRO-3 run load and generate on its own: without it transformers'
    ``from_pretrained`` partitions the model with ``deepspeed.zero.Init`` and ``generate`` syncs every step with the
    other processes (``synced_gpus``), collectives the other processes never join.

    Only transformers' public functions: the run's DeepSpeed config (``deepspeed_config()``) is unset, and set again
    on exit as a new ``HfDeepSpeedConfig`` of the same config, which ``owner`` keeps alive (transformers holds it by a
    weak reference).
    """
    try:
        from transformers.integrations.deepspeed import (
            HfDeepSpeedConfig,
            deepspeed_config,
            unset_hf_deepspeed_config,
        )
    except ImportError:  # pragma: no cover - transformers without the DeepSpeed integration
        yield
        return
    config = deepspeed_config()
    if config is None:  # not a DeepSpeed run
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        owner.hf_deepspeed_config = HfDeepSpeedConfig(config)
