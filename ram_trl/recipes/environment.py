"""The recipe checks that touch the environment (``--dry-run``) and a stage's trainer settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ram_trl.errors import ConfigError, RamTrlError
from ram_trl.evaluation.rewards import import_object
from ram_trl.io.hub import parse_reference, resolve_model
from ram_trl.recipes.mechanism import MATCHED, full_ram, task_arithmetic_lambda
from ram_trl.recipes.schema import FISHER_SETTINGS, MAX_SEED, MergeRow, Recipe, StageSpec, expand_merges

__all__ = ["TRAINER_BOUNDS", "check_finite", "check_trainer_config", "trainer_settings", "validate_recipe"]


def _check_path(path: str, root: Path, what: str, problems: list[str], directory: bool = False) -> Path:
    resolved = Path(path).expanduser()
    resolved = resolved if resolved.is_absolute() else root / resolved
    if directory and not resolved.is_dir():
        problems.append(f"{what} {resolved} is not a directory")
    elif not directory and not resolved.is_file():
        problems.append(f"{what} {resolved} does not exist")
    return resolved


def _trainer_config_class(trainer: str) -> type:
    if trainer == "grpo":
        from trl import GRPOConfig

        return GRPOConfig
    from trl import RLOOConfig

    return RLOOConfig


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def trainer_settings(stage: StageSpec, seed: int, validate_only: bool = False) -> dict[str, Any]:
    """The stage trainer config's keyword arguments: the recipe's ``config`` over the runner's defaults; ``bf16``
    defaults off without a GPU; ``validate_only`` turns ``bf16``/``fp16`` off (the config refuses them on a CPU)."""
    settings: dict[str, Any] = {
        "report_to": [],
        "save_strategy": "no",
        "seed": seed,
        "disable_tqdm": True,  # the stage's output is a log file; the launcher shows the steps (recipes.progress)
        **stage.config,
    }
    if not _cuda():
        if validate_only:
            settings.update(bf16=False, fp16=False)
        settings.setdefault("bf16", False)
    return _new_checkpointing_names(_trainer_config_class(stage.trainer), settings)


def _new_checkpointing_names(cls: type, settings: dict[str, Any]) -> dict[str, Any]:
    """``gradient_checkpointing*`` renamed ``activation_checkpointing*`` where the config knows the new names
    (TRL defaults the old one on, and transformers warns with a FutureWarning the user cannot act on)."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(cls)}
    for old, new in (
        ("gradient_checkpointing", "activation_checkpointing"),
        ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
    ):
        if new in fields and old in fields and settings.get(new) is None:
            default = fields[old].default if fields[old].default is not dataclasses.MISSING else None
            value = settings.pop(old, default)
            if value is not None:
                settings[new] = value
    return settings


#: Bounds of trainer-config numbers the trainers check late or never (a NaN learning rate trains a NaN model).
TRAINER_BOUNDS: dict[str, dict[str, Any]] = {
    "learning_rate": {"above": 0},
    "num_train_epochs": {"above": 0},
    "max_steps": {"minimum": -1, "integer": True},
    "per_device_train_batch_size": {"minimum": 1, "integer": True},
    "gradient_accumulation_steps": {"minimum": 1, "integer": True},
    "num_generations": {"minimum": 1, "integer": True},
    "max_completion_length": {"minimum": 1, "integer": True},
    "max_prompt_length": {"minimum": 1, "integer": True},
    "logging_steps": {"above": 0},
    "temperature": {"above": 0},
    "top_p": {"above": 0, "maximum": 1},
    "beta": {"minimum": 0},
    "epsilon": {"minimum": 0},
    "weight_decay": {"minimum": 0},
    "warmup_ratio": {"minimum": 0, "maximum": 1},
    "warmup_steps": {"minimum": 0},
    "max_grad_norm": {"minimum": 0},
    "num_iterations": {"minimum": 1, "integer": True},
    "seed": {"minimum": 0, "maximum": MAX_SEED, "integer": True},
}


def _field_kinds(cls: type) -> dict[str, type]:
    """``int`` or ``float`` for each field of a trainer config typed as a number (optionally ``None``)."""
    import dataclasses
    import typing

    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to the bounds table
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
    kinds = {}
    for name, hint in hints.items():
        options = set(typing.get_args(hint) or (hint,)) - {type(None)}
        if options == {int}:
            kinds[name] = int
        elif options and options <= {int, float}:
            kinds[name] = float
    return kinds


