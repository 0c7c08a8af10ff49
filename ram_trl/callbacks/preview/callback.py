"""The merge-preview callback (:class:`MergePreviewCallback`): the training events, the preview of one step (save,
merge, score, keep) and the stage it leaves (the kept checkpoint and its manifest). Details: docs/merge-preview.md."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from transformers import TrainerControl, TrainerState, TrainingArguments

from ram_trl import defaults
from ram_trl.callbacks.deepspeed_adapter import zero3_loading_off
from ram_trl.callbacks.preview.config import default_preview_every, preview_merge_config, preview_metrics
from ram_trl.callbacks.preview.partitions import PartitionPreview, check_partitioned, preview_partitions
from ram_trl.callbacks.preview.scores import (
    record_retention,
    reference_scores,
    score_preview,
    training_rng_kept,
    validation_tasks,
)
from ram_trl.callbacks.preview.state import (
    LAST_DIR,
    WORK_DIR,
    KeptCheckpoints,
    check_last_dir,
    check_work_dir,
    kept_step,
    open_work_dir,
    read_state,
    remove_work_dir,
    restore_state,
    save_state,
)
from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback, last_reward_metrics
from ram_trl.callbacks.telemetry.priors import read_prior_stages
from ram_trl.callbacks.telemetry.shards import training_context
from ram_trl.errors import ConfigError
from ram_trl.stage.manifest import StageManifest
from ram_trl.stage.save import agent_output, policy_of, save_agent

#: Prefix of the preview's metric names.

__all__ = ["MergePreviewCallback"]


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
            :class:`~ram_trl.evaluation.scoring.EvalTask` (their ``split`` is ignored: all are scored as validation).
            Keyword only, like every argument after it.
        evaluation (`EvaluationSpec` or `dict`, *optional*):
            How prompts are scored (:class:`~ram_trl.evaluation.spec.EvaluationSpec` or its fields; default greedy
            decoding, 32 new tokens).
        method (`str`, *optional*, defaults to `"ram_plus"`):
            The merge method (any registered name or alias; default RAM+ at the paper's settings).
        parameters (`dict[str, Any]`, *optional*):
            The method's global parameters (default: the method's defaults).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the merge's random drops (DARE, DELLA).
        merge_dtype (`str`, *optional*, defaults to `"float32"`):
            The dtype each preview's merge is written and scored in (the record keeps its report's ``effect``).
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

        from ram_trl.evaluation import EvalTask
        from ram_trl.callbacks.preview import MergePreviewCallback

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
        merge_dtype: str = "float32",
        preview_every: int | None = None,
        prompts: int | None = defaults.PREVIEW_PROMPTS,
        keep: Literal["best", "last"] = "best",
        **telemetry: Any,
    ) -> None:
        from ram_trl.evaluation.spec import EvaluationSpec

        if base_model is None:
            raise ConfigError("MergePreviewCallback needs base_model=PATH: the merge reads the base checkpoint")
        if not stage_name:
            raise ConfigError("MergePreviewCallback needs stage_name=...: it names this stage's validation prompts")
        for name, value in (("preview_every", preview_every), ("prompts", prompts)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name}={value!r} must be a positive integer (or None for the default)")
        if keep not in ("best", "last"):
            raise ConfigError(f"keep={keep!r}: use 'best' or 'last'")
        super().__init__(trainer, base_model, prior_stages=prior_stages, stage_name=stage_name, **telemetry)
        if not self.save_agent:
            raise ConfigError("MergePreviewCallback saves the agent it previews: save_agent=False is not supported")
        if isinstance(evaluation, EvaluationSpec):
            self.evaluation = evaluation
        else:
            try:
                self.evaluation = EvaluationSpec.model_validate(evaluation or {})
            except Exception as exc:  # noqa: BLE001 - pydantic's message, with the argument named
                raise ConfigError(f"MergePreviewCallback evaluation={evaluation!r}: {exc}") from None
        self.priors = read_prior_stages(prior_stages)
        self.prior_files = [p.manifest_file for p in self.priors]
        self.method = method
        self.parameters = dict(parameters or {})
        self.seed = seed
        self.merge_dtype = merge_dtype
        self.preview_every = preview_every
        # the default interval is resolved at train begin (it needs max_steps)
        self.every = preview_every or 1
        self.prompts = prompts
        self.keep = keep
        self.tasks, self.prompt_indices, self.validation_sizes = validation_tasks(
            tasks, self.merged_stages, prompts, seed
        )
        # the whole config is validated now (method, parameters, each prior's base), with the base as a stand-in
        # for the agent: the errors come before any training
        from ram_trl.merging.config.resolve import resolve_config
        from ram_trl.merging.config.schema import load_config

        self._resolved_method = resolve_config(load_config(self.merge_config(self.base_model))[0]).method
        self.history: list[dict[str, Any]] = []
        self.base_scores: dict[str, float] = {}
        self.specialist_scores: dict[str, float] = {}
        self.reference_seconds: float | None = None
        self.resumed_from: int | None = None
        self.kept_step: int | None = None
        self.kept = KeptCheckpoints()
        self._last_step: int | None = None
        self.partitioned = False

    # -- events --------------------------------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        super().on_train_begin(args, state, control, **kwargs)
        check_last_dir(args.output_dir)
        self.work_dir = Path(args.output_dir) / WORK_DIR
        check_work_dir(self.work_dir)  # every rank, before the main one writes there
        accelerator = self.trainer.accelerator
        plugin = getattr(accelerator.state, "deepspeed_plugin", None)
        self.partitioned = plugin is not None and getattr(plugin, "zero_stage", 0) == 3
        if self.partitioned:
            check_partitioned(
                self._resolved_method, plugin.deepspeed_config, policy_of(self.trainer.model), self.evaluation.dtype
            )
        if getattr(accelerator, "is_fsdp2", False) or getattr(accelerator.state, "fsdp_plugin", None) is not None:
            raise ConfigError("the merge preview does not support FSDP yet; use DDP or train without the preview")
        self.every = self.preview_every or default_preview_every(state.max_steps)
        saved = self._saved_state(args, state) if state.global_step > 0 else None
        accelerator.wait_for_everyone()  # every rank checked the scratch directory
        if accelerator.is_main_process:
            open_work_dir(self.work_dir)
        if saved is not None:
            self.kept = restore_state(saved, self.work_dir, link=accelerator.is_main_process)
        accelerator.wait_for_everyone()
        if saved is not None:
            self._restore(saved)
            return
        if accelerator.is_main_process:
            start = time.perf_counter()
            plugins = (getattr(args, "deepspeed_plugin", None), getattr(accelerator.state, "deepspeed_plugin", None))
            owners = (args, *plugins)
            with training_rng_kept(), zero3_loading_off(owners):
                references = reference_scores(
                    self.base_model, self.tasks, self.merged_stages, self.priors, self.evaluation
                )
            references = (*references, round(time.perf_counter() - start, 4))
        else:
            references = None
        self.base_scores, self.specialist_scores, self.reference_seconds = self.share(references)

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
        from ram_trl.stage.manifest import (
            MANIFEST_NAME,
            check_save_target,
            describe_files,
            weight_files,
            write_manifest,
        )

        assert self.kept.last is not None and self.kept.best is not None
        out_dir = Path(args.output_dir)
        kept = self.kept.best if self.keep == "best" else self.kept.last
        output = agent_output(out_dir)
        tmp = output.begin()
        try:
            for file in kept.iterdir():
                os.replace(file, tmp / file.name)
            if kept != self.kept.last:
                os.replace(self.kept.last, tmp / LAST_DIR)
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
        remove_work_dir(self.work_dir)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Keep the preview's state in the trainer checkpoint just saved (``checkpoint-N/ram_preview``): the history
        and hard links to the best and last previewed checkpoints, for :meth:`on_train_begin` of a resumed run."""
        if not self.trainer.accelerator.is_main_process or not self.history:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not checkpoint.is_dir():
            return
        saved = {
            "settings": self._settings(),
            "history": self.history,
            "base_scores": self.base_scores,
            "specialist_scores": self.specialist_scores,
            "reference_seconds": self.reference_seconds,
        }
        save_state(checkpoint, self.kept, saved)

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

        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        return read_state(checkpoint, state.global_step, self._settings())

    def _restore(self, saved: dict[str, Any]) -> None:
        self.history = list(saved["history"])
        self.base_scores = saved["base_scores"]
        self.specialist_scores = saved["specialist_scores"]
        self.reference_seconds = saved["reference_seconds"]
        self.resumed_from = int(Path(saved["folder"]).parent.name.rsplit("-", 1)[1])
        if saved["last"] is not None:
            self._last_step = self.history[-1]["step"]
        self.kept_step = kept_step(self.history, self.keep) if self.keep == "best" else self._last_step

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
            preview = PartitionPreview(
                self.trainer,
                self.save_dtype,
                self.merge_config(checkpoint),
                self.history,
                self.tasks,
                self.stage_name,
                self.merged_stages,
                self.generation_tokenizer,
                self.evaluation,
                self.share,
            )
            record = preview_partitions(preview, checkpoint, step)  # every rank: its own partitions
        else:
            merged, merge_seconds, report = self._merge(checkpoint)  # every rank: a share each under DDP
            if accelerator.is_main_process:
                with training_rng_kept():
                    record = score_preview(
                        merged,
                        checkpoint,
                        step,
                        self.tasks,
                        self.merged_stages,
                        self.evaluation,
                        self.base_model,
                        self.history,
                    )
                record["merge_seconds"] = round(merge_seconds, 4)
                record["merge_processes"] = int(report.get("processes", 1))
                record["merge_effect"] = report.get("effect")
            else:
                record = None
            record = self.share(record)
        record["reward"] = self.share(
            last_reward_metrics(state.log_history).get("reward") if accelerator.is_main_process else None
        )
        from ram_trl.evaluation.retention import mean_retention

        record["retention"] = self.retention(record)
        record["retention_mean"] = mean_retention(record["retention"])
        record["seconds"] = round(time.perf_counter() - start, 4)
        self.history.append(record)
        if accelerator.is_main_process:
            self.kept.add(checkpoint, record["average"])
        self.kept_step = kept_step(self.history, self.keep)
        self._last_step = step
        return preview_metrics(record, self.kept_step)

    def merge_config(self, agent: str | os.PathLike) -> dict[str, Any]:
        """The preview's merge config (:func:`preview_merge_config`) with ``agent`` as this stage's checkpoint.

        Args:
            agent (`str` or `os.PathLike`): The current policy's checkpoint directory.

        Returns:
            `dict[str, Any]`: The config for :func:`ram_trl.merging.engine.merge`.
        """
        config = preview_merge_config(
            self.base_model, self.prior_files, agent, self.stage_name, self.method, self.parameters, self.seed
        )
        return config | {"out_dtype": self.merge_dtype}

    def _merge(self, checkpoint: Path) -> tuple[Path, float, dict[str, Any]]:
        """``ram-trl merge`` of the prior stages and ``checkpoint`` into the scratch directory; returns the merged
        model's directory, the seconds taken and the merge report. Every rank calls it: in a multi-process run (``WORLD_SIZE`` > 1) it
        is the engine's distributed merge, each rank merging its share of the tensors with the global statistics."""
        from ram_trl.merging.engine import merge

        merged = self.work_dir / "merged"
        config = self.merge_config(checkpoint)
        start = time.perf_counter()
        # prints nothing: the record says it all
        report = merge(config, merged, overwrite=True, progress=False)
        return merged, time.perf_counter() - start, report

    def generation_tokenizer(self) -> Any:
        """The base's tokenizer set up for generation (what ``ram-trl eval`` of the merge uses: the merge copies
        the base's tokenizer), loaded once.

        Returns:
            `PreTrainedTokenizer`: The tokenizer.
        """
        if getattr(self, "_generation_tokenizer", None) is None:
            from transformers import AutoTokenizer

            from ram_trl.evaluation.scoring import generation_tokenizer

            self._generation_tokenizer = generation_tokenizer(AutoTokenizer.from_pretrained(self.base_model))
        return self._generation_tokenizer

    @property
    def merged_stages(self) -> list[str]:
        """The stages in the merge, in merge order (the priors, then this one)."""
        return [p.name for p in self.priors] + [self.stage_name]

    def retention(self, record: dict[str, Any]) -> dict[str, float | None]:
        """Per merged stage, the retention of a preview (:func:`~ram_trl.callbacks.preview.scores.record_retention`).

        Args:
            record (`dict[str, Any]`): One preview's record (its ``scores`` per stage and ``agent_score``).

        Returns:
            `dict[str, float | None]`: Stage name to retention, ``None`` where the specialist did not gain enough
            over the base.
        """
        return record_retention(
            record, self.base_scores, self.specialist_scores, self.merged_stages, self.evaluation.retention_min_gain
        )

    def share(self, value: Any) -> Any:
        """The main process's ``value`` on every rank (a no-op in one process).

        Args:
            value (`Any`): A picklable value (the main process's counts; the others' are ignored).

        Returns:
            `Any`: The main process's value.
        """
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
