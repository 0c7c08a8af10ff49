"""Live task-vector telemetry for TRL and transformers training runs, ending each run as a merge stage.
Details: docs/telemetry.md."""

from __future__ import annotations

import importlib.metadata
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import ram_trl
from ram_trl import defaults
from ram_trl.callbacks.telemetry.base_weights import ModelBase
from ram_trl.callbacks.telemetry.precision import rounding_warning
from ram_trl.callbacks.telemetry.tracker import DEFAULT_PREFIX, MAGNITUDE_SAMPLE_ELEMENTS, TaskVectorTracker
from ram_trl.errors import ConfigError, NonFiniteError
from ram_trl.io.hub import cached_revision, parse_reference, resolve_model
from ram_trl.sizes import check_number
from ram_trl.stage.manifest import (
    FINGERPRINT_ELEMENTS,
    MANIFEST_NAME,
    StageManifest,
    check_save_target,
    write_manifest,
)
from ram_trl.stage.save import agent_output, policy_of, prior_stage_reads, save_agent

#: Libraries whose versions a manifest records (those installed).
VERSIONED_PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "safetensors")


def library_versions() -> dict[str, str]:
    """Installed versions of :data:`VERSIONED_PACKAGES` and of ram_trl."""
    versions = {"ram_trl": ram_trl.__version__}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def last_reward_metrics(log_history: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The most recent value of every logged metric whose name mentions ``reward`` (e.g. GRPO's ``reward``,
    ``reward_std``, ``rewards/<func>/mean``), skipping non-finite values."""
    out: dict[str, float] = {}
    for entry in reversed(log_history):
        for key, value in entry.items():
            numeric = isinstance(value, int | float) and math.isfinite(float(value))
            if "reward" in key and key not in out and numeric:
                out[key] = float(value)
    return dict(sorted(out.items()))


def resolve_base_model(base_model: str | os.PathLike | None) -> str | os.PathLike | None:
    """The local directory of a base model: a path that exists as it is; a Hugging Face Hub id (``"org/name"``,
    ``"org/name@revision"``) through :func:`ram_trl.io.hub.resolve_model` (the cache first, honouring
    ``HF_HUB_OFFLINE``; only the files a model needs are fetched)."""
    if base_model is None or os.path.exists(base_model):
        return base_model
    resolved = resolve_model(base_model, what="base_model")
    return str(resolved) if cached_revision(resolved) is not None else base_model


class TaskVectorSparsityCallback(TrainerCallback):
    """Measure the task vector while a TRL / transformers trainer trains, and end the run as a merge stage.

    Args:
        trainer (`transformers.Trainer`, *optional*):
            The trainer (or set it later with :meth:`bind`): the metrics go through its logging path, and its
            reference model (GRPO / RLOO with ``beta > 0``) is the cheapest base.
        base_model (`str` or `os.PathLike`, *optional*):
            The base checkpoint, read through memory maps when the trainer holds no reference model: a local
            directory, or a Hugging Face Hub repository id, whose weights and JSON files are fetched with
            ``huggingface_hub.snapshot_download`` (from the local cache when they are there; ``HF_HUB_OFFLINE=1``
            allows only the cache) at construction (:func:`resolve_base_model`). Also recorded in the manifest.
            Without it (and without a reference model or PEFT) the callback snapshots the parameters at train
            begin. Every argument after it is keyword-only.
        every_n_steps (`int`, *optional*):
            Measure every this many optimizer steps (default: the trainer's logging steps); the final step is
            always measured.
        eps (`float`, *optional*, defaults to `1e-5`):
            Activity threshold, ``|tau| > eps`` (strict), as RAM masks (:data:`ram_trl.defaults.EPS`).
        save_dtype (`str`, *optional*, defaults to `"auto"`):
            The dtype the agent is saved in at train end and the ``density_saved`` view: ``"auto"`` (the dtype the
            trainer holds the trained parameters in: the saved agent is the trained one), ``"bfloat16"``,
            ``"float16"`` or ``"float32"``. A save that rounds away most of what training moved warns at train end.
        prior_stages (`Sequence[str | os.PathLike]`, *optional*, defaults to `()`):
            Stage manifests (or their directories) of agents trained before this one from the same base: the
            overlap and RAM+ rho_t / lambda_t metrics are reported against them.
        stage_name (`str`, *optional*):
            The stage's name in the manifest (default: the output directory's name).
        domain (`str`, *optional*):
            The vertical the stage specialises in (free text).
        prefix (`str`, *optional*, defaults to `"task_vector/"`):
            Prefix of every metric name.
        r (`float`, *optional*, defaults to `0.1`):
            RAM+ / RAM+s rescale strength for the prior-stage lambda_t.
        alpha (`float`, *optional*, defaults to `2.0`):
            RAM+ clip bound of rho_t.
        magnitudes (`bool`, *optional*, defaults to `True`):
            Also report the magnitude statistics.
        magnitude_sample (`int`, *optional*, defaults to `2**25`):
            Take them from a systematic sample of about this many elements when the model has more (``None``:
            every element; see :class:`~ram_trl.callbacks.telemetry.TaskVectorTracker`).
        threads (`int`, *optional*):
            Worker threads of a measurement (default: one per core of this process; see
            :class:`~ram_trl.callbacks.telemetry.TaskVectorTracker`).
        save_agent (`bool`, *optional*, defaults to `True`):
            Save the agent in ``save_dtype`` to the output directory at train end.
        write_stage (`bool`, *optional*, defaults to `True`):
            Write ``ram_stage.json`` at train end.

    Example::

        from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback

        callback = TaskVectorSparsityCallback(base_model="Qwen/Qwen2.5-0.5B-Instruct", stage_name="coding")
        trainer = GRPOTrainer(model=..., args=..., callbacks=[callback])
        callback.bind(trainer)
        trainer.train()  # metrics in log_history; agent + ram_stage.json in args.output_dir

    Raises:
        ConfigError: for invalid arguments (at construction) and, at train begin, for a missing trainer, an
            unsupported model layout or prior stages of another base.
    """

    def __init__(
        self,
        trainer: Any = None,
        base_model: str | os.PathLike | None = None,
        *,
        every_n_steps: int | None = None,
        eps: float = defaults.EPS,
        save_dtype: str = defaults.SAVE_DTYPE,
        prior_stages: Sequence[str | os.PathLike] = (),
        stage_name: str | None = None,
        domain: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        r: float = defaults.R,
        alpha: float = defaults.ALPHA,
        magnitudes: bool = True,
        magnitude_sample: int | None = MAGNITUDE_SAMPLE_ELEMENTS,
        threads: int | None = None,
        save_agent: bool = True,
        write_stage: bool = True,
    ) -> None:
        check_callback_arguments(locals(), type(self).__name__)  # every argument, before any training
        # validates eps, save_dtype, base_model, r, alpha now; the reference model is known at train begin
        self.tracker = TaskVectorTracker(
            resolve_base_model(base_model),
            eps=eps,
            save_dtype=save_dtype,
            prior_stages=prior_stages,
            r=r,
            alpha=alpha,
            prefix=prefix,
            magnitudes=magnitudes,
            magnitude_sample=magnitude_sample,
            threads=threads,
        )
        self.trainer = trainer
        self.base_model = self.tracker.base_model
        # a Hub id is recorded as written, with the commit it resolved to
        hub = cached_revision(self.base_model) if self.base_model and parse_reference(base_model or "") else None
        self.base_reference = (str(base_model), hub.revision) if hub is not None else None
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self.stage_name = stage_name
        self.domain = domain
        self.save_agent = save_agent
        self.write_stage = write_stage
        self.manifest_file: Path | None = None

    @property
    def save_dtype(self) -> torch.dtype | None:
        """The dtype the agent is saved in (``"auto"``: ``None`` until train begin resolves it)."""
        return self.tracker.save_dtype

    def bind(self, trainer: Any) -> TaskVectorSparsityCallback:
        """Attach the trainer (callbacks receive the model but never the trainer).

        Args:
            trainer (`transformers.Trainer`): The trainer this callback was given to.

        Returns:
            `TaskVectorSparsityCallback`: ``self``, so that ``callback = TaskVectorSparsityCallback(...).bind(t)``
            reads in one line.
        """
        self.trainer = trainer
        return self

    # -- events --------------------------------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.trainer is None:
            raise ConfigError(
                "TaskVectorSparsityCallback has no trainer: pass trainer=... or call callback.bind(trainer) "
                "before trainer.train() (the metrics go through the trainer's logging)"
            )
        self._check_one_writer(args)
        model = policy_of(kwargs.get("model") or self.trainer.model)
        reference = getattr(self.trainer, "ref_model", None)
        if getattr(self.trainer.args, "sync_ref_model", False):
            reference = None  # the reference model follows the policy: it is not the base
        if self.save_agent:
            # refuse an output_dir that is (or holds) the base now, not after training; on every rank (only reads
            # the file system), so that no rank goes on into a collective the others never reach
            base = self.tracker.base_model
            reads = [("base model", Path(base))] if base and Path(base).exists() else []
            reads += prior_stage_reads(self.tracker.prior_paths)
            agent_output(args.output_dir, reads).check()
            check_save_target(args.output_dir)
        self.tracker.reference_model = reference
        self.tracker.setup(model)
        if state.global_step == 0 and reference is None and self.tracker.kind == "full" and self.base_model:
            check_policy_starts_from_base(self.tracker, model)
        if state.global_step > 0 and self.tracker.base_description.startswith("in-memory snapshot"):
            raise ConfigError(
                f"training resumes at step {state.global_step}, so the weights at train begin are not the base; "
                "pass base_model=PATH to TaskVectorSparsityCallback (or train with a reference model)"
            )

    def _check_one_writer(self, args: TrainingArguments) -> None:
        """Refuse a second telemetry callback of this trainer that would write its stage into the same
        ``output_dir`` (one ``ram_stage.json`` would silently replace the other's)."""
        handler = getattr(self.trainer, "callback_handler", None)
        writers = [
            c
            for c in getattr(handler, "callbacks", ())
            if isinstance(c, TaskVectorSparsityCallback) and (c.save_agent or c.write_stage)
        ]
        if self in writers and len(writers) > 1:
            names = " and ".join(repr(c.stage_name or "unnamed") for c in writers)
            raise ConfigError(
                f"{len(writers)} TaskVectorSparsityCallback instances (stages {names}) would each write their stage "
                f"into output_dir {args.output_dir}, one replacing the other's {MANIFEST_NAME}: pass "
                "save_agent=False, write_stage=False to all but one"
            )

    def interval(self, args: TrainingArguments, state: TrainerState) -> int:
        """Steps between measurements: ``every_n_steps``, else the trainer's logging steps (a fraction of
        ``max_steps`` when below 1, as transformers reads it).

        Args:
            args (`TrainingArguments`): The trainer's arguments.
            state (`TrainerState`): The trainer's state.

        Returns:
            `int`: At least 1.
        """
        if self.every_n_steps is not None:
            return self.every_n_steps
        steps = getattr(state, "logging_steps", None) or args.logging_steps
        return max(1, math.ceil(steps)) if steps >= 1 else max(1, math.ceil(steps * state.max_steps))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        step = state.global_step
        final = step >= state.max_steps or control.should_training_stop
        if step % self.interval(args, state) == 0 or final:
            model = policy_of(kwargs.get("model") or self.trainer.model)
            metrics = self.tracker.measure(model, step)
            self.emit(metrics)
        return control

    def emit(self, metrics: dict[str, float]) -> None:
        """Log ``metrics`` now, as an entry of this step, through the trainer's public ``log``.

        ``transformers.Trainer.log`` appends the entry to ``state.log_history`` and calls every callback's ``on_log``
        (the reporting integrations: TensorBoard, W&B, ...). TRL's GRPO and RLOO trainers override ``log``: they add
        the average of the metrics they stored since their last entry (rewards, completion lengths, ...) to it and
        clear their store, so those land in this entry (docs/telemetry.md). The trainer's ``control.should_log``
        for the step is kept as the trainer set it, so it still logs its own entry on a logging step.

        Args:
            metrics (`dict[str, float]`): Metric name (with the prefix) to value.
        """
        control = getattr(self.trainer, "control", None)
        should_log = getattr(control, "should_log", False)
        self.trainer.log(dict(metrics))
        if control is not None:  # a log clears it (transformers' CallbackHandler.on_log)
            self.trainer.control.should_log = should_log

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self.tracker.ready:
            return
        out_dir = Path(args.output_dir)
        warning = rounding_warning(self.tracker.summary())
        if warning and state.is_world_process_zero:
            warnings.warn(warning, UserWarning, stacklevel=2)
        if self.save_agent:  # the manifest is committed with the agent, last
            manifest = (lambda: self.manifest(args, state)) if self.write_stage else None
            written = save_agent(self.trainer, out_dir, self.save_dtype, manifest)
            if written is not None:
                self.manifest_file = written
        elif self.write_stage and state.is_world_process_zero:
            # no agent saved: the manifest describes no weight files (readers refuse it as a merge input)
            manifest = self.manifest(args, state)
            manifest.files = {}
            self.manifest_file = write_manifest(manifest, out_dir)

    # -- the stage -----------------------------------------------------------------------------------------------

    def manifest(self, args: TrainingArguments, state: TrainerState) -> StageManifest:
        """The stage manifest of the finished run.

        Args:
            args (`TrainingArguments`): The trainer's arguments (the output directory names the stage by default).
            state (`TrainerState`): The trainer's state (steps, log history for the last rewards).

        Returns:
            `StageManifest`: The manifest (written by :meth:`on_train_end`).
        """
        unwrapped = policy_of(self.trainer.accelerator.unwrap_model(self.trainer.model))
        config = getattr(unwrapped, "config", None)
        base_id = self.base_model or getattr(config, "_name_or_path", None) or "unknown"
        if self.base_model and Path(base_id).exists():
            base_id = Path(base_id).resolve()  # readers do not run from this run's working directory
        if self.base_reference is not None:
            base_id = self.base_reference[0]
        telemetry = {k: v for k, v in self.tracker.last.items() if math.isfinite(v)}
        return StageManifest(
            stage=self.stage_name or Path(args.output_dir).resolve().name,
            domain=self.domain,
            base_model=str(base_id),
            base_revision=self.base_reference[1] if self.base_reference else None,
            base_fingerprint=self.tracker.base_fingerprint,
            checkpoint=".",
            kind=self.tracker.kind,
            trainer=type(self.trainer).__name__,
            steps=state.global_step,
            processes=self.trainer.accelerator.num_processes,
            save_dtype=str(self.save_dtype).removeprefix("torch."),
            telemetry=telemetry,
            rewards=last_reward_metrics(state.log_history),
            versions=library_versions(),
            extra={
                "telemetry": {
                    **self.tracker.summary(),
                    "prefix": self.prefix,
                    "every_n_steps": self.interval(args, state),
                    "measured_step": self.tracker.last_step,
                }
            },
        )


def check_policy_starts_from_base(tracker: TaskVectorTracker, model: torch.nn.Module) -> None:
    """Compare the policy at train begin with the base checkpoint on the base fingerprint's tensors (their leading
    elements, in the lower of the two precisions): a ``base_model`` that is not where the policy starts from (same
    architecture, other weights) makes every metric meaningless, so it is reported before training."""
    source, fingerprint = tracker.source, tracker.base_fingerprint
    if source is None or fingerprint is None:
        return
    policy = ModelBase.from_model(model, "policy")
    available = set(policy.names())
    dtypes = {p.dtype for p in model.parameters() if torch.is_floating_point(p)}
    for name in fingerprint.tensors:
        if name not in available:
            continue
        numel = min(math.prod(source.shape(name)), FINGERPRINT_ELEMENTS)
        theirs = source.read(name, 0, numel)
        ours = policy.head(name, numel)
        if not bool(torch.isfinite(theirs.float()).all()):
            raise NonFiniteError(f"base_model {tracker.base_model}: tensor {name!r} holds NaN/Inf values")
        coarse = max([theirs.dtype, *dtypes], key=lambda d: torch.finfo(d).eps if d.is_floating_point else 0.0)
        if not torch.equal(ours.cpu().to(coarse), theirs.cpu().to(coarse)):
            warnings.warn(
                f"base_model {tracker.base_model}: tensor {name!r} differs from the policy's at train begin, so the "
                "base is not the checkpoint the policy was loaded from; every task-vector metric and the merge "
                "measure against this base. Pass the policy's own starting checkpoint as base_model",
                UserWarning,
                stacklevel=2,
            )
            return


__all__ = [
    "TaskVectorSparsityCallback",
    "check_callback_arguments",
    "check_policy_starts_from_base",
    "last_reward_metrics",
    "library_versions",
    "resolve_base_model",
]


def check_callback_arguments(arguments: Mapping[str, Any], where: str = "TaskVectorSparsityCallback") -> None:
    """Validate the arguments of the telemetry callback before any training: types, finiteness, ranges and the
    characters of names (a stage name becomes a directory label, a merge row and a model-card line)."""

    def fail(name: str, value: Any, want: str) -> None:
        raise ConfigError(f"{where}: {name}={value!r}: {want}")

    def positive_int(name: str) -> None:
        value = arguments.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            fail(name, value, "give a positive integer (or None)")

    positive_int("every_n_steps")
    positive_int("threads")
    positive_int("magnitude_sample")
    for name in ("eps", "r", "alpha"):
        if name in arguments:
            check_number(arguments[name], where, name, minimum=0.0)
    for name in ("magnitudes", "save_agent", "write_stage"):
        if name in arguments and not isinstance(arguments[name], bool):
            fail(name, arguments[name], "give True or False")
    base = arguments.get("base_model")
    if base is not None and not isinstance(base, str | os.PathLike):
        fail("base_model", base, "give the base checkpoint's directory (a path)")
    prior = arguments.get("prior_stages", ())
    if isinstance(prior, str | bytes | os.PathLike) or not isinstance(prior, Sequence):
        fail("prior_stages", prior, "give a list of stage manifests or their directories, e.g. ['runs/coding']")
    for item in prior:
        if not isinstance(item, str | os.PathLike):
            fail("prior_stages", prior, "every entry must be a path")
    prefix = arguments.get("prefix", "")
    if not isinstance(prefix, str) or any(ord(c) < 32 for c in prefix):
        fail("prefix", prefix, "give a string without control characters")
    for name in ("stage_name", "domain"):
        value = arguments.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip():
            fail(name, value, "give a non-empty string (or None)")
        if any(ord(c) < 32 or ord(c) == 127 for c in value) or len(value) > 200:
            fail(name, value, "give one line of at most 200 characters, without control characters (newlines)")
        if name == "stage_name" and any(c in value for c in "/\\|"):
            fail(name, value, "a stage name may not hold '/', '\\' or '|' (it labels files, rows and tables)")