def check_finite(value: Any, where: str) -> None:
    """Refuse NaN and Inf anywhere in a nested value (``config:``, ``peft:``, generator ``kwargs:``)."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} is {value!r}; give a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            check_finite(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_finite(item, f"{where}[{index}]")


def check_trainer_config(stage: StageSpec) -> None:
    """Validate the stage's GRPOConfig/RLOOConfig keys and values (:data:`TRAINER_BOUNDS`), then build it."""
    import dataclasses
    import tempfile

    from ram_trl.sizes import check_number

    cls = _trainer_config_class(stage.trainer)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(stage.config) - known)
    if unknown:
        raise ConfigError(
            f"stage {stage.name!r}: {cls.__name__} has no field {', '.join(map(repr, unknown))}; "
            "see the TRL documentation of the trainer's config"
        )
    where = f"stage {stage.name!r}"
    kinds = _field_kinds(cls)
    for key, value in stage.config.items():
        check_finite(value, f"{where}: config.{key}")
        if value is None or (key not in kinds and key not in TRAINER_BOUNDS):
            continue
        if key in kinds or isinstance(value, int | float):
            bounds = dict(TRAINER_BOUNDS.get(key, {}))
            bounds.setdefault("integer", kinds.get(key) is int)
            check_number(value, where, f"config.{key}", **bounds)
    config = {k: v for k, v in trainer_settings(stage, 0, validate_only=True).items() if k != "deepspeed"}
    with tempfile.TemporaryDirectory() as scratch:
        try:
            cls(output_dir=scratch, **config)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"stage {stage.name!r}: invalid {cls.__name__}: {exc}") from None


