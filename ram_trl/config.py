"""Merge configuration: mergekit-style YAML, validated before any heavy work starts.

The field names of shared concepts are mergekit's (``merge_method``, ``base_model``, ``models[].model``,
``models[].parameters``, top-level ``parameters``, ``dtype``, ``out_dtype``, ``tokenizer_source``), so a mergekit
YAML for any method ``ram-trl methods`` lists runs unchanged. Nothing here knows a method by name: what a method
accepts comes from its :class:`~ram_trl.methods.MergeMethod`. Differences are listed in ``docs/methods.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ram_trl.anatomy import classify, layer_index
from ram_trl.errors import ConfigError
from ram_trl.io.fisher_files import default_fisher_path
from ram_trl.io.vocabulary import UnionRows
from ram_trl.manifest import base_model_path, check_base, manifest_path, read_manifest, verify_stage
from ram_trl.methods import MergeMethod, Parameter, method_names, resolve_method
from ram_trl.validation import check_number

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
            raise ValueError(f"unknown dtype {value!r}; use one of {sorted(set(DTYPES))}")
        return value

    @field_validator("slices")
    @classmethod
    def _some_entries(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not value:
            raise ValueError(f"'{info.field_name}' is empty: list at least one entry, or give 'models'")
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


@dataclass
class AgentSpec:
    """A resolved agent: where it is and its parameters (scalars, or mergekit filter lists)."""

    index: int
    name: str
    path: Path
    parameters: dict[str, Any]
    kind: str = "full"
    stage: dict[str, Any] | None = None


@dataclass(frozen=True)
class LayerSegment:
    """One of several consecutive mergekit output slices: the decoder layers it covers and its settings.

    Args:
        start: Its first decoder layer.
        stop: One past its last decoder layer.
        params: Its global parameter values (the slice's parameters over the module's and the top-level ones).
        agent_parameters: Each agent's parameter values in this slice, by agent index.
    """

    start: int
    stop: int
    params: dict[str, Any]
    agent_parameters: list[dict[str, Any]]


@dataclass
class ResolvedConfig:
    """A validated merge config, ready to plan.

    Args:
        method: The merge method.
        method_alias: The name the config used.
        params: Global parameter values, defaults filled in.
        agents: The agents, in config order.
        base_path: Base checkpoint path.
        out_dtype: Output dtype for floating tensors, or ``None`` for the base's dtype per tensor.
        tokenizer_source: Directory whose tokenizer files are copied.
        raw: The config as given (for the model card and report).
        source: The YAML file the config came from (an input the output must never replace).
        num_layers: The base's decoder layer count, the span of mergekit gradients (``None`` when no parameter
            is a gradient).
        chat_template: The chat template written into the output tokenizer (``None``: the source's own).
        segments: With several consecutive output slices, each slice's layers and settings (``None``: one set of
            settings, :attr:`params` and each agent's ``parameters``, for every tensor). Tensors before the decoder
            layers (embeddings) take the first slice's settings, those after them (final norm, ``lm_head``) the
            last slice's, as mergekit plans them.
        union_rows: With ``tokenizer_source: union``, the rows every model gets before the merge where some model
            lacks a token the union holds (:func:`ram_trl.io.vocabulary.pad_vocabularies`); ``None`` otherwise.
    """

    method: MergeMethod
    method_alias: str
    params: dict[str, Any]
    agents: list[AgentSpec]
    base_path: Path
    out_dtype: torch.dtype | None
    tokenizer_source: Path
    seed: int
    shape_mismatch: str
    allow_nonfinite: bool
    raw: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    source: Path | None = None
    num_layers: int | None = None
    chat_template: str | None = None
    segments: list[LayerSegment] | None = None
    union_rows: UnionRows | None = None

    def inputs(self) -> list[tuple[str, Path]]:
        """Every file and directory the merge reads, labelled for messages: the base, the tokenizer source, the
        config file, each agent, its stage manifest and its Fisher file. An output must never replace (or lie
        inside) one of them (:class:`ram_trl.output.OutputDir`).

        Returns:
            `list[tuple[str, Path]]`: ``(label, path)`` pairs, the base first.
        """
        reads: list[tuple[str, Path]] = [
            ("base model", self.base_path),
            ("tokenizer_source", self.tokenizer_source),
        ]
        if self.source is not None:
            reads.append(("merge config", self.source))
        for agent in self.agents:
            label = f"agent {agent.index} ({agent.name})"
            reads.append((label, agent.path))
            if agent.stage is not None:
                reads.append((f"stage manifest of {label}", Path(agent.stage["manifest"])))
            if self.method.needs_fisher:
                reads.append(
                    (
                        f"Fisher file of {label}",
                        Path(agent.parameters.get("fisher") or default_fisher_path(agent.path)),
                    )
                )
        return reads

    def layer_position(self, tensor_name: str) -> float:
        """mergekit's gradient position ``t`` of a tensor: ``i / (N - 1)`` for a tensor of decoder layer ``i`` of
        ``N`` (``1`` when ``N == 1``), ``0`` for every tensor outside the decoder layers (embeddings, final norm,
        ``lm_head``).

        Args:
            tensor_name (`str`): The tensor's name.

        Returns:
            `float`: ``t`` in ``[0, 1]``.
        """
        index = layer_index(tensor_name)
        segment = self.segment(tensor_name)
        if index is not None and segment is not None:
            # mergekit: the position within the tensor's own output slice
            span = segment.stop - segment.start
            return (index - segment.start) / (span - 1) if span > 1 else 1.0
        if index is None or self.num_layers is None:
            return 0.0
        return index / (self.num_layers - 1) if self.num_layers > 1 else 1.0

    def segment(self, tensor_name: str) -> LayerSegment | None:
        """The output slice whose settings a tensor takes (:attr:`segments`).

        Args:
            tensor_name (`str`): The tensor's name.

        Returns:
            `LayerSegment | None`: The slice, ``None`` without :attr:`segments`.
        """
        if not self.segments:
            return None
        index = layer_index(tensor_name)
        if index is None:
            return self.segments[0] if classify(tensor_name).module == "embedding" else self.segments[-1]
        return next((s for s in self.segments if s.start <= index < s.stop), self.segments[-1])

    def params_for(self, tensor_name: str) -> dict[str, Any]:
        """The global parameters for one tensor: mergekit filter rules and gradients (``per_tensor`` parameters)
        resolved.

        Args:
            tensor_name (`str`): The tensor's name (filters match substrings of it, gradients its layer).

        Returns:
            `dict[str, Any]`: Parameter name to value; :attr:`params` itself when no parameter is a list.
        """
        segment = self.segment(tensor_name)
        params = self.params if segment is None else segment.params
        if not any(isinstance(value, list) for value in params.values()):
            return params
        t = self.layer_position(tensor_name)
        return {
            name: evaluate_setting(value, tensor_name, t, f"parameter {name!r}")
            if isinstance(value, list)
            else value
            for name, value in params.items()
        }

    def agent_value(self, agent: AgentSpec, name: str, tensor_name: str) -> float:
        """The value of per-agent parameter ``name`` for one tensor.

        Filter lists follow mergekit: the first rule whose ``filter`` is a substring of the tensor name (or ``"*"``,
        or absent) gives the value; a rule list of a model that matches no rule falls through to the global
        setting, then to the default. Gradients are interpolated over the decoder layers
        (:meth:`layer_position`).

        Args:
            agent (`AgentSpec`): The agent.
            name (`str`): The parameter's canonical name.
            tensor_name (`str`): The tensor's name.

        Returns:
            `float`: The value.

        Raises:
            ConfigError: No rule of a filter list matches the tensor.
        """
        segment = self.segment(tensor_name)
        value = (agent.parameters if segment is None else segment.agent_parameters[agent.index])[name]
        if isinstance(value, list):
            return evaluate_setting(
                value,
                tensor_name,
                self.layer_position(tensor_name),
                f"agent {agent.name}: parameter {name!r}",
            )
        return float(value)


def interpolate(values: list[float], t: float) -> float:
    """mergekit's gradient: the piecewise-linear interpolation of ``values`` (evenly spaced over ``[0, 1]``) at
    ``t``, in the same float64 operations and order as mergekit 0.1.5.

    Args:
        values (`list[float]`): The gradient's anchor values (at least one).
        t (`float`): The position in ``[0, 1]`` (:meth:`ResolvedConfig.layer_position`).

    Returns:
        `float`: The value at ``t``.
    """
    scaled = t * (len(values) - 1)
    low = int(scaled)
    high = min(len(values) - 1, low + 1)
    frac = scaled - low
    return float((1 - frac) * values[low] + frac * values[high])


def evaluate_setting(setting: Any, tensor_name: str, t: float, what: str) -> float:
    """The value of a numeric setting for one tensor: a number, a gradient (list of numbers, :func:`interpolate`
    at ``t``), or mergekit filter rules (the first rule matching ``tensor_name``; its value a number or gradient).

    Args:
        setting (`Any`): The checked setting.
        tensor_name (`str`): The tensor's name.
        t (`float`): The tensor's gradient position.
        what (`str`): Names the setting in errors.

    Returns:
        `float`: The value.

    Raises:
        ConfigError: No rule matches the tensor.
    """
    if not isinstance(setting, list):
        return float(setting)
    if not setting or not isinstance(setting[0], dict):
        return interpolate([float(v) for v in setting], t)
    for rule in setting:
        pattern = rule.get("filter")
        if pattern is None or pattern == "*" or pattern in tensor_name:
            return evaluate_setting(rule["value"], tensor_name, t, what)
    raise ConfigError(f"{what}: no rule matches tensor {tensor_name!r}")


def _has_gradient(setting: Any) -> bool:
    """Whether a checked setting holds a gradient (at its top or in a filter rule)."""
    if not isinstance(setting, list):
        return False
    if setting and isinstance(setting[0], dict):
        return any(isinstance(rule["value"], list) for rule in setting)
    return True


def _fall_through(first: Any, then: Any) -> Any:
    """mergekit's precedence between two scopes as one setting: ``first``'s filter rules, then ``then``
    (``first`` alone when it always gives a value)."""
    if not (isinstance(first, list) and first and isinstance(first[0], dict)):
        return first
    if any(rule.get("filter") in (None, "*") for rule in first):
        return first
    rest = then if isinstance(then, list) and then and isinstance(then[0], dict) else [{"value": then}]
    return [*first, *rest]


def num_layers(path: Path) -> int | None:
    """The decoder layer count a checkpoint's ``config.json`` declares (``num_hidden_layers``, ``n_layer`` or
    ``num_layers``, also under ``text_config``), as mergekit reads it for gradients and slices.

    Args:
        path (`Path`): The checkpoint directory (or a weights file beside its ``config.json``).

    Returns:
        `int | None`: The count, or ``None`` without a config or key.
    """
    directory = path if path.is_dir() else path.parent
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for scope in (config, config.get("text_config") if isinstance(config, dict) else None):
        if isinstance(scope, dict):
            for key in ("num_hidden_layers", "n_layer", "num_layers"):
                value = scope.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def load_config(source: str | os.PathLike | dict[str, Any] | MergeConfig) -> tuple[MergeConfig, Path | None]:
    """Parse a config from a YAML path, a dict, or a :class:`MergeConfig`.

    Args:
        source (`str`, `os.PathLike`, `dict` or `MergeConfig`): The YAML file, its parsed mapping, or a config.

    Returns:
        `tuple[MergeConfig, Path | None]`: ``(config, yaml_path)``; ``yaml_path`` is ``None`` unless the config
        came from a file.

    Raises:
        ConfigError: naming the file and the field to change.
    """
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
            raise ConfigError(
                f"{path}: a merge config must be a YAML mapping with merge_method, base_model, models"
            )
    where = str(path) if path else "merge config"
    try:
        return MergeConfig.model_validate(data), path
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"{where}: {problems}") from exc


def _resolve_path(value: str, config_dir: Path | None) -> Path:
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists() or config_dir is None:
        return path
    beside = config_dir / path
    return beside if beside.exists() else path


def _resolve_stage(
    manifest_file: Path, base_path: Path, label: str, allow_external: bool = False
) -> tuple[Path, dict[str, Any]]:
    """The checkpoint a stage manifest points to, after checking it holds what the manifest describes
    (:func:`~ram_trl.manifest.verify_stage`) and was trained from ``base_path``."""
    try:
        manifest = read_manifest(manifest_file)
        checkpoint = verify_stage(manifest, manifest_file, allow_external=allow_external)
        check_base(manifest, manifest_file, base_path)
    except ConfigError as exc:
        raise ConfigError(f"{label}: {exc}") from None
    info = {
        "stage": manifest.stage,
        "domain": manifest.domain,
        "manifest": str(manifest_path(manifest_file)),
        "trainer": manifest.trainer,
        "steps": manifest.steps,
        "kind": manifest.kind,
        "save_dtype": manifest.save_dtype,
        "base_model": str(base_model_path(manifest, manifest_file) or manifest.base_model),
        # non-finite values (a hand-edited or diverged manifest) are left out: the report is strict JSON
        "rewards": {k: v for k, v in manifest.rewards.items() if math.isfinite(v)},
        "telemetry": {k: v for k, v in manifest.telemetry.items() if math.isfinite(v)},
    }
    return checkpoint, info


def _check_value(parameter: Parameter, value: Any, where: str) -> Any:
    if parameter.kind is Path:
        if not isinstance(value, str | os.PathLike) or not str(value):
            raise ConfigError(f"{where}: parameter {parameter.name!r} must be a path, got {value!r}")
        return str(value)
    if parameter.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: parameter {parameter.name!r} must be true or false, got {value!r}")
        return value
    if parameter.kind is str:
        if not isinstance(value, str) or (parameter.choices and value not in parameter.choices):
            raise ConfigError(
                f"{where}: parameter {parameter.name!r} must be one of {list(parameter.choices)}, got {value!r}"
            )
        return value
    if parameter.kind is float and isinstance(value, str):
        # mergekit reads numbers written as strings ("0.5", YAML's unquoted 1e-3) as numbers
        with contextlib.suppress(ValueError):
            value = float(value)
    return check_number(
        value,
        where,
        f"parameter {parameter.name!r}",
        minimum=parameter.minimum,
        maximum=parameter.maximum,
    )


_RULES_HELP = "[{filter: SUBSTRING, value: X}, ..., {value: DEFAULT}]"


def _check_gradient(parameter: Parameter, value: list[Any], where: str) -> list[float]:
    """A mergekit gradient: a non-empty list of numbers, each checked like the parameter's scalar."""
    if parameter.kind is not float:
        raise ConfigError(
            f"{where}: parameter {parameter.name!r} takes one value, got the list {value!r} (gradients are lists of "
            "numbers, for numeric parameters)"
        )
    if not value:
        raise ConfigError(
            f"{where}: parameter {parameter.name!r}: a gradient needs at least one number, got []"
        )
    return [
        _check_value(parameter, item, f"{where}: parameter {parameter.name!r} gradient") for item in value
    ]


