"""The merge configuration's schema: mergekit-style YAML (mergekit's field names, so a mergekit YAML runs unchanged),
validated field by field with pydantic. Nothing here knows a method by name: what a method accepts comes from its
:class:`~ram_trl.methods.MergeMethod`. Differences from mergekit: docs/methods.md."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ram_trl.errors import ConfigError
from ram_trl.io.hub import local_path, resolve_model
from ram_trl.io.lora_base import merged_model
from ram_trl.messages import did_you_mean, validation_message

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
}


class ModelEntry(BaseModel):
    """One entry of ``models``: an agent checkpoint (or the stage manifest of an RL run) and its parameters."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="Path to the agent's checkpoint directory")
    stage: str | None = Field(
        default=None, description="Path to a stage manifest (ram_stage.json, or the directory holding it)"
    )
    parameters: dict[str, Any] = Field(default_factory=dict)
    name: str | None = Field(
        default=None, description="Label for reports (default: the stage name, else the directory name)"
    )

    @model_validator(mode="after")
    def _model_or_stage(self) -> ModelEntry:
        if (self.model is None) == (self.stage is None):
            raise ValueError("give exactly one of 'model: CHECKPOINT_DIR' and 'stage: MANIFEST'")
        return self


def _empty_if_none(value: Any) -> Any:
    """mergekit's ``parameters:`` may be left empty (YAML null): no parameters."""
    return {} if value is None else value


class SliceSource(BaseModel):
    """One source of a mergekit output slice: a model and the layer range taken from it."""

    model_config = ConfigDict(extra="forbid")

    model: str
    layer_range: tuple[int, int]
    parameters: dict[str, Any] = Field(default_factory=dict)

    _no_parameters = field_validator("parameters", mode="before")(_empty_if_none)


class SliceEntry(BaseModel):
    """A mergekit output slice; ram_trl accepts one whose sources each cover every layer of their model."""

    model_config = ConfigDict(extra="forbid")

    sources: list[SliceSource] = Field(min_length=1)
    base_model: str | None = None
    residual_weight: float | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)

    _no_parameters = field_validator("parameters", mode="before")(_empty_if_none)


class ModuleEntry(BaseModel):
    """A mergekit ``modules`` entry: ``models`` or ``slices`` for one module, with its parameters."""

    model_config = ConfigDict(extra="forbid")

    models: list[ModelEntry] | None = None
    slices: list[SliceEntry] | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)

    _no_parameters = field_validator("parameters", mode="before")(_empty_if_none)

    @model_validator(mode="after")
    def _models_or_slices(self) -> ModuleEntry:
        if (self.models is None) == (self.slices is None):
            raise ValueError("give exactly one of 'models' and 'slices'")
        return self


class TokenizerEntry(BaseModel):
    """mergekit's ``tokenizer`` block."""

    model_config = ConfigDict(extra="forbid")

    source: str | None = None
    tokens: dict[str, Any] | None = None
    pad_to_multiple_of: int | None = None