def validate_recipe(recipe: Recipe, root: Path, *, check_paths: bool = True, where: str = "recipe") -> list[str]:
    """The environment checks of ``--dry-run``: import paths, trainer and PEFT configs, config files, paths."""
    from ram_trl.sizes import check_number

    source = where
    problems: list[str] = []
    notes: list[str] = []
    if recipe.base.path is not None and check_paths:
        if parse_reference(recipe.base.path) is not None and not (root / recipe.base.path).exists():
            try:  # a Hub id: in the cache, or fetchable (its metadata now, the weights when a stage loads it)
                resolve_model(recipe.base.path, what="base.path", weights=False)
            except ConfigError as exc:
                problems.append(str(exc))
        else:
            _check_path(recipe.base.path, root, "base.path", problems, directory=True)
    if recipe.base.gguf is not None:
        from ram_trl.io.gguf import open_gguf_source, require_gguf

        try:
            require_gguf()
            if check_paths:
                open_gguf_source(_check_path(recipe.base.gguf, root, "base.gguf", []), recipe.base.gguf_member)
        except ConfigError as exc:
            problems.append(f"base.gguf: {exc}")
    if recipe.base.build is not None:
        import inspect

        from ram_trl.synthetic import make_base_checkpoint

        accepted = set(inspect.signature(make_base_checkpoint).parameters) - {"output_dir"}
        for key in sorted(set(recipe.base.build) - accepted):
            problems.append(f"base.build: unknown argument {key!r}; use some of {', '.join(sorted(accepted))}")
        for key in ("hidden_size", "num_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
            if key in recipe.base.build:
                try:
                    check_number(recipe.base.build[key], "base.build", key, minimum=1, integer=True)
                except ConfigError as exc:
                    problems.append(str(exc))
        if recipe.base.build.get("vocab_size") is not None:
            try:
                check_number(recipe.base.build["vocab_size"], "base.build", "vocab_size", minimum=1, integer=True)
            except ConfigError as exc:
                problems.append(str(exc))
        build = recipe.base.build
        heads, kv = build.get("num_attention_heads", 4), build.get("num_key_value_heads", 2)
        if not problems and build.get("hidden_size", 64) % heads:
            problems.append(
                f"base.build: num_attention_heads {heads} must divide hidden_size {build.get('hidden_size', 64)}"
            )
        if not problems and heads % kv:
            problems.append(f"base.build: num_key_value_heads {kv} must divide num_attention_heads {heads}")
        if recipe.base.build.get("dtype", "bfloat16") not in ("bfloat16", "float16", "float32"):
            problems.append(f"base.build.dtype: {recipe.base.build['dtype']!r}; use bfloat16, float16 or float32")
    for stage in recipe.stages:
        where = f"stage {stage.name!r}"
        if stage.checkpoint is not None and check_paths:
            _check_path(stage.checkpoint, root, f"{where}: checkpoint", problems, directory=True)
        if stage.prompts is not None:
            try:
                check_finite(stage.prompts.kwargs, f"{where}: prompts.kwargs")
            except ConfigError as exc:
                problems.append(str(exc))
            if stage.prompts.generator is not None:
                try:
                    if not callable(import_object(stage.prompts.generator, f"{where}: prompt generator")):
                        problems.append(f"{where}: prompt generator {stage.prompts.generator!r} is not callable")
                except ConfigError as exc:
                    problems.append(str(exc))
            for key in ("train_file", "eval_file", "val_file"):
                value = getattr(stage.prompts, key)
                if value is not None and check_paths:
                    _check_path(value, root, f"{where}: prompts.{key}", problems)
        for path in stage.rewards:
            try:
                if not callable(import_object(path, f"{where}: reward function")):
                    problems.append(f"{where}: reward function {path!r} is not callable")
            except ConfigError as exc:
                problems.append(str(exc))
        if stage.trained:
            try:
                check_trainer_config(stage)
            except ConfigError as exc:
                problems.append(str(exc))
            if stage.peft is not None:
                try:
                    from peft import LoraConfig

                    from ram_trl.io.lora import check_lora_config

                    check_finite(stage.peft, f"{where}: peft")
                    check_lora_config(stage.peft, Path("recipe"), f"{where}: peft")
                    LoraConfig(**stage.peft)
                except ImportError:
                    problems.append(f"{where}: 'peft:' needs the peft package (pip install peft)")
                except RamTrlError as exc:
                    problems.append(str(exc).replace(": recipe: ", ": "))
                except (TypeError, ValueError) as exc:
                    problems.append(f"{where}: invalid peft LoraConfig: {exc}")
            if stage.accelerate_config is not None:
                _check_accelerate(stage, root, problems)
            if stage.preview is not None:
                problems += _method_problems(
                    recipe, stage.preview.method, stage.preview.parameters, f"{where}: preview"
                )[1]
    for row in expand_merges(recipe):
        unknown = sorted(set(row.fisher) - FISHER_SETTINGS)
        if unknown:
            problems.append(
                f"merge {row.name!r}: unknown fisher setting {', '.join(map(repr, unknown))}; "
                f"use some of {', '.join(sorted(FISHER_SETTINGS))}"
            )
        method, found = _method_problems(recipe, row.method, row.parameters, f"merge {row.name!r}", row)
        problems += found
        if method is None:
            continue
        if row.fisher and not method.needs_fisher:
            problems.append(f"merge {row.name!r}: 'fisher:' settings apply only to method 'fisher'")
        fewest, most = method.agents
        if len(recipe.stages) < fewest or (most is not None and len(recipe.stages) > most):
            wanted = f"exactly {fewest}" if fewest == most else f"{fewest} to {most}" if most else f"at least {fewest}"
            problems.append(
                f"merge {row.name!r}: method {row.method!r} merges {wanted} model(s) besides the base; the recipe "
                f"has {len(recipe.stages)} stage(s)"
            )
    if recipe.evaluation.enabled:
        for stage in recipe.stages:
            if stage.prompts is None or (stage.prompts.generator is None and stage.prompts.eval_file is None):
                notes.append(f"stage {stage.name!r} has no held-out prompts: it gets no evaluation column")
            elif (stage.prompts.val_file if stage.prompts.generator is None else stage.prompts.validation_size) in (
                None,
                0,
            ):
                notes.append(
                    f"stage {stage.name!r} has no validation prompts (val_size: 0 / no val_file): nothing is "
                    "chosen on its column"
                )
    if not check_paths:
        notes.append("model checkpoints and prompt files were not checked (--skip-paths)")
    if len(problems) == 1:
        raise ConfigError(f"{source}: {problems[0]}")
    if problems:
        raise ConfigError(f"{source} is invalid:\n  - " + "\n  - ".join(problems))
    return notes


def _check_accelerate(stage: StageSpec, root: Path, problems: list[str]) -> None:
    where = f"stage {stage.name!r}"
    before = len(problems)
    path = _check_path(stage.accelerate_config, root, f"{where}: accelerate_config", problems)
    if len(problems) > before:
        return
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        problems.append(f"{where}: accelerate_config {path} is not valid YAML ({exc})")
        return
    deepspeed = data.get("deepspeed_config") or {}
    zero_stage = deepspeed.get("zero_stage")
    saves_16bit = deepspeed.get("zero3_save_16bit_model")
    ds = deepspeed.get("deepspeed_config_file")
    if ds:
        ds_path = Path(ds) if Path(ds).is_absolute() else path.parent / ds
        if not ds_path.is_file():
            problems.append(f"{where}: DeepSpeed config {ds_path} named by {path} does not exist")
            return
        try:
            ds_config = json.loads(ds_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: DeepSpeed config {ds_path} is not valid JSON ({exc})")
            return
        zero = ds_config.get("zero_optimization") or {}
        zero_stage = zero.get("stage", zero_stage)
        saves_16bit = zero.get("stage3_gather_16bit_weights_on_model_save", saves_16bit)
    if stage.preview is not None:
        _check_preview_launch(stage, data.get("distributed_type"), zero_stage, saves_16bit, path, problems)


def _check_preview_launch(
    stage: StageSpec, distributed_type: Any, zero_stage: Any, saves_16bit: Any, path: Path, problems: list[str]
) -> None:
    """The merge preview under the stage's launch: no FSDP; ZeRO-3 only element-wise and full-weight."""
    where = f"stage {stage.name!r}: preview"
    if str(distributed_type).upper() == "FSDP":
        problems.append(f"{where}: the merge preview does not support FSDP ({path}); use DDP or DeepSpeed ZeRO-3")
        return
    if str(distributed_type).upper() != "DEEPSPEED" or str(zero_stage) != "3":
        return
    from ram_trl.merging.range_merge import check_range_method
    from ram_trl.methods import resolve_method

    try:
        check_range_method(resolve_method(stage.preview.method)[0])
    except ConfigError as exc:
        problems.append(f"{where} under DeepSpeed ZeRO-3 ({path}): {exc}")
    except Exception:  # noqa: BLE001 - an unknown method is reported by the preview's own check
        pass
    if stage.peft is not None:
        problems.append(
            f"{where} under DeepSpeed ZeRO-3 ({path}): a PEFT (LoRA) stage is not supported there; use DDP or "
            "ZeRO-1/2 for this stage, or drop the preview"
        )
    if saves_16bit in (None, False, "false", "False"):
        problems.append(
            f"{where} under DeepSpeed ZeRO-3 ({path}): the preview saves the policy at every preview, which needs "
            "stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed config (zero3_save_16bit_model: true "
            "in the accelerate config)"
        )


def _method_problems(
    recipe: Recipe, name: str, parameters: dict[str, Any], where: str, row: MergeRow | None = None
) -> tuple[Any, list[str]]:
    """A merge method (``None`` if unknown) and what is wrong with its parameters, checked as the merge will."""
    from ram_trl.merging.config.settings import check_parameter
    from ram_trl.methods import resolve_method

    try:
        method, _ = resolve_method(name)
    except Exception as exc:  # noqa: BLE001 - the registry's message names the method
        return None, [f"{where}: {exc}"]
    problems = []
    for key, value in parameters.items():
        parameter = method.parameter(key)
        if parameter is None:
            known = ", ".join(sorted(p.name for p in method.parameters)) or "none"
            problems.append(f"{where}: method {name!r} has no parameter {key!r}; its parameters: {known}")
        elif row is not None and value == MATCHED and key == "lambda" and method.name == "task_arithmetic":
            problems += _matched_problems(recipe, row)
        else:
            try:  # the merge's own checks (finite, in range), now rather than after training
                check_parameter(parameter, value, f"{where}: parameters")
            except ConfigError as exc:
                problems.append(str(exc))
    if method.check is not None:  # e.g. ram_unique's agent: one of the stages
        try:
            method.check({p.name: p.default for p in method.parameters} | parameters, recipe.names, where)
        except ConfigError as exc:
            problems.append(str(exc))
    return method, problems


def _matched_problems(recipe: Recipe, row: MergeRow) -> list[str]:
    """Why ``row``'s ``lambda: matched`` (task arithmetic at RAM's L2 norm) cannot be resolved, if it cannot."""
    rows = [(r.method, r.parameters) for r in expand_merges(recipe)]
    needs = {
        "'- ram' in the recipe's merges": any(full_ram(*r) for r in rows),
        "a task_arithmetic row with a numeric lambda": any(task_arithmetic_lambda(*r) is not None for r in rows),
        "no normalize on this row": not row.parameters.get("normalize"),
    }
    where = f"merge {row.name!r}: lambda: {MATCHED} (task arithmetic at RAM's L2 norm) needs"
    return [f"{where} {need}" for need, ok in needs.items() if not ok]