def _check_agent_value(parameter: Parameter, value: Any, where: str) -> Any:
    if isinstance(value, dict) and parameter.kind is not Path:
        value = [value]  # mergekit: one conditional parameter is a one-rule list
    if isinstance(value, list) and parameter.kind is not Path:
        if value and not any(isinstance(item, dict) for item in value):
            return _check_gradient(parameter, value, where)
        if not value or not all(isinstance(rule, dict) and "value" in rule for rule in value):
            raise ConfigError(
                f"{where}: parameter {parameter.name!r}: a list must be a gradient (numbers interpolated over the "
                f"layers) or mergekit filter rules {_RULES_HELP}, got {value!r}"
            )
        rules = []
        for rule in value:
            extra = set(rule) - {"filter", "value"}
            if extra:
                raise ConfigError(
                    f"{where}: parameter {parameter.name!r}: unknown keys {sorted(extra)} in a filter rule"
                )
            if rule.get("filter") is not None and not isinstance(rule["filter"], str):
                raise ConfigError(
                    f"{where}: parameter {parameter.name!r}: a rule's filter must be a substring of tensor names, "
                    f"got {rule['filter']!r}"
                )
            if isinstance(rule["value"], list):
                checked = dict(rule, value=_check_gradient(parameter, rule["value"], where))
            else:
                _check_value(parameter, rule["value"], where)
                checked = rule
            rules.append(checked)
        return rules if rules != value else value
    return _check_value(parameter, value, where)


