"""Merge configuration: mergekit-style YAML, validated before any heavy work starts.

The field names of shared concepts are mergekit's (``merge_method``, ``base_model``, ``models[].model``,
``models[].parameters``, top-level ``parameters``, ``dtype``, ``out_dtype``, ``tokenizer_source``), so a mergekit
YAML for any method ``ram-trl methods`` lists runs unchanged. Nothing here knows a method by name: what a method
accepts comes from its :class:`~ram_trl.methods.MergeMethod`. Differences are listed in ``docs/methods.md``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ram_trl.errors import ConfigError
from ram_trl.io.fisher_files import default_fisher_path
from ram_trl.manifest import check_base, manifest_path, read_manifest, verify_stage
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

_UNSUPPORTED_MERGEKIT_FIELDS = {
    "slices": "layer slicing (frankenmerges) is not supported: ram_trl merges whole models tensor by tensor",
    "tokenizer": "the 'tokenizer' block is not supported: use tokenizer_source: base or a model path",
    "chat_template": "chat_template is not supported: the output keeps the tokenizer_source's chat template",
    "modules": "per-module configs are not supported",
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


class MergeConfig(BaseModel):
    """A merge config (the YAML file), before resolution against the method registry and the file system.

    Args:
        merge_method (`str`):
            Method name or alias, as ``ram-trl methods`` lists them (mergekit's ``ramplus_tl`` and others as
            aliases).
        base_model (`str`, *optional*):
            Path of the base checkpoint all agents were trained from. Optional for methods that average models
            (``linear``, as in mergekit): the first model then provides the layout, config and tokenizer.
        models (`list[ModelEntry]`):
            The agents: ``{model: PATH}`` or ``{stage: MANIFEST}``, each with optional ``parameters`` and ``name``.
        parameters (`dict[str, Any]`, *optional*, defaults to `{}`):
            Global parameters, and defaults for per-agent parameters (the method's defaults otherwise).
        dtype (`str`, *optional*):
            mergekit's compute dtype. ram_trl always computes in float32; ``dtype`` only sets the output dtype when
            ``out_dtype`` is absent (as in mergekit).
        out_dtype (`str`, *optional*):
            Output dtype of floating tensors (default: each tensor's dtype in the base).
        tokenizer_source (`str`, *optional*):
            ``base`` (the default) or a path whose tokenizer files are copied to the output.
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
    models: list[ModelEntry]
    parameters: dict[str, Any] = Field(default_factory=dict)
    dtype: str | None = None
    out_dtype: str | None = None
    tokenizer_source: str | None = None
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

    @field_validator("models")
    @classmethod
    def _some_models(cls, value: list[ModelEntry]) -> list[ModelEntry]:
        if not value:
            raise ValueError("'models' is empty: list at least one agent checkpoint")
        return value


@dataclass
class AgentSpec:
    """A resolved agent: where it is and its parameters (scalars, or mergekit filter lists)."""

    index: int
    name: str
    path: Path
    parameters: dict[str, Any]
    kind: str = "full"
    stage: dict[str, Any] | None = None


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

    def params_for(self, tensor_name: str) -> dict[str, Any]:
        """The global parameters for one tensor: mergekit filter rules (``per_tensor`` parameters) resolved.

        Args:
            tensor_name (`str`): The tensor's name (filters match substrings of it).

        Returns:
            `dict[str, Any]`: Parameter name to value; :attr:`params` itself when no parameter is a filter list.
        """
        if not any(isinstance(value, list) for value in self.params.values()):
            return self.params
        return {
            name: _rule_value(value, tensor_name, f"parameter {name!r}") if isinstance(value, list) else value
            for name, value in self.params.items()
        }

    def agent_value(self, agent: AgentSpec, name: str, tensor_name: str) -> float:
        """The value of per-agent parameter ``name`` for one tensor.

        Filter lists follow mergekit: the first rule whose ``filter`` is a substring of the tensor name (or ``"*"``,
        or absent) gives the value.

        Args:
            agent (`AgentSpec`): The agent.
            name (`str`): The parameter's canonical name.
            tensor_name (`str`): The tensor's name.

        Returns:
            `float`: The value.

        Raises:
            ConfigError: No rule of a filter list matches the tensor.
        """
        value = agent.parameters[name]
        if isinstance(value, list):
            return _rule_value(value, tensor_name, f"agent {agent.name}: parameter {name!r}")
        return float(value)


def _rule_value(rules: list[dict[str, Any]], tensor_name: str, what: str) -> float:
    """The value of the first mergekit filter rule matching ``tensor_name``."""
    for rule in rules:
        pattern = rule.get("filter")
        if pattern is None or pattern == "*" or pattern in tensor_name:
            return float(rule["value"])
    raise ConfigError(f"{what}: no rule matches tensor {tensor_name!r}")


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
        if not path.is_file():
            raise ConfigError(f"merge config {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
        if not isinstance(data, dict):
            raise ConfigError(
                f"{path}: a merge config must be a YAML mapping with merge_method, base_model, models"
            )
    where = str(path) if path else "merge config"
    for key, why in _UNSUPPORTED_MERGEKIT_FIELDS.items():
        if key in data:
            raise ConfigError(f"{where}: field {key!r}: {why}")
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
        "base_model": manifest.base_model,
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
    return check_number(
        value,
        where,
        f"parameter {parameter.name!r}",
        minimum=parameter.minimum,
        maximum=parameter.maximum,
    )


def _check_agent_value(parameter: Parameter, value: Any, where: str) -> Any:
    if isinstance(value, list) and parameter.kind is not Path:
        if not value or not all(isinstance(rule, dict) and "value" in rule for rule in value):
            raise ConfigError(
                f"{where}: parameter {parameter.name!r}: lists must be mergekit filter rules "
                "[{filter: SUBSTRING, value: X}, ..., {value: DEFAULT}]; gradients (lists of numbers) are not supported"
            )
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
            _check_value(parameter, rule["value"], where)
        return value
    return _check_value(parameter, value, where)


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
    if parameter.scope == "global":
        return _check_value(parameter, value, where)
    return _check_agent_value(parameter, value, where)


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
        raise ConfigError(
            f"{where}: unknown merge_method {config.merge_method!r}; available: {', '.join(method_names())} "
            "(mergekit names ramplus_tl, ramplus, average are accepted as aliases)"
        ) from None
    config_dir = config_path.parent if config_path else None
    base_model = config.base_model
    if base_model is None:
        first = config.models[0]
        if not method.keeps_base_entries or first.model is None:
            raise ConfigError(
                f"{where}: base_model is missing; {method.name} needs the base all agents were trained from "
                "(only a plain weighted average of models, such as linear, can take its layout from the first model)"
            )
        base_model = first.model
    base_path = _resolve_path(base_model, config_dir)
    if not base_path.exists():
        raise ConfigError(f"{where}: base_model {base_model!r} does not exist (resolved to {base_path})")

    params: dict[str, Any] = {}
    agent_defaults: dict[str, Any] = {}
    for key, value in config.parameters.items():
        parameter = method.parameter(key)
        if parameter is None:
            raise ConfigError(
                f"{where}: parameters.{key}: {method.name} takes no parameter {key!r}; it accepts "
                f"{', '.join(p.name for p in method.parameters)}"
            )
        if parameter.scope == "global" and parameter.per_tensor:
            params[parameter.name] = _check_agent_value(parameter, value, f"{where}: parameters")
        elif parameter.scope == "global":
            params[parameter.name] = _check_value(parameter, value, f"{where}: parameters")
        else:
            agent_defaults[parameter.name] = _check_agent_value(parameter, value, f"{where}: parameters")
    for parameter in method.parameters:
        if parameter.scope == "global" and parameter.name not in params:
            params[parameter.name] = alias_defaults.get(parameter.name, parameter.default)

    agents: list[AgentSpec] = []
    notes: list[str] = []
    for position, entry in enumerate(config.models):
        stage_info: dict[str, Any] | None = None
        if entry.stage is not None:
            label = f"{where}: models[{position}] (stage {entry.stage})"
            path, stage_info = _resolve_stage(
                _resolve_path(entry.stage, config_dir), base_path, label, allow_external_shards
            )
        else:
            path = _resolve_path(entry.model, config_dir)
            label = f"{where}: models[{position}] ({entry.model})"
        if not path.exists():
            raise ConfigError(f"{label}: agent checkpoint does not exist (resolved to {path})")
        if not method.keeps_base_entries and path.resolve() == base_path.resolve():
            notes.append(f"models[{position}] is the base model; it has no task vector and is left out")
            continue
        values = dict(agent_defaults)
        for key, value in entry.parameters.items():
            parameter = method.parameter(key)
            if parameter is None:
                raise ConfigError(
                    f"{label}: {method.name} takes no per-agent parameter {key!r}; per-agent parameters: "
                    f"{', '.join(p.name for p in method.parameters if p.scope == 'agent') or 'none'}"
                )
            if parameter.scope == "global":
                raise ConfigError(
                    f"{label}: {key!r} is a global parameter: put it under the top-level 'parameters'"
                )
            values[parameter.name] = _check_agent_value(parameter, value, label)
        for parameter in method.parameters:
            if parameter.scope == "agent" and parameter.name not in values:
                values[parameter.name] = alias_defaults.get(parameter.name, parameter.default)
            if parameter.kind is Path and values[parameter.name]:
                values[parameter.name] = str(_resolve_path(values[parameter.name], config_dir))
        name = entry.name or (stage_info["stage"] if stage_info else path.name)
        agents.append(AgentSpec(index=len(agents), name=name, path=path, parameters=values, stage=stage_info))
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
    tokenizer_source = base_path
    if config.tokenizer_source not in (None, "base"):
        if config.tokenizer_source == "union":
            raise ConfigError(f"{where}: tokenizer_source 'union' is not supported; use base or a model path")
        tokenizer_source = _resolve_path(config.tokenizer_source, config_dir)
        if not tokenizer_source.is_dir():
            raise ConfigError(f"{where}: tokenizer_source {config.tokenizer_source!r} is not a directory")
    return ResolvedConfig(
        method=method,
        method_alias=config.merge_method,
        params=params,
        agents=agents,
        base_path=base_path,
        out_dtype=out_dtype,
        tokenizer_source=tokenizer_source,
        seed=config.seed,
        shape_mismatch=config.shape_mismatch,
        allow_nonfinite=config.allow_nonfinite,
        raw=config.model_dump(exclude_defaults=True),
        notes=notes,
        source=config_path,
    )
