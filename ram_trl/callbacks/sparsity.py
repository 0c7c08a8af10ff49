"""Live task-vector telemetry for TRL and transformers training runs, ending each run as a merge stage.

:class:`TaskVectorSparsityCallback` measures the run's task vector every ``every_n_steps`` optimizer steps with a
:class:`~ram_trl.callbacks.telemetry.tracker.TaskVectorTracker` and sends the metrics through the trainer's own logging path,
so they reach ``trainer.state.log_history`` and every reporting integration (TensorBoard, W&B, ...) next to the
reward curve. When training ends it saves the agent in ``save_dtype`` to ``args.output_dir`` (the full model, or the
PEFT adapter of a LoRA run) and writes the stage manifest ``ram_stage.json`` beside it (:mod:`ram_trl.stage.manifest`)::

    cb = TaskVectorSparsityCallback(base_model="models/base", stage_name="coding", domain="coding")
    trainer = GRPOTrainer(model="models/base", reward_funcs=..., args=..., train_dataset=..., callbacks=[cb])
    cb.bind(trainer)
    trainer.train()
    # args.output_dir now holds the bf16 agent and ram_stage.json; a merge config takes {stage: args.output_dir}
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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
from ram_trl.output import OutputDir, guard_os_errors
from ram_trl.stage.manifest import (
    FINGERPRINT_ELEMENTS,
    MANIFEST_NAME,
    StageManifest,
    check_save_target,
    describe_files,
    manifest_path,
    weight_files,
    write_manifest,
)
from ram_trl.validation import check_callback_arguments

#: Libraries whose versions a manifest records (those installed).
VERSIONED_PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "safetensors")


def library_versions() -> dict[str, str]:
    """Installed versions of :data:`VERSIONED_PACKAGES` and of ram_trl.

    Returns:
        `dict[str, str]`: Package name to version, for those installed.
    """
    versions = {"ram_trl": ram_trl.__version__}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def last_reward_metrics(log_history: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The most recent value of every logged metric whose name mentions ``reward`` (e.g. GRPO's ``reward``,
    ``reward_std``, ``rewards/<func>/mean``), skipping non-finite values.

    Args:
        log_history (`Sequence[dict[str, Any]]`): A trainer's ``state.log_history``.

    Returns:
        `dict[str, float]`: Metric name to its last finite value, sorted by name.
    """
    out: dict[str, float] = {}
    for entry in reversed(log_history):
        for key, value in entry.items():
            numeric = isinstance(value, int | float) and math.isfinite(float(value))
            if "reward" in key and key not in out and numeric:
                out[key] = float(value)
    return dict(sorted(out.items()))


def resolve_base_model(base_model: str | os.PathLike | None) -> str | os.PathLike | None:
    """The local directory of a base model: a path that exists as it is; a Hugging Face Hub repository id
    (``"org/name"``) through ``huggingface_hub.snapshot_download`` (its ``*.safetensors`` and ``*.json`` files),
    which answers from the local cache when the files are there and honours ``HF_HUB_OFFLINE``.

    Args:
        base_model (`str` or `os.PathLike`, *optional*): A local path or a Hub repository id (``None``: none).

    Returns:
        `str` or `os.PathLike` or `None`: The local path (``base_model`` itself unless it was fetched); a path that
        is neither is returned as it is, for the caller's "does not exist" error.

    Raises:
        ConfigError: for a repository id that cannot be fetched (offline and not cached, unknown, no network),
            saying how to download it first.
    """
    if base_model is None or os.path.exists(base_model):
        return base_model
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    name = os.fspath(base_model)
    try:
        validate_repo_id(name)
    except HFValidationError:
        return base_model  # not a repository id: a local path that does not exist
    try:
        return snapshot_download(name, allow_patterns=["*.safetensors", "*.json"])
    except Exception as exc:  # noqa: BLE001 - offline without a cache, unknown repository, no network, ...
        raise ConfigError(
            f"base_model: {name} is not a local directory, and the Hub repository could not be fetched "
            f"({type(exc).__name__}); download it first (`hf download {name} --local-dir DIR`) and pass "
            "base_model=DIR"
        ) from exc


