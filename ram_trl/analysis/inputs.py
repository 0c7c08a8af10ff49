"""What :func:`ram_trl.analyze` measures: the inputs and the parameters, resolved and validated up front."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ram_trl import defaults
from ram_trl.errors import ConfigError
from ram_trl.io.hub import resolve_model
from ram_trl.merging.config.resolve import resolve_config
from ram_trl.merging.config.schema import MergeConfig, load_config
from ram_trl.merging.config.settings import ResolvedConfig
from ram_trl.sizes import check_optional_number
from ram_trl.stage.manifest import base_model_path, is_stage, manifest_path, read_manifest
from ram_trl.statistics.counting import DEFAULT_EPS

DEFAULT_R = defaults.R
DEFAULT_ALPHA = defaults.ALPHA


@dataclass
class AnalysisInputs:
    """What to analyse, resolved and validated (paths exist, parameters in range)."""

    resolved: ResolvedConfig
    eps: float
    r: float
    alpha: float


def resolve_inputs(
    base: str | os.PathLike | None,
    agents: Sequence[str | os.PathLike],
    eps: float | None,
    r: float | None,
    alpha: float | None,
    *,
    config: str | os.PathLike | dict[str, Any] | MergeConfig | None = None,
    names: Sequence[str] | None = None,
    allow_external_shards: bool = False,
) -> AnalysisInputs:
    """Validate the arguments of :func:`analyze` (through the merge's config resolution)."""
    given = {"eps": eps, "r": r, "alpha": alpha}
    for key, value in given.items():
        check_optional_number(value, "analyze", f"--{key}", minimum=0.0)
    if config is not None:
        if base is not None or agents:
            raise ConfigError("give either a merge config or a base and agents, not both")
        parsed, config_path = load_config(config)
        resolved = resolve_config(parsed, config_path, allow_external_shards=allow_external_shards)
    else:
        if base is None and agents and all(is_stage(a) for a in agents):
            bases = {stage_base(a) for a in agents}
            if len(bases) == 1 and None not in bases:
                base = next(iter(bases))
        if base is None or not agents:
            raise ConfigError(
                "give a base model and at least one agent (or a merge config); the base may be left out only "
                "when every agent is a stage manifest of the same local base"
            )
        found = []
        for label, path in [("base model", base), *((f"agent {i}", a) for i, a in enumerate(agents))]:
            found.append(resolve_model(path, what=label, weights=False))  # a path, or a Hub id's cache snapshot
            if not found[-1].exists():
                raise ConfigError(f"{label}: {path} does not exist (neither a local path nor a Hub id ORG/NAME)")
        if all(a.resolve() == found[0].resolve() for a in found[1:]):
            raise ConfigError(f"every agent is the base model {base}: there is no task vector to analyse")
        entries = [{"stage" if is_stage(path) else "model": str(path)} for path in agents]
        parameters = {k: v for k, v in given.items() if v is not None}
        raw = {"merge_method": "ram_plus", "base_model": str(base), "models": entries, "parameters": parameters}
        resolved = resolve_config(load_config(raw)[0], allow_external_shards=allow_external_shards)
    if names is not None:
        if len(names) != len(resolved.agents):
            dropped = f" ({'; '.join(resolved.notes)})" if resolved.notes else ""
            raise ConfigError(
                f"{len(names)} names given for {len(resolved.agents)} agents{dropped}; give one per agent"
            )
        for agent, name in zip(resolved.agents, names, strict=True):
            agent.name = name
    defaults = {"eps": DEFAULT_EPS, "r": DEFAULT_R, "alpha": DEFAULT_ALPHA}
    values = {
        key: float(given[key] if given[key] is not None else resolved.params.get(key, defaults[key]))
        for key in defaults
    }
    # the merge's density warnings read eps from the parameters
    resolved.params = {**resolved.params, **values}
    return AnalysisInputs(resolved, values["eps"], values["r"], values["alpha"])


def stage_base(path: str | os.PathLike) -> Path | None:
    """The base a stage manifest names (a relative path resolved against the manifest's directory)."""
    file = manifest_path(path)
    return base_model_path(read_manifest(file), file)


__all__ = ["DEFAULT_ALPHA", "DEFAULT_R", "AnalysisInputs", "resolve_inputs", "stage_base"]
