"""mergekit's ``slices:`` and ``modules:`` forms: their sources as models, whole-model layer ranges, and the settings
of consecutive slices as layer segments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ram_trl.errors import ConfigError
from ram_trl.merging.config.schema import MergeConfig, ModelEntry, SliceEntry, resolve_model_ref, split_lora
from ram_trl.merging.config.settings import (
    LayerSegment,
    agent_settings,
    has_gradient,
    num_layers,
    per_tensor,
    shared_settings,
)
from ram_trl.methods import MergeMethod

#: Several consecutive output slices: per slice, ``(layer range, the slice's parameters, each source's parameters)``.
SliceSettings = list[tuple[tuple[int, int], dict[str, Any], list[dict[str, Any]]]]


def slice_entries(
    slices: list[SliceEntry], where: str, label: str
) -> tuple[list[ModelEntry], dict[str, Any], str | None, list[tuple[str, str, tuple[int, int]]], SliceSettings | None]:
    """Output slices as ``models`` entries: ``(entries, the first slice's parameters, the slice base_model, layer
    ranges that must each cover a whole model, each slice's settings when there are several)``. Only consecutive
    slices from layer 0 over the same models and layers are accepted (no stacking, mixing or skipping)."""
    for k, out_slice in enumerate(slices):
        if out_slice.residual_weight is not None:
            raise ConfigError(f"{where}: {label}[{k}].residual_weight is not supported")
    first = slices[0]
    entries = [ModelEntry(model=source.model, parameters=source.parameters) for source in first.sources]
    if len(slices) == 1:
        ranges = [
            (f"{label}[0].sources[{i}]", source.model, source.layer_range) for i, source in enumerate(first.sources)
        ]
        return entries, first.parameters, first.base_model, ranges, None
    frankenmerge = (
        "stacking, mixing or skipping layer ranges (a frankenmerge) is not supported; ram_trl merges whole "
        "models: consecutive slices must take the same models, in the same order, over consecutive layer ranges"
    )
    models = [source.model for source in first.sources]
    settings: SliceSettings = []
    stop = 0
    for k, out_slice in enumerate(slices):
        theirs = [source.model for source in out_slice.sources]
        if theirs != models:
            raise ConfigError(f"{where}: {label}[{k}] takes the models {theirs}, {label}[0] {models}: {frankenmerge}")
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
        settings.append((layer_range, out_slice.parameters, [source.parameters for source in out_slice.sources]))
    ranges = [(f"{label}[*].sources[{i}]", model, (0, stop)) for i, model in enumerate(models)]
    return entries, first.parameters, first.base_model, ranges, settings


def config_entries(
    config: MergeConfig, where: str
) -> tuple[
    list[ModelEntry], list[dict[str, Any]], str | None, list[tuple[str, str, tuple[int, int]]], SliceSettings | None
]:
    """The config's models as ``models`` entries, whichever of ``models``, ``slices`` and ``modules`` gives them:
    ``(entries, parameter scopes above the global one (highest first), a slice's base_model, layer ranges that
    must each cover a whole model, the settings of each of several slices)``."""
    if config.models is not None:
        return config.models, [], None, [], None
    if config.slices is not None:
        entries, params, base, ranges, settings = slice_entries(config.slices, where, "slices")
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
    entries, params, base, ranges, settings = slice_entries(module.slices, where, f"modules.{name}.slices")
    return entries, [params, module.parameters], base, ranges, settings


def check_layer_ranges(ranges: list[tuple[str, str, tuple[int, int]]], config_dir: Path | None, where: str) -> None:
    """Each slice source must cover every layer of its model, ``[0, N)`` (mergekit's ``models:`` equivalent)."""
    for label, model, (start, stop) in ranges:
        path = resolve_model_ref(split_lora(model, config_dir)[0], config_dir, f"{where}: {label}")
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


def slice_segments(
    method: MergeMethod,
    alias_defaults: dict[str, Any],
    slice_settings: SliceSettings,
    module_scopes: list[dict[str, Any]],
    config: MergeConfig,
    positions: list[int],
    label: str,
    where: str,
    ignored: dict[str, list[str]],
    config_dir: Path | None,
) -> tuple[list[LayerSegment], bool]:
    """``(segments, whether a setting is a gradient)``: each consecutive slice's settings in mergekit's precedence
    (source, slice, module, top level); what applies to the whole merge at once must agree in every slice."""
    segments: list[LayerSegment] = []
    gradient = False
    resolved_first = ignored
    for k, ((start, stop), slice_params, source_params) in enumerate(slice_settings):
        # the first slice's unused names are already listed (as the models' and the slice's)
        ignored = {} if k == 0 else resolved_first
        params, agent_defaults = shared_settings(
            method,
            alias_defaults,
            [slice_params, *module_scopes, config.parameters],
            [f"{label}[{k}].parameters", *(["module parameters"][: len(module_scopes)]), "parameters"],
            where,
            ignored,
        )
        gradient = gradient or any(has_gradient(v) for v in [*params.values(), *agent_defaults.values()])
        per_agent = []
        for position in positions:
            place = f"{label}[{k}].sources[{position}]"
            values, own_gradient = agent_settings(
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
        if per_tensor(parameter):
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
