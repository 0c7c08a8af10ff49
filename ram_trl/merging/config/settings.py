"""The resolved configuration (:class:`ResolvedConfig`) and the method parameters it holds: gradients over layers,
per-tensor filters, mergekit's fall-through between scopes, and the checks of every value."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ram_trl.errors import ConfigError
from ram_trl.io.fisher_files import default_fisher_path
from ram_trl.io.vocabulary import UnionRows
from ram_trl.merging.config.schema import resolve_path
from ram_trl.methods import MergeMethod, Parameter
from ram_trl.sizes import check_number
from ram_trl.statistics.anatomy import classify, layer_index


@dataclass
class AgentSpec:
    """A resolved agent: where it is and its parameters (scalars, or mergekit filter lists)."""

    index: int
    name: str
    path: Path
    parameters: dict[str, Any]
    kind: str = "full"
    stage: dict[str, Any] | None = None
    reference: str | None = None


@dataclass(frozen=True)
class LayerSegment:
    """One of several consecutive mergekit output slices: the decoder layers it covers and its settings."""

    start: int
    stop: int
    params: dict[str, Any]
    agent_parameters: list[dict[str, Any]]


@dataclass
class ResolvedConfig:
    """A validated merge config, ready to plan."""

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
    base_reference: str | None = None

    def inputs(self) -> list[tuple[str, Path]]:
        """Every file and directory the merge reads, labelled for messages: the base, the tokenizer source, the
        config file, each agent, its stage manifest and its Fisher file. An output must never replace (or lie
        inside) one of them (:class:`ram_trl.output.OutputDir`)."""
        reads: list[tuple[str, Path]] = [("base model", self.base_path), ("tokenizer_source", self.tokenizer_source)]
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
        """mergekit's gradient position ``t``: ``i / (N - 1)`` in decoder layer ``i`` of ``N`` (``1`` when
        ``N == 1``), ``0`` outside the decoder layers (embeddings, final norm, ``lm_head``)."""
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
        """The output slice whose settings a tensor takes (:attr:`segments`)."""
        if not self.segments:
            return None
        index = layer_index(tensor_name)
        if index is None:
            return self.segments[0] if classify(tensor_name).module == "embedding" else self.segments[-1]
        return next((s for s in self.segments if s.start <= index < s.stop), self.segments[-1])

    def params_for(self, tensor_name: str) -> dict[str, Any]:
        """The global parameters for one tensor, filter rules and gradients (``per_tensor`` parameters) resolved."""
        segment = self.segment(tensor_name)
        params = self.params if segment is None else segment.params
        if not any(isinstance(value, list) for value in params.values()):
            return params
        t = self.layer_position(tensor_name)
        return {
            name: evaluate_setting(value, tensor_name, t, f"parameter {name!r}") if isinstance(value, list) else value
            for name, value in params.items()
        }

    def agent_value(self, agent: AgentSpec, name: str, tensor_name: str) -> float:
        """The value of per-agent parameter ``name`` for one tensor. As mergekit: the first rule whose ``filter`` is a
        substring of the name (or ``"*"``, or absent) gives it; no match falls through to the global setting, then the
        default; gradients are interpolated over the decoder layers (:meth:`layer_position`)."""
        segment = self.segment(tensor_name)
        value = (agent.parameters if segment is None else segment.agent_parameters[agent.index])[name]
        if isinstance(value, list):
            return evaluate_setting(
                value, tensor_name, self.layer_position(tensor_name), f"agent {agent.name}: parameter {name!r}"
            )
        return float(value)


def interpolate(values: list[float], t: float) -> float:
    """mergekit's gradient: the piecewise-linear interpolation of ``values`` (evenly spaced over ``[0, 1]``) at
    ``t``, in the same float64 operations and order as mergekit 0.1.5."""
    scaled = t * (len(values) - 1)
    low = int(scaled)
    high = min(len(values) - 1, low + 1)
    frac = scaled - low
    return float((1 - frac) * values[low] + frac * values[high])


def evaluate_setting(setting: Any, tensor_name: str, t: float, what: str) -> float:
    """The value of a numeric setting for one tensor: a number, a gradient (list of numbers, :func:`interpolate`
    at ``t``), or mergekit filter rules (the first rule matching ``tensor_name``; its value a number or gradient)."""
    if not isinstance(setting, list):
        return float(setting)
    if not setting or not isinstance(setting[0], dict):
        return interpolate([float(v) for v in setting], t)
    for rule in setting:
        pattern = rule.get("filter")
        if pattern is None or pattern == "*" or pattern in tensor_name:
            return evaluate_setting(rule["value"], tensor_name, t, what)
    raise ConfigError(f"{what}: no rule matches tensor {tensor_name!r}")


def has_gradient(setting: Any) -> bool:
    """Whether a checked setting holds a gradient (at its top or in a filter rule)."""
    if not isinstance(setting, list):
        return False
    if setting and isinstance(setting[0], dict):
        return any(isinstance(rule["value"], list) for rule in setting)
    return True


def _fall_through(first: Any, then: Any) -> Any:
    """mergekit's precedence of two scopes: ``first``'s rules, then ``then`` (unless ``first`` always applies)."""
    if not (isinstance(first, list) and first and isinstance(first[0], dict)):
        return first
    if any(rule.get("filter") in (None, "*") for rule in first):
        return first
    rest = then if isinstance(then, list) and then and isinstance(then[0], dict) else [{"value": then}]
    return [*first, *rest]


def num_layers(path: Path) -> int | None:
    """The decoder layer count a checkpoint's ``config.json`` declares (``num_hidden_layers``, ``n_layer`` or
    ``num_layers``, also under ``text_config``), as mergekit reads it for gradients and slices."""
    directory = path if path.is_dir() else path.parent
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    found = layer_count_key(config)
    return None if found is None else found[0][found[1]]


def layer_count_key(config: Any) -> tuple[dict[str, Any], str] | None:
    """Where a ``config.json`` (as a dict) holds its decoder layer count: ``(the dict, the key)``."""
    for scope in (config, config.get("text_config") if isinstance(config, dict) else None):
        if isinstance(scope, dict):
            for key in ("num_hidden_layers", "n_layer", "num_layers"):
                value = scope.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return scope, key
    return None


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
        value, where, f"parameter {parameter.name!r}", minimum=parameter.minimum, maximum=parameter.maximum
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
        raise ConfigError(f"{where}: parameter {parameter.name!r}: a gradient needs at least one number, got []")
    return [_check_value(parameter, item, f"{where}: parameter {parameter.name!r} gradient") for item in value]


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
            f"{', '.join(p.name for p in method.parameters if per_tensor(p)) or 'none of its parameters'}"
        )
    return _check_value(parameter, value, where)


def per_tensor(parameter: Parameter) -> bool:
    return parameter.kind is float and (parameter.scope == "agent" or parameter.per_tensor)


def check_parameter(parameter: Parameter, value: Any, where: str) -> Any:
    """Check one value of a method parameter (global or per-agent, filter rules included) as a merge does: type,
    finite, in range (also used by the recipes before any training)."""
    if parameter.scope == "global" and not parameter.per_tensor:
        return _check_value(parameter, value, where)
    return _check_agent_value(parameter, value, where)


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


def shared_settings(
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


def agent_settings(
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
            raise ConfigError(f"{label}: {key!r} is a global parameter: put it under the top-level 'parameters'")
        own[parameter.name] = _check_agent_value(parameter, value, label)
        gradient = gradient or has_gradient(own[parameter.name])
    values = _chain([own, agent_defaults])
    for parameter in method.parameters:
        if parameter.scope != "agent":
            continue
        default = alias_defaults.get(parameter.name, parameter.default)
        values[parameter.name] = (
            _fall_through(values[parameter.name], default) if parameter.name in values else default
        )
        if parameter.kind is Path and values[parameter.name]:
            values[parameter.name] = str(resolve_path(values[parameter.name], config_dir))
    return values, gradient