def _check_global_value(parameter: Parameter, value: Any, where: str, method: MergeMethod) -> Any:
    """A global parameter's value: filter rules and gradients for ``per_tensor`` parameters, one value otherwise."""
    if parameter.per_tensor:
        return _check_agent_value(parameter, value, where)
    if isinstance(value, list | dict):
        raise ConfigError(
            f"{where}: parameter {parameter.name!r} takes one value for the whole merge ({method.name} uses it "
            f"once, not per tensor), got {value!r}; gradients and filter rules apply to: "
            f"{', '.join(p.name for p in method.parameters if _per_tensor(p)) or 'none of its parameters'}"
        )
    return _check_value(parameter, value, where)


def _per_tensor(parameter: Parameter) -> bool:
    return parameter.kind is float and (parameter.scope == "agent" or parameter.per_tensor)


def check_parameter(parameter: Parameter, value: Any, where: str) -> Any:
    """Check one value of a method parameter (global or per-agent, filter rules included) as a merge does: type,
    finite, in range. Used by :func:`resolve_config` and by recipes before any training.

    Args:
        parameter (`Parameter`): The method's declaration of the parameter.
        value (`Any`): The value as the config gives it (a scalar, or a list of mergekit filter rules).
        where (`str`): What names the value in errors (the config file and the entry).

    Returns:
        `Any`: The value converted to the parameter's type (filter rules with their values checked).

    Raises:
        ConfigError: naming ``where`` and the parameter.
    """
    if parameter.scope == "global" and not parameter.per_tensor:
        return _check_value(parameter, value, where)
    return _check_agent_value(parameter, value, where)


def _model_chat_template(path: Path) -> str | None:
    """A checkpoint's chat template (``chat_template.jinja``, else its ``tokenizer_config.json`` entry)."""
    directory = path if path.is_dir() else path.parent
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    try:
        template = json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):  # transformers' named templates: [{name, template}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


def resolve_chat_template(value: str, models: list[Path], where: str) -> str:
    """The template text of a config's ``chat_template``, as mergekit 0.1.5 picks it: ``auto`` (the most common
    template among the input models), one of mergekit's named templates (read from the installed mergekit
    package), or literal Jinja.

    Args:
        value (`str`): The config's ``chat_template``.
        models (`list[Path]`): The base and the agents, in config order (for ``auto``).
        where (`str`): Names the field in errors.

    Returns:
        `str`: The template.

    Raises:
        ConfigError: ``auto`` without any template among the models, an unknown name, or text that is no
            template.
    """
    from ram_trl.io.chat_template import check_chat_template

    if value == "auto":
        found = [(t.strip(), p) for p, t in ((p, _model_chat_template(p)) for p in models) if t]
        if not found:
            raise ConfigError(f"{where}: 'auto' found no chat template in the base or the agents")
        chosen = Counter(t for t, _ in found).most_common(1)[0][0]
        return check_chat_template(chosen, f"'auto' ({next(p for t, p in found if t == chosen)})", where)
    if len(value) < 256 and "\n" not in value and "{" not in value:
        try:
            from importlib.resources import files

            named = files("mergekit._data.chat_templates").joinpath(value + ".jinja")
            if named.is_file():
                return check_chat_template(named.read_text(), f"mergekit's {value!r}", where)
        except ModuleNotFoundError:
            raise ConfigError(
                f"{where}: {value!r} names one of mergekit's templates, which are read from the mergekit package: "
                "install it (pip install mergekit) or give the Jinja text"
            ) from None
    if len(value) < 20 or "{" not in value:
        raise ConfigError(f"{where}: {value!r} is neither a known template name nor a Jinja template")
    return check_chat_template(value, "the config's text", where)