def policy_of(model: torch.nn.Module) -> torch.nn.Module:
    """The policy inside a trainer's model: TRL's PPO wraps policy and value model in one module with ``.policy``.

    Args:
        model (`torch.nn.Module`): The trainer's model.

    Returns:
        `torch.nn.Module`: Its ``policy`` when it has one, else ``model``.
    """
    policy = getattr(model, "policy", None)
    return policy if isinstance(policy, torch.nn.Module) else model


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
        """Log ``metrics`` now, as an entry of their own at this step, through the trainer's public logging path.

        ``transformers.Trainer.log`` appends the entry to ``state.log_history`` and calls every callback's ``on_log``
        (the reporting integrations: TensorBoard, W&B, ...). TRL's GRPO and RLOO trainers override ``log`` to add,
        average and clear their own metric store (the rewards) in whatever entry is logged next, so the callback
        calls the base class's ``log``: the trainer's own entries stay exactly what they are without the callback
        (the same steps and the same values), whatever ``every_n_steps`` and ``logging_steps`` are; the trainer's
        ``control.should_log`` for the step is left as the trainer set it. A trainer that is not a
        ``transformers.Trainer`` gets its own ``log``.

        Args:
            metrics (`dict[str, float]`): Metric name (with the prefix) to value.
        """
        from transformers import Trainer  # loaded already by the trainer that runs this callback

        logs = dict(metrics)
        control = getattr(self.trainer, "control", None)
        should_log = getattr(control, "should_log", False)
        if isinstance(self.trainer, Trainer):
            Trainer.log(self.trainer, logs)
        else:
            self.trainer.log(logs)
        if control is not None:
            # a log clears ``should_log`` (transformers' CallbackHandler.on_log): keep the trainer's own decision for
            # this step, so that it still logs its step when this is a logging step (and only then)
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
        telemetry = {k: v for k, v in self.tracker.last.items() if math.isfinite(v)}
        return StageManifest(
            stage=self.stage_name or Path(args.output_dir).resolve().name,
            domain=self.domain,
            base_model=str(base_id),
            base_fingerprint=self.tracker.base_fingerprint,
            checkpoint=".",
            kind=self.tracker.kind,
            trainer=type(self.trainer).__name__,
            steps=state.global_step,
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


def _cast_state(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors cast to ``dtype`` on the CPU; tensors sharing storage (tied weights) stay shared."""
    out: dict[str, torch.Tensor] = {}
    memo: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        if not torch.is_floating_point(tensor):
            out[name] = tensor.cpu()
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in memo:
            memo[key] = tensor.to(device="cpu", dtype=dtype).contiguous()
        out[name] = memo[key]
    return out


def save_agent(
    trainer: Any,
    out_dir: Path,
    dtype: torch.dtype,
    manifest: Callable[[], StageManifest] | None = None,
) -> Path | None:
    """Save the trainer's model in ``dtype`` to ``out_dir``: the full model (with the tokenizer), or the adapter of
    a PEFT model, and with ``manifest`` the stage manifest beside it.

    The output-commit protocol of :mod:`ram_trl.output`: everything is written to a temporary sibling of ``out_dir``
    (with a lock file naming the process) and committed at once. A missing ``out_dir`` is created by an atomic
    rename; an existing one (a trainer's ``output_dir`` also holds its checkpoints and logs) receives the files all
    or nothing, the manifest last, so a save killed half-way leaves no manifest and the directory is not taken for
    a finished stage. A failure (or SIGINT/SIGTERM/SIGHUP) while saving removes the temporary directory and leaves
    ``out_dir`` as it was; a ``kill -9``'s leftovers are removed by the next save.

    Every process must call this (under DeepSpeed ZeRO-3 the gather of the sharded model is collective); only the
    main process writes.

    Args:
        trainer: The trainer (its ``accelerator``, ``model`` and ``processing_class``).
        out_dir: The agent directory.
        dtype: The dtype of the saved floating tensors.
        manifest: Called on the main process for the stage manifest to write beside the agent.

    Returns:
        The manifest's path on the main process when ``manifest`` is given, else ``None``.

    Raises:
        OutputError: for file-system errors of ``out_dir`` (full, read-only, no permission).
    """
    accelerator = trainer.accelerator
    model = trainer.model_wrapped if getattr(trainer, "model_wrapped", None) is not None else trainer.model
    state_dict = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return None
    unwrapped = policy_of(accelerator.unwrap_model(trainer.model))
    if unwrapped is not accelerator.unwrap_model(trainer.model):
        prefix = "policy."
        state_dict = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    cast = _cast_state(state_dict, dtype)
    check_finite_agent(cast, dtype, out_dir)  # commit only healthy agents: nothing written otherwise
    output = agent_output(out_dir)
    tmp = output.begin()
    try:
        with guard_os_errors(f"agent directory {out_dir}"):
            unwrapped.save_pretrained(str(tmp), state_dict=cast, safe_serialization=True)
            # the weights hash while the config and tokenizer are written
            with ThreadPoolExecutor(1) as hasher:
                digests = hasher.submit(describe_files, tmp) if manifest is not None else None
                config_file = tmp / "config.json"
                # say what the weights hold (save_pretrained writes the training dtype)
                if config_file.is_file():
                    config = json.loads(config_file.read_text())
                    config["dtype"] = str(dtype).removeprefix("torch.")
                    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
                processing = getattr(trainer, "processing_class", None)
                if processing is not None and hasattr(processing, "save_pretrained"):
                    processing.save_pretrained(str(tmp))
                if manifest is not None and digests is not None:
                    stage = manifest()
                    files = digests.result()
                    if sorted(files) != weight_files(tmp):  # a weight file written since: describe all
                        files = describe_files(tmp)
                    stage.files = files  # the stage contract: exactly these files, these bytes
                    write_manifest(stage, tmp)
        # the previous save's weight files that this one does not replace go with the commit
        output.commit(remove=check_save_target(out_dir, weight_files(tmp)))
    except BaseException:
        output.abort()
        raise
    return out_dir / MANIFEST_NAME if manifest is not None else None


def check_policy_starts_from_base(tracker: TaskVectorTracker, model: torch.nn.Module) -> None:
    """Compare the policy at train begin with the base checkpoint on the base fingerprint's tensors (their leading
    elements, in the lower of the two precisions): a ``base_model`` that is not where the policy starts from (same
    architecture, other weights) makes every metric meaningless, so it is reported before training.

    Args:
        tracker (`TaskVectorTracker`): The set-up tracker (its base source and fingerprint).
        model (`torch.nn.Module`): The policy, before its first step.

    Raises:
        NonFiniteError: naming the base and the tensor, when the base holds NaN/Inf there.

    Warns:
        UserWarning: naming the base and the first tensor that differs (the policy may start from another
            checkpoint on purpose, e.g. a fine-tune measured against its original base).
    """
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
        coarse = max(
            [theirs.dtype, *dtypes], key=lambda d: torch.finfo(d).eps if d.is_floating_point else 0.0
        )
        if not torch.equal(ours.cpu().to(coarse), theirs.cpu().to(coarse)):
            warnings.warn(
                f"base_model {tracker.base_model}: tensor {name!r} differs from the policy's at train begin, so the "
                "base is not the checkpoint the policy was loaded from; every task-vector metric and the merge "
                "measure against this base. Pass the policy's own starting checkpoint as base_model",
                UserWarning,
                stacklevel=2,
            )
            return


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN or Inf: its minimum and maximum in one pass without a temporary
    (NaN propagates into both, an Inf is one of them), an order of magnitude faster than ``isfinite`` on the CPU."""
    if tensor.numel() == 0:
        return True
    try:
        low, high = torch.aminmax(tensor)
    except (RuntimeError, NotImplementedError):  # a dtype without a min/max kernel: the elementwise test
        return bool(torch.isfinite(tensor).all())
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def check_finite_agent(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype, out_dir: str | os.PathLike
) -> None:
    """Refuse to save an agent holding NaN or Inf values (a diverged run, or trained values beyond ``dtype``).

    Args:
        tensors (`dict[str, torch.Tensor]`): The agent's tensors, cast to the save dtype.
        dtype (`torch.dtype`): The save dtype (named in the message).
        out_dir (`str` or `os.PathLike`): The agent directory (named in the message; nothing is written to it).

    Raises:
        NonFiniteError: naming the first tensor with non-finite values and how many the agent holds.
    """
    bad: list[tuple[str, int]] = []
    for name, tensor in tensors.items():
        if torch.is_floating_point(tensor) and not _all_finite(tensor):
            bad.append((name, int(tensor.numel() - torch.isfinite(tensor).sum())))
    if bad:
        total = sum(count for _, count in bad)
        name = str(dtype).removeprefix("torch.")
        raise NonFiniteError(
            f"agent directory {out_dir}: the agent holds {total} NaN/Inf values in {name} ({len(bad)} tensors, "
            f"first {bad[0][0]!r}); the run diverged or its weights overflow save_dtype={name!r}: nothing was "
            "saved (the trainer's own checkpoints are untouched). Use save_dtype='float32' or a lower learning rate"
        )


def prior_stage_reads(prior_stages: Sequence[str | os.PathLike]) -> list[tuple[str, Path]]:
    """The directories of prior stages, as inputs an agent directory must not overlap (:class:`OutputDir` reads).

    Args:
        prior_stages (`Sequence[str | os.PathLike]`): Stage manifests or their directories.

    Returns:
        `list[tuple[str, Path]]`: ``("prior stage", directory)`` for each that exists.
    """
    reads = []
    for stage in prior_stages:
        file = manifest_path(stage)
        if file.exists():
            reads.append(("prior stage", file.parent))
    return reads


def agent_output(out_dir: str | os.PathLike, reads: Sequence[tuple[str, Path]] = ()) -> OutputDir:
    """The output-commit protocol of an agent directory (:func:`save_agent`): files merged into an existing
    directory, ``ram_stage.json`` last.

    Args:
        out_dir (`str` or `os.PathLike`): The agent directory.
        reads (`Sequence[tuple[str, Path]]`, *optional*, defaults to `()`): Inputs it must not overlap, each with
            what it is (the base model).

    Returns:
        `OutputDir`: The protocol object (``check()`` it before training, ``commit`` the files after).
    """
    return OutputDir(out_dir, merge=True, markers=(MANIFEST_NAME,), reads=reads, what="agent directory")


__all__ = [
    "TaskVectorSparsityCallback",
    "agent_output",
    "check_finite_agent",
    "check_policy_starts_from_base",
    "last_reward_metrics",
    "library_versions",
    "resolve_base_model",
    "save_agent",
]