class MergeConfig(BaseModel):
    """A merge config (the YAML file), before resolution against the method registry and the file system.

    Args:
        merge_method (`str`):
            Method name or alias, as ``ram-trl methods`` lists them (mergekit's ``ramplus_tl`` and others as
            aliases).
        base_model (`str`, *optional*):
            Path of the base checkpoint all agents were trained from. Optional for methods that average models
            (``linear``, as in mergekit): the first model then provides the layout, config and tokenizer.
        models (`list[ModelEntry]`, *optional*):
            The agents: ``{model: PATH}`` or ``{stage: MANIFEST}``, each with optional ``parameters`` and ``name``
            (``PATH`` may be mergekit's ``BASE+ADAPTER``: the adapter is the agent).
        slices (`list[SliceEntry]`, *optional*):
            mergekit's form of ``models``: one output slice whose sources each cover every layer of their model.
        modules (`dict[str, ModuleEntry]`, *optional*):
            mergekit's per-module form: one module, with ``models`` or one whole-model slice.
        parameters (`dict[str, Any]`, *optional*, defaults to `{}`):
            Global parameters, and defaults for per-agent parameters (the method's defaults otherwise).
        dtype (`str`, *optional*):
            mergekit's compute dtype. ram_trl always computes in float32; ``dtype`` only sets the output dtype when
            ``out_dtype`` is absent (as in mergekit).
        out_dtype (`str`, *optional*):
            Output dtype of floating tensors (default: each tensor's dtype in the base).
        tokenizer_source (`str`, *optional*):
            ``base`` (the default) or a path whose tokenizer files are copied to the output.
        tokenizer (`TokenizerEntry`, *optional*):
            mergekit's ``tokenizer`` block; its ``source`` (``base`` or a path) is ``tokenizer_source``.
        chat_template (`str`, *optional*):
            A chat template written into the output tokenizer: one of mergekit's named templates (``chatml``,
            ``llama3``, ...), or literal Jinja.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the random drops (DARE, DELLA).
        shape_mismatch (`str`, *optional*, defaults to `"error"`):
            ``error`` or ``merge_common_rows`` for resized vocabularies.
        allow_nonfinite (`bool`, *optional*, defaults to `False`):
            Merge inputs holding NaN/Inf instead of refusing them.
        name (`str`, *optional*):
            A name for the merged model's card.

    Example::

        config = MergeConfig(
            merge_method="ram_plus",
            base_model="Qwen/Qwen2.5-7B-Instruct",
            models=[{"model": "agents/coding"}, {"model": "agents/tools"}, {"stage": "runs/memory"}],
            parameters={"r": 0.1, "alpha": 2.0},
        )
        ram_trl.merge(config, "merged/")
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    merge_method: str
    base_model: str | None = None
    models: list[ModelEntry] | None = None
    slices: list[SliceEntry] | None = None
    modules: dict[str, ModuleEntry] | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    dtype: str | None = None
    out_dtype: str | None = None
    tokenizer_source: str | None = None
    tokenizer: TokenizerEntry | None = None
    chat_template: str | None = None
    seed: int = 0
    shape_mismatch: Literal["error", "merge_common_rows"] = "error"
    allow_nonfinite: bool = False
    name: str | None = None

    @field_validator("dtype", "out_dtype")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        if value is not None and value.lower() not in DTYPES:
            raise ValueError(f"unknown dtype {value!r}{did_you_mean(value, DTYPES)}; use one of {sorted(set(DTYPES))}")
        return value

    @field_validator("slices")
    @classmethod
    def _some_slices(cls, value: Any) -> Any:
        if value is not None and not value:
            raise ValueError("'slices' is empty: list at least one entry, or give 'models'")
        return value

    @field_validator("models")
    @classmethod
    def _some_models(cls, value: list[ModelEntry] | None) -> list[ModelEntry] | None:
        if value is not None and not value:
            raise ValueError("'models' is empty: list at least one agent checkpoint")
        return value

    @model_validator(mode="after")
    def _one_model_list(self) -> MergeConfig:
        given = [key for key in ("models", "slices", "modules") if getattr(self, key) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of 'models' (the agents), 'slices' or 'modules'"
                + (f"; got {' and '.join(given)}" if given else "")
            )
        return self


def load_config(source: str | os.PathLike | dict[str, Any] | MergeConfig) -> tuple[MergeConfig, Path | None]:
    """Parse a config from a YAML path, a dict, or a :class:`MergeConfig`."""
    if isinstance(source, MergeConfig):
        return source, None
    path: Path | None = None
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        from ram_trl.io.config_file import read_yaml_file

        data = read_yaml_file(path, "merge config")
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a merge config must be a YAML mapping with merge_method, base_model, models")
    where = str(path) if path else "merge config"
    try:
        return MergeConfig.model_validate(data), path
    except ValidationError as exc:
        raise ConfigError(f"{where}: {validation_message(exc, MergeConfig)}") from None


def resolve_path(value: str, config_dir: Path | None) -> Path:
    return local_path(value, config_dir)


def resolve_model_ref(value: str, config_dir: Path | None, what: str) -> Path:
    """A model reference (path or Hub id) as a directory, metadata only: Hub weights are fetched when inputs open."""
    return resolve_model(value, config_dir, what=what, weights=False)


def full_model(reference: str, config_dir: Path | None, what: str) -> Path:
    """A model reference as a full checkpoint: ``MODEL+ADAPTER`` merged as mergekit does (:func:`merged_model`)."""
    model, adapter = split_lora(reference, config_dir)
    if adapter is None:
        return resolve_model_ref(model, config_dir, what)
    paths = [resolve_model(ref, config_dir, what=what) for ref in (model, adapter)]
    for ref, path in zip((model, adapter), paths, strict=True):
        if not path.exists():
            raise ConfigError(f"{what}: {ref!r} of {reference!r} does not exist (resolved to {path})")
    return merged_model(*paths, what)


def split_lora(value: str, config_dir: Path | None) -> tuple[str, str | None]:
    """mergekit's ``MODEL+ADAPTER`` reference split into ``(MODEL, ADAPTER)`` (``ADAPTER`` ``None`` for a plain
    path, also a path that holds a ``+`` and exists)."""
    if "+" not in value or resolve_path(value, config_dir).exists():
        return value, None
    model, adapter = value.rsplit("+", 1)
    return model, adapter