def _vocabulary(path: Path) -> dict[str, int] | None:
    """Token to id of a checkpoint's tokenizer (``tokenizer.json``: its model's vocabulary and its added tokens),
    ``None`` without one that can be read."""
    directory = path if path.is_dir() else path.parent
    try:
        data = json.loads((directory / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        if isinstance(vocab, dict):  # BPE, WordLevel, WordPiece
            ids = {str(token): int(i) for token, i in vocab.items()}
        else:  # Unigram: [[token, score], ...] in id order
            ids = {str(entry[0]): i for i, entry in enumerate(vocab)}
        for added in data.get("added_tokens") or []:
            ids[str(added["content"])] = int(added["id"])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    return ids


def _shares_numbering(tokenizer_source: Path, models: list[Path]) -> bool:
    """Whether every model's tokenizer gives each token of ``tokenizer_source``'s the same id, all within the
    first model's (the base's) ``vocab_size`` rows (mergekit's re-indexing of embedding rows is then the identity on
    the rows the output keeps)."""
    output, rows = _vocabulary(tokenizer_source), _rows(models[0])
    if output is None or rows is None or max(output.values(), default=0) >= rows:
        return False  # the tokenizer has tokens past the base's rows: mergekit would add rows for them
    for model in models:
        vocab = _vocabulary(model)
        if vocab is None or any(vocab.get(token) != i for token, i in output.items()):
            return False
    return True


def _rows(path: Path) -> int | None:
    """The ``vocab_size`` a checkpoint's ``config.json`` declares (its embedding rows)."""
    directory = path if path.is_dir() else path.parent
    try:
        rows = json.loads((directory / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return rows if isinstance(rows, int) and not isinstance(rows, bool) else None


def _union_donor(models: list[Path]) -> tuple[Path | None, str]:
    """mergekit's ``tokenizer_source: union`` where it needs no re-indexing: ``(the model whose tokenizer holds
    exactly the union of every model's used tokens (those with an embedding row), "")`` when all models number the
    tokens alike and the union's ids run from 0 without holes; otherwise ``(None, why)``, ``why`` naming the first
    model, token or id that needs re-indexing."""
    union: dict[str, int] = {}
    holder: dict[str, Path] = {}
    used_by: list[tuple[Path, dict[str, int], dict[str, int]]] = []
    for model in models:
        vocab, rows = _vocabulary(model), _rows(model)
        if vocab is None or rows is None:
            missing = "readable tokenizer.json" if vocab is None else "config.json with vocab_size"
            return None, f"{model} has no {missing}"
        used = {token: i for token, i in vocab.items() if i < rows}
        for token, i in used.items():
            if union.setdefault(token, i) != i:
                return None, (
                    f"token {token!r} is id {union[token]} in {holder[token]} and id {i} in {model} (the union "
                    "numbers it once: every other model's rows would move)"
                )
            holder.setdefault(token, model)
        used_by.append((model, vocab, used))
    ids = Counter(union.values())
    shared = next((i for i, n in ids.items() if n > 1), None)
    if shared is not None:
        tokens = sorted(t for t, i in union.items() if i == shared)
        return None, (
            f"id {shared} is {' and '.join(repr(t) for t in tokens[:2])} in different models (the union appends one "
            "of them after the others)"
        )
    hole = next((i for i in range(len(union)) if i not in ids), None)
    if hole is not None:
        return None, f"no model has a token with id {hole} below the union's {len(union)} tokens"
    donor = next((model for model, vocab, used in used_by if vocab == used == union), None)
    if donor is None:
        return None, "no model's tokenizer is exactly the union (each model adds tokens the others lack)"
    return donor, ""


def _check_rule(rule: Any, label: str) -> None:
    """One ``tokenizer.tokens`` rule's shape: ``{source: ..., force: BOOL}``."""
    if not isinstance(rule, dict) or set(rule) - {"source", "force"}:
        raise ConfigError(f"{label}: a rule is {{source: MODEL, force: BOOL}}, got {rule!r}")


def _check_token_rules(rules: dict[str, Any], tokenizer_source: Path, models: list[Path], where: str) -> None:
    """mergekit's ``tokenizer.tokens`` rules, accepted where mergekit never applies them: a rule without ``force``
    for a token that every model (the base included) and the output tokenizer hold with one id, inside every model's
    embedding rows (mergekit builds a row from a rule only for a token some model lacks, or a forced one)."""
    vocabularies = {model: (_vocabulary(model), _rows(model)) for model in [tokenizer_source, *models]}
    for token, rule in rules.items():
        label = f"{where}: tokenizer.tokens[{token!r}]"
        _check_rule(rule, label)
        if rule.get("force"):
            raise ConfigError(
                f"{label}: force replaces the token's row in every model by {rule.get('source')!r}'s before merging; "
                "rules that build rows are supported with tokenizer source 'union' only"
            )
        ids = {}
        for model, (vocab, rows) in vocabularies.items():
            i = None if vocab is None else vocab.get(token)
            if i is None or (rows is not None and i >= rows):
                raise ConfigError(
                    f"{label}: {model} has no row for the token, so mergekit would build it from the rule "
                    f"({rule.get('source')!r}) or add it; rules that build rows are supported with tokenizer source "
                    "'union' only"
                )
            ids[model] = i
        if len(set(ids.values())) > 1:
            raise ConfigError(
                f"{label}: the models number the token differently ({', '.join(f'{m}: {i}' for m, i in ids.items())})"
                "; re-numbered rows are not implemented"
            )


def _token_sources(
    rules: dict[str, Any],
    union: UnionRows,
    donor: Path,
    models: list[Path],
    where: str,
    config_dir: Path | None,
) -> tuple[dict[int, tuple], frozenset[int]]:
    """mergekit's ``tokenizer.tokens`` rules over a union: ``(sources, forced)`` of :class:`UnionRows` for the
    rules mergekit applies (a forced one, or one for a token some model lacks); the others change nothing."""
    vocab = _vocabulary(donor) or {}
    sources: dict[int, tuple] = {}
    forced: set[int] = set()
    for token, rule in rules.items():
        label = f"{where}: tokenizer.tokens[{token!r}]"
        _check_rule(rule, label)
        token_id = vocab.get(token)
        if token_id is None or token_id >= union.rows:
            raise ConfigError(
                f"{label}: no model has the token, so mergekit would add it to the tokenizer with a new row; adding "
                "tokens is not implemented"
            )
        if not rule.get("force") and token_id not in union.holders:
            continue  # every model has it: mergekit keeps each model's own row
        source = rule.get("source")
        if isinstance(source, dict) and source.get("kind") == "zero" and set(source) == {"kind"}:
            sources[token_id] = ("zero",)
        elif isinstance(source, dict) and source.get("kind") == "model_token":
            if set(source) - {"kind", "model", "token", "token_id"} or ("token" in source) == (
                "token_id" in source
            ):
                raise ConfigError(
                    f"{label}: a model_token source takes model and one of token, token_id; got {source}"
                )
            position = _model_position(source.get("model"), models, label, config_dir)
            row = source.get("token_id")
            if row is None:
                row = (_vocabulary(models[position]) or {}).get(source["token"])
            rows = _rows(models[position])
            if not isinstance(row, int) or row < 0 or (rows is not None and row >= rows):
                raise ConfigError(f"{label}: {models[position]} has no row for {source}")
            sources[token_id] = ("model", position, row)
        elif isinstance(source, str):
            position = _model_position(source, models, label, config_dir)
            if token_id in union.holders and position not in union.holders[token_id]:
                raise ConfigError(f"{label}: its source {source!r} lacks the token")
            sources[token_id] = ("model", position, token_id)
        else:
            raise ConfigError(
                f"{label}: mergekit builds this token's row from the rule's source, which must be a model of the "
                f"merge, {{kind: zero}} or {{kind: model_token, model: M, token: T}}; got {source!r}"
            )
        if rule.get("force"):
            forced.add(token_id)
    return sources, frozenset(forced)


def _model_position(reference: Any, models: list[Path], label: str, config_dir: Path | None) -> int:
    """The position (0: the base, ``t + 1``: agent ``t``) of the model a token rule names."""
    if isinstance(reference, str):
        path = _resolve_path(reference, config_dir).resolve()
        for position, model in enumerate(models):
            if model.resolve() == path:
                return position
    raise ConfigError(f"{label}: the source {reference!r} is not the base or one of the models merged")


def _padded_rows(config: MergeConfig, rows: int) -> int | None:
    """The row count mergekit's ``tokenizer.pad_to_multiple_of`` pads ``rows`` to (``None``: no padding)."""
    multiple = config.tokenizer.pad_to_multiple_of if config.tokenizer is not None else None
    if not multiple or rows % multiple == 0:
        return None  # mergekit pads only a count that is not a multiple
    return -(-rows // multiple) * multiple


def _union_rows(models: list[Path], dtype: str | None, size: int | None = None) -> UnionRows:
    """The union's rows (models numbering their tokens alike, :func:`_union_donor`): its size (the highest used id
    plus one, unless ``size`` gives it) and, for each token some model (the base first) lacks, the models that have
    it."""
    used = []
    for model in models:
        vocab, rows = _vocabulary(model) or {}, _rows(model)
        used.append({i for i in vocab.values() if rows is None or i < rows})
    if size is None:
        size = max((max(ids, default=-1) for ids in used), default=-1) + 1
    holders = {
        token: tuple(k for k, ids in enumerate(used) if token in ids)
        for token in range(size)
        if any(token not in ids for ids in used)
    }
    return UnionRows(size, holders, DTYPES[dtype.lower()] if dtype else None)


_REFUSED_METHODS = {
    "passthrough": "copies (and stacks) layers of one model without merging; ram_trl merges whole models tensor by "
    "tensor and writes no layer stacks",
    "nuslerp": "not implemented",
    "multislerp": "not implemented",
    "karcher": "not implemented",
    "arcee_fusion": "not implemented",
    "nearswap": "not implemented",
}


def _split_lora(value: str, config_dir: Path | None) -> tuple[str, str | None]:
    """mergekit's ``MODEL+ADAPTER`` reference split into ``(MODEL, ADAPTER)`` (``ADAPTER`` ``None`` for a plain
    path, also a path that holds a ``+`` and exists)."""
    if "+" not in value or _resolve_path(value, config_dir).exists():
        return value, None
    model, adapter = value.rsplit("+", 1)
    return model, adapter


#: Several consecutive output slices: per slice, ``(layer range, the slice's parameters, each source's parameters)``.
_SliceSettings = list[tuple[tuple[int, int], dict[str, Any], list[dict[str, Any]]]]


def _slice_entries(
    slices: list[SliceEntry], where: str, label: str
) -> tuple[
    list[ModelEntry],
    dict[str, Any],
    str | None,
    list[tuple[str, str, tuple[int, int]]],
    _SliceSettings | None,
]:
    """Output slices as ``models`` entries: ``(entries, the first slice's parameters, the slice base_model, layer
    ranges that must each cover a whole model, the settings of each slice when there are several)``. Several slices
    must take the same models in the same order, each source of a slice the same layers, the slices following each
    other from layer 0 (mergekit's plan of consecutive slices, each with its own parameters); anything else
    (stacking, mixing or skipping layers) is refused."""
    for k, out_slice in enumerate(slices):
        if out_slice.residual_weight is not None:
            raise ConfigError(f"{where}: {label}[{k}].residual_weight is not supported")
    first = slices[0]
    entries = [ModelEntry(model=source.model, parameters=source.parameters) for source in first.sources]
    if len(slices) == 1:
        ranges = [
            (f"{label}[0].sources[{i}]", source.model, source.layer_range)
            for i, source in enumerate(first.sources)
        ]
        return entries, first.parameters, first.base_model, ranges, None
    frankenmerge = (
        "stacking, mixing or skipping layer ranges (a frankenmerge) is not supported; ram_trl merges whole "
        "models: consecutive slices must take the same models, in the same order, over consecutive layer ranges"
    )
    models = [source.model for source in first.sources]
    settings: _SliceSettings = []
    stop = 0
    for k, out_slice in enumerate(slices):
        theirs = [source.model for source in out_slice.sources]
        if theirs != models:
            raise ConfigError(
                f"{where}: {label}[{k}] takes the models {theirs}, {label}[0] {models}: {frankenmerge}"
            )
        if out_slice.base_model != first.base_model:
            raise ConfigError(
                f"{where}: {label}[{k}].base_model {out_slice.base_model!r} differs from {label}[0]'s "
                f"{first.base_model!r}: {frankenmerge}"
            )
        layer_range = out_slice.sources[0].layer_range
        for i, source in enumerate(out_slice.sources):
            if source.layer_range != layer_range:
                raise ConfigError(
                    f"{where}: {label}[{k}].sources[{i}] ({source.model}) takes layer_range "
                    f"{list(source.layer_range)}, {label}[{k}].sources[0] {list(layer_range)}: {frankenmerge}"
                )
        if layer_range[0] != stop or layer_range[1] <= layer_range[0]:
            raise ConfigError(
                f"{where}: {label}[{k}] takes layer_range {list(layer_range)} after layer {stop}: {frankenmerge}"
            )
        stop = layer_range[1]
        settings.append(
            (layer_range, out_slice.parameters, [source.parameters for source in out_slice.sources])
        )
    ranges = [(f"{label}[*].sources[{i}]", model, (0, stop)) for i, model in enumerate(models)]
    return entries, first.parameters, first.base_model, ranges, settings


def _entries(
    config: MergeConfig, where: str
) -> tuple[
    list[ModelEntry],
    list[dict[str, Any]],
    str | None,
    list[tuple[str, str, tuple[int, int]]],
    _SliceSettings | None,
]:
    """The config's models as ``models`` entries, whichever of ``models``, ``slices`` and ``modules`` gives them:
    ``(entries, parameter scopes above the global one (highest first), a slice's base_model, layer ranges that
    must each cover a whole model, the settings of each of several slices)``."""
    if config.models is not None:
        return config.models, [], None, [], None
    if config.slices is not None:
        entries, params, base, ranges, settings = _slice_entries(config.slices, where, "slices")
        return entries, [params], base, ranges, settings
    assert config.modules is not None
    if len(config.modules) != 1:
        raise ConfigError(
            f"{where}: modules lists {len(config.modules)} modules ({', '.join(config.modules)}); ram_trl merges "
            "models with one module (a decoder): give 'models:' or one module"
        )
    ((name, module),) = config.modules.items()
    if module.models is not None:
        return module.models, [module.parameters], None, [], None
    assert module.slices is not None
    entries, params, base, ranges, settings = _slice_entries(module.slices, where, f"modules.{name}.slices")
    return entries, [params, module.parameters], base, ranges, settings


def _check_layer_ranges(
    ranges: list[tuple[str, str, tuple[int, int]]], config_dir: Path | None, where: str
) -> None:
    """Each slice source must cover every layer of its model, ``[0, N)`` (mergekit's ``models:`` equivalent)."""
    for label, model, (start, stop) in ranges:
        path = _resolve_path(_split_lora(model, config_dir)[0], config_dir)
        layers = num_layers(path)
        if layers is None:
            raise ConfigError(
                f"{where}: {label} ({model}): cannot check layer_range {[start, stop]}: {path} has no config.json "
                "with num_hidden_layers"
            )
        if (start, stop) != (0, layers):
            raise ConfigError(
                f"{where}: {label} ({model}): layer_range {[start, stop]} is not the whole model ({layers} layers): "
                f"stacking or mixing layer ranges (a frankenmerge) is not supported; give [0, {layers}] or use "
                "'models:'"
            )


def _check_scope(
    method: MergeMethod, scope: dict[str, Any], where: str, label: str, ignored: dict[str, list[str]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One scope of shared parameters (the top-level ``parameters``, a slice's, a module's), checked:
    ``(global parameters, defaults of per-agent parameters)`` by canonical name; names the method does not use are
    added to ``ignored`` (under ``label``), as mergekit ignores them."""
    params: dict[str, Any] = {}
    agent_defaults: dict[str, Any] = {}
    for key, value in scope.items():
        parameter = method.parameter(key)
        if parameter is None:
            ignored.setdefault(key, []).append(label)
        elif parameter.scope == "global":
            params[parameter.name] = _check_global_value(parameter, value, where, method)
        else:
            agent_defaults[parameter.name] = _check_agent_value(parameter, value, where)
    return params, agent_defaults


def _chain(settings: list[dict[str, Any]]) -> dict[str, Any]:
    """Settings of several scopes (highest precedence first) as one, with mergekit's fall-through."""
    merged: dict[str, Any] = {}
    for scope in reversed(settings):
        for name, value in scope.items():
            merged[name] = _fall_through(value, merged[name]) if name in merged else value
    return merged


def _shared_settings(
    method: MergeMethod,
    alias_defaults: dict[str, Any],
    scopes: list[dict[str, Any]],
    names: list[str],
    where: str,
    ignored: dict[str, list[str]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The scopes of shared parameters (highest precedence first, the top-level ``parameters`` last), checked and
    chained: ``(global parameters with defaults filled in, defaults of per-agent parameters)``."""
    checked = [
        _check_scope(method, scope, f"{where}: {name}", name, ignored)
        for scope, name in zip(scopes, names, strict=True)
    ]
    params = _chain([c[0] for c in checked])
    agent_defaults = _chain([c[1] for c in checked])
    for parameter in method.parameters:
        default = alias_defaults.get(parameter.name, parameter.default)
        if parameter.scope == "global":
            params[parameter.name] = (
                _fall_through(params[parameter.name], default) if parameter.name in params else default
            )
    return params, agent_defaults


def _agent_settings(
    method: MergeMethod,
    alias_defaults: dict[str, Any],
    own_settings: dict[str, Any],
    agent_defaults: dict[str, Any],
    label: str,
    place: str,
    ignored: dict[str, list[str]],
    config_dir: Path | None,
) -> tuple[dict[str, Any], bool]:
    """One model's parameters, checked and chained over the shared defaults: ``(values, whether one is a
    gradient)``; names the method does not use are added to ``ignored`` under ``place``."""
    own: dict[str, Any] = {}
    gradient = False
    for key, value in own_settings.items():
        parameter = method.parameter(key)
        if parameter is None:
            ignored.setdefault(key, []).append(place)
            continue
        if parameter.scope == "global":
            raise ConfigError(
                f"{label}: {key!r} is a global parameter: put it under the top-level 'parameters'"
            )
        own[parameter.name] = _check_agent_value(parameter, value, label)
        gradient = gradient or _has_gradient(own[parameter.name])
    values = _chain([own, agent_defaults])
    for parameter in method.parameters:
        if parameter.scope != "agent":
            continue
        default = alias_defaults.get(parameter.name, parameter.default)
        values[parameter.name] = (
            _fall_through(values[parameter.name], default) if parameter.name in values else default
        )
        if parameter.kind is Path and values[parameter.name]:
            values[parameter.name] = str(_resolve_path(values[parameter.name], config_dir))
    return values, gradient


def _segments(
    method: MergeMethod,
    alias_defaults: dict[str, Any],
    slice_settings: _SliceSettings,
    module_scopes: list[dict[str, Any]],
    config: MergeConfig,
    positions: list[int],
    label: str,
    where: str,
    ignored: dict[str, list[str]],
    config_dir: Path | None,
) -> tuple[list[LayerSegment], bool]:
    """Each of several consecutive slices' settings (mergekit's precedence: the source's, the slice's, the
    module's, the top-level parameters), with a check that what applies to the whole merge at once (a global
    parameter that is not per tensor, a per-agent switch or path) is the same in every slice: ``(segments,
    whether a setting is a gradient)``."""
    segments: list[LayerSegment] = []
    gradient = False
    resolved_first = ignored
    for k, ((start, stop), slice_params, source_params) in enumerate(slice_settings):
        # the first slice's unused names are already listed (as the models' and the slice's)
        ignored = {} if k == 0 else resolved_first
        params, agent_defaults = _shared_settings(
            method,
            alias_defaults,
            [slice_params, *module_scopes, config.parameters],
            [f"{label}[{k}].parameters", *(["module parameters"][: len(module_scopes)]), "parameters"],
            where,
            ignored,
        )
        gradient = gradient or any(_has_gradient(v) for v in [*params.values(), *agent_defaults.values()])
        per_agent = []
        for position in positions:
            place = f"{label}[{k}].sources[{position}]"
            values, own_gradient = _agent_settings(
                method,
                alias_defaults,
                source_params[position],
                agent_defaults,
                f"{where}: {place}",
                place,
                ignored,
                config_dir,
            )
            gradient = gradient or own_gradient
            per_agent.append(values)
        segments.append(LayerSegment(start, stop, params, per_agent))
    first = segments[0]
    for parameter in method.parameters:
        if _per_tensor(parameter):
            continue
        for k, segment in enumerate(segments[1:], start=1):
            if parameter.scope == "global":
                differs = segment.params[parameter.name] != first.params[parameter.name]
            else:
                differs = any(
                    mine[parameter.name] != theirs[parameter.name]
                    for mine, theirs in zip(segment.agent_parameters, first.agent_parameters, strict=True)
                )
            if differs:
                raise ConfigError(
                    f"{where}: {label}[{k}] and {label}[0] give {parameter.name!r} different values; {method.name} "
                    f"applies {parameter.name!r} to the whole merge at once, not per layer range"
                )
    return segments, gradient


def resolve_config(
    config: MergeConfig, config_path: Path | None = None, *, allow_external_shards: bool = False
) -> ResolvedConfig:
    """Check a config against the method registry and the file system (paths only; tensors come later).

    Args:
        config: The parsed config.
        config_path: The YAML file it came from; relative paths that do not exist from the working directory are
            looked up beside it.
        allow_external_shards: Accept a stage manifest whose ``checkpoint`` lies outside its directory.

    Returns:
        The :class:`ResolvedConfig`.

    Raises:
        ConfigError: for an unknown method, unknown or out-of-range parameters, or missing paths.
    """
    where = str(config_path) if config_path else "merge config"
    try:
        method, alias_defaults = resolve_method(config.merge_method)
    except KeyError:
        refused = _REFUSED_METHODS.get(config.merge_method.strip().lower())
        if refused:
            raise ConfigError(
                f"{where}: merge_method {config.merge_method!r} is not supported: {refused}"
            ) from None
        raise ConfigError(
            f"{where}: unknown merge_method {config.merge_method!r}; available: {', '.join(method_names())} "
            "(mergekit names ramplus_tl, ramplus, average are accepted as aliases)"
        ) from None
    config_dir = config_path.parent if config_path else None
    entries, scopes, slice_base, ranges, slice_settings = _entries(config, where)
    base_model = config.base_model
    if slice_base is not None and base_model is not None and slice_base != base_model:
        raise ConfigError(
            f"{where}: the slice's base_model {slice_base!r} differs from base_model {base_model!r}"
        )
    base_model = base_model or slice_base
    if base_model is None:
        first = entries[0]
        if not method.keeps_base_entries or first.model is None:
            raise ConfigError(
                f"{where}: base_model is missing; {method.name} needs the base all agents were trained from "
                "(only a plain weighted average of models, such as linear, can take its layout from the first model)"
            )
        base_model = first.model
    if _split_lora(base_model, config_dir)[1] is not None:
        raise ConfigError(
            f"{where}: base_model {base_model!r} is a MODEL+ADAPTER reference; the base must be a full checkpoint "
            "(merge the adapter into it first)"
        )
    base_path = _resolve_path(base_model, config_dir)
    if not base_path.exists():
        raise ConfigError(f"{where}: base_model {base_model!r} does not exist (resolved to {base_path})")
    _check_layer_ranges(ranges, config_dir, where)

    ignored: dict[str, list[str]] = {}
    scope_names = [*(["slice parameters", "module parameters"][: len(scopes)]), "parameters"]
    params, agent_defaults = _shared_settings(
        method, alias_defaults, [*scopes, config.parameters], scope_names, where, ignored
    )
    gradient = any(_has_gradient(v) for v in [*params.values(), *agent_defaults.values()])

    agents: list[AgentSpec] = []
    positions: list[int] = []
    notes: list[str] = []
    for position, entry in enumerate(entries):
        stage_info: dict[str, Any] | None = None
        if entry.stage is not None:
            label = f"{where}: models[{position}] (stage {entry.stage})"
            path, stage_info = _resolve_stage(
                _resolve_path(entry.stage, config_dir), base_path, label, allow_external_shards
            )
        else:
            label = f"{where}: models[{position}] ({entry.model})"
            model, adapter = _split_lora(entry.model, config_dir)
            path = _resolve_path(model, config_dir)
            if adapter is not None:
                if not path.exists() or path.resolve() != base_path.resolve():
                    raise ConfigError(
                        f"{label}: the adapter {adapter!r} is applied to {model!r}, not to base_model "
                        f"{base_model!r}; ram_trl merges adapters of the base only"
                    )
                path = _resolve_path(adapter, config_dir)
        if not path.exists():
            raise ConfigError(f"{label}: agent checkpoint does not exist (resolved to {path})")
        if not method.keeps_base_entries and path.resolve() == base_path.resolve():
            notes.append(f"models[{position}] is the base model; it has no task vector and is left out")
            continue
        values, own_gradient = _agent_settings(
            method,
            alias_defaults,
            entry.parameters,
            agent_defaults,
            label,
            f"models[{position}]",
            ignored,
            config_dir,
        )
        gradient = gradient or own_gradient
        name = entry.name or (stage_info["stage"] if stage_info else path.name)
        agents.append(AgentSpec(index=len(agents), name=name, path=path, parameters=values, stage=stage_info))
        positions.append(position)
    segments = None
    if slice_settings is not None:
        segments, slice_gradient = _segments(
            method,
            alias_defaults,
            slice_settings,
            scopes[1:],
            config,
            positions,
            "slices" if config.slices is not None else f"modules.{next(iter(config.modules or {}))}.slices",
            where,
            ignored,
            config_dir,
        )
        gradient = gradient or slice_gradient
        notes.append(
            f"{len(segments)} consecutive output slices (layers "
            + ", ".join(f"{s.start}-{s.stop - 1}" for s in segments)
            + "), each with its own parameters; the report lists the first slice's"
        )
    if ignored:
        message = (
            f"{where}: {method.name} does not use the parameter(s) "
            + ", ".join(f"{key!r} ({', '.join(dict.fromkeys(places))})" for key, places in ignored.items())
            + f"; ignored, as mergekit does ({method.name} takes "
            + (", ".join(p.name for p in method.parameters) or "no parameter")
            + ")"
        )
        notes.append(message)
        warnings.warn(message, stacklevel=2)
    if not agents:
        raise ConfigError(f"{where}: no agent left to merge (every entry of 'models' is the base model)")
    fewest, most = method.agents
    if len(agents) < fewest or (most is not None and len(agents) > most):
        wanted = (
            f"exactly {fewest}"
            if fewest == most
            else f"at least {fewest}"
            if most is None
            else f"{fewest} to {most}"
        )
        raise ConfigError(
            f"{where}: {method.name} merges {wanted} model(s) besides base_model; 'models' lists {len(agents)} "
            f"({', '.join(a.name for a in agents)})"
        )
    names = [a.name for a in agents]
    if len(set(names)) != len(names):
        for agent in agents:
            agent.name = f"{agent.index}:{agent.name}"

    out_name = config.out_dtype or config.dtype
    out_dtype = DTYPES[out_name.lower()] if out_name else None
    tokenizer_name = config.tokenizer_source
    if config.tokenizer is not None:
        block = config.tokenizer
        if tokenizer_name is not None:
            raise ConfigError(f"{where}: give tokenizer_source or the tokenizer block, not both")
        # mergekit's tokenizer block defaults to the union; without tokens or padding, ram_trl keeps its earlier
        # default
        tokenizer_name = block.source or ("union" if block.tokens or block.pad_to_multiple_of else None)
        if block.pad_to_multiple_of is not None and (
            block.pad_to_multiple_of < 1 or tokenizer_name not in ("union", "base")
        ):
            raise ConfigError(
                f"{where}: tokenizer.pad_to_multiple_of {block.pad_to_multiple_of} is supported with source 'union' "
                "or 'base' only, as a positive number of rows"
            )
    tokenizer_source = base_path
    union = False
    union_rows: UnionRows | None = None
    if tokenizer_name == "union":
        donor, why = _union_donor([base_path, *(a.path for a in agents)])
        if config.shape_mismatch != "error":
            why = f"shape_mismatch: {config.shape_mismatch} would keep rows the union re-indexes"
        if donor is None or why:
            raise ConfigError(
                f"{where}: tokenizer source 'union' is supported only where it re-indexes nothing (every model's "
                f"tokenizer.json numbers the tokens alike and one model's tokenizer holds them all), here {why}: "
                "re-numbered rows are not implemented (mergekit 0.1.5 numbers the tokens different models add in "
                "the order of a Python set of the models, which PYTHONHASHSEED changes from run to run); use base or "
                "a model path"
            )
        models = [base_path, *(a.path for a in agents)]
        union_rows = _union_rows(models, config.dtype)
        rules = config.tokenizer.tokens if config.tokenizer is not None and config.tokenizer.tokens else {}
        sources, forced = _token_sources(rules, union_rows, donor, models, where, config_dir)
        padded = _padded_rows(config, union_rows.rows)
        union_rows = dataclasses.replace(union_rows, sources=sources, forced=forced, padded_rows=padded)
        shared = any(len(h) > 1 and 0 not in h for h in union_rows.holders.values())
        if padded or forced or sources or (union_rows.holders and (method.prepares_tensors or shared)):
            # rows some model lacks enter the method's whole-tensor step, or are merged from several models' rows:
            # every model gets mergekit's rows before the merge (ram_trl.io.vocabulary)
            if method.needs_fisher:
                raise ConfigError(
                    f"{where}: tokenizer source 'union' with {method.name} is not supported here: the union builds "
                    "vocabulary rows that the agents' Fisher files do not have"
                )
            notes.append(
                f"tokenizer source 'union' ({union_rows.rows} tokens): the rows of {len(union_rows.holders)} token(s) "
                f"that some model lacks and of {len(union_rows.forced)} forced token(s) are built in every model "
                "before the merge, as mergekit builds them"
            )
        else:
            union_rows = None
        tokenizer_source, union = donor, union_rows is None
    elif tokenizer_name not in (None, "base"):
        tokenizer_source = _resolve_path(tokenizer_name, config_dir)
        if not tokenizer_source.is_dir():
            raise ConfigError(f"{where}: tokenizer source {tokenizer_name!r} is not a directory")
    if config.tokenizer is not None and config.tokenizer.tokens and tokenizer_name != "union":
        _check_token_rules(
            config.tokenizer.tokens, tokenizer_source, [base_path, *(a.path for a in agents)], where
        )
    if tokenizer_name == "base" and config.tokenizer is not None and config.tokenizer.pad_to_multiple_of:
        models = [base_path, *(a.path for a in agents)]
        if not _shares_numbering(base_path, models):
            raise ConfigError(
                f"{where}: tokenizer.pad_to_multiple_of with source 'base' needs every model's tokenizer.json to "
                "number the base's tokens as the base does; re-numbered rows are not implemented"
            )
        size = max((_vocabulary(base_path) or {}).values()) + 1
        padded = _padded_rows(config, size)
        if padded is not None:
            union_rows = _union_rows(models, config.dtype, size)
            union_rows = dataclasses.replace(union_rows, padded_rows=padded)
            notes.append(f"tokenizer padded to {padded} rows as mergekit pads them (each model's mean row)")
    shape_mismatch = "merge_common_rows" if union else config.shape_mismatch
    if union_rows is not None:
        shape_mismatch = "error"  # every model's vocabulary rows are built to one count
    elif (
        tokenizer_name is not None
        and shape_mismatch == "error"
        and _shares_numbering(tokenizer_source, [base_path, *(a.path for a in agents)])
    ):
        # mergekit re-indexes each model's vocabulary rows to the config's tokenizer: with one numbering that keeps
        # the base's rows and leaves out an agent's added-token rows past them
        shape_mismatch = "tokenizer_rows"
    chat_template = (
        resolve_chat_template(
            config.chat_template, [base_path, *(a.path for a in agents)], f"{where}: chat_template"
        )
        if config.chat_template
        else None
    )
    layers = None
    if gradient:
        layers = num_layers(base_path)
        if layers is None:
            raise ConfigError(
                f"{where}: a gradient (a list of numbers) is interpolated over the decoder layers, but base_model "
                f"{base_path} has no config.json with num_hidden_layers"
            )
    return ResolvedConfig(
        method=method,
        method_alias=config.merge_method,
        params=params,
        agents=agents,
        base_path=base_path,
        out_dtype=out_dtype,
        tokenizer_source=tokenizer_source,
        seed=config.seed,
        shape_mismatch=shape_mismatch,
        allow_nonfinite=config.allow_nonfinite,
        raw=config.model_dump(exclude_defaults=True),
        notes=notes,
        source=config_path,
        num_layers=layers,
        chat_template=chat_template,
        segments=segments,
        union_rows=union_rows,
    )
