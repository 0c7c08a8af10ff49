"""The merge configuration resolved (every model, stage and adapter located, every parameter filled in) up front."""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path
from typing import Any

from ram_trl.errors import ConfigError
from ram_trl.io.vocabulary import UnionRows
from ram_trl.merging.config.schema import DTYPES, MergeConfig, full_model, resolve_model_ref, resolve_path, split_lora
from ram_trl.merging.config.settings import (
    AgentSpec,
    ResolvedConfig,
    agent_settings,
    has_gradient,
    num_layers,
    shared_settings,
)
from ram_trl.merging.config.slices import check_layer_ranges, config_entries, slice_segments
from ram_trl.merging.config.tokens import (
    build_union_rows,
    check_token_rules,
    padded_rows,
    resolve_chat_template,
    shares_numbering,
    spare_rows,
    token_sources,
    tokenizer_vocabulary,
    union_donor,
)
from ram_trl.messages import did_you_mean
from ram_trl.methods import method_names, resolve_method
from ram_trl.stage.manifest import base_model_path, check_base, manifest_path, read_manifest, verify_stage


def _resolve_stage(
    manifest_file: Path, base_path: Path, label: str, allow_external: bool = False
) -> tuple[Path, dict[str, Any]]:
    """The checkpoint of a stage manifest, verified (:func:`verify_stage`) and checked against ``base_path``."""
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


_REFUSED_METHODS = {
    "passthrough": "copies (and stacks) layers without merging: `ram-trl merge` (ram_trl.merge) writes it; there "
    "is no merge of agents here",
    "nuslerp": "not implemented",
    "multislerp": "not implemented",
    "karcher": "not implemented",
    "arcee_fusion": "not implemented",
    "nearswap": "not implemented",
}


def resolve_config(
    config: MergeConfig, config_path: Path | None = None, *, allow_external_shards: bool = False
) -> ResolvedConfig:
    """Check a config against the method registry and the file system (paths only; tensors come later)."""
    where = str(config_path) if config_path else "merge config"
    try:
        method, alias_defaults = resolve_method(config.merge_method)
    except KeyError:
        refused = _REFUSED_METHODS.get(config.merge_method.strip().lower())
        if refused:
            raise ConfigError(f"{where}: merge_method {config.merge_method!r} is not supported: {refused}") from None
        raise ConfigError(
            f"{where}: unknown merge_method {config.merge_method!r}{did_you_mean(config.merge_method, method_names())}; "
            f"available: {', '.join(method_names())} "
            "(mergekit names ramplus_tl, ramplus, average are accepted as aliases)"
        ) from None
    config_dir = config_path.parent if config_path else None
    entries, scopes, slice_base, ranges, slice_settings = config_entries(config, where)
    base_model = config.base_model
    if slice_base is not None and base_model is not None and slice_base != base_model:
        raise ConfigError(f"{where}: the slice's base_model {slice_base!r} differs from base_model {base_model!r}")
    base_model = base_model or slice_base
    if base_model is None:
        first = entries[0]
        if not method.keeps_base_entries or first.model is None:
            raise ConfigError(
                f"{where}: base_model is missing; {method.name} needs the base all agents were trained from "
                "(only a plain weighted average of models, such as linear, can take its layout from the first model)"
            )
        base_model = first.model
    base_path = full_model(base_model, config_dir, f"{where}: base_model")
    if not base_path.exists():
        raise ConfigError(f"{where}: base_model {base_model!r} does not exist (resolved to {base_path})")
    check_layer_ranges(ranges, config_dir, where)

    ignored: dict[str, list[str]] = {}
    scope_names = [*(["slice parameters", "module parameters"][: len(scopes)]), "parameters"]
    params, agent_defaults = shared_settings(
        method, alias_defaults, [*scopes, config.parameters], scope_names, where, ignored
    )
    gradient = any(has_gradient(v) for v in [*params.values(), *agent_defaults.values()])

    agents: list[AgentSpec] = []
    positions: list[int] = []
    notes: list[str] = []
    for position, entry in enumerate(entries):
        stage_info: dict[str, Any] | None = None
        if entry.stage is not None:
            label = f"{where}: models[{position}] (stage {entry.stage})"
            path, stage_info = _resolve_stage(
                resolve_path(entry.stage, config_dir), base_path, label, allow_external_shards
            )
        else:
            label = f"{where}: models[{position}] ({entry.model})"
            model, adapter = split_lora(entry.model, config_dir)
            path = resolve_model_ref(model, config_dir, label)
            if adapter is not None and path.exists() and path.resolve() == base_path.resolve():
                path = resolve_model_ref(adapter, config_dir, label)  # a LoRA agent of the base: its delta streams
            elif adapter is not None:  # an adapter of another model: merged into it, as mergekit does
                path = full_model(entry.model, config_dir, label)
        if not path.exists():
            raise ConfigError(f"{label}: agent checkpoint does not exist (resolved to {path})")
        if not method.keeps_base_entries and path.resolve() == base_path.resolve():
            notes.append(f"models[{position}] is the base model; it has no task vector and is left out")
            continue
        values, own_gradient = agent_settings(
            method, alias_defaults, entry.parameters, agent_defaults, label, f"models[{position}]", ignored, config_dir
        )
        gradient = gradient or own_gradient
        name = entry.name or (stage_info["stage"] if stage_info else path.name)
        agents.append(
            AgentSpec(
                index=len(agents), name=name, path=path, parameters=values, stage=stage_info, reference=entry.model
            )
        )
        positions.append(position)
    segments = None
    if slice_settings is not None:
        segments, slice_gradient = slice_segments(
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
            + ", ".join(
                f"{key!r} ({', '.join(dict.fromkeys(places))}){did_you_mean(key, [p.name for p in method.parameters])}"
                for key, places in ignored.items()
            )
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
            f"exactly {fewest}" if fewest == most else f"at least {fewest}" if most is None else f"{fewest} to {most}"
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
        donor, why = union_donor([base_path, *(a.path for a in agents)])
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
        union_rows = build_union_rows(models, config.dtype)
        rules = config.tokenizer.tokens if config.tokenizer is not None and config.tokenizer.tokens else {}
        sources, forced = token_sources(rules, union_rows, donor, models, where, config_dir)
        padded = padded_rows(config, union_rows.rows)
        union_rows = dataclasses.replace(union_rows, sources=sources, forced=forced, padded_rows=padded)
        shared = any(len(h) > 1 and 0 not in h for h in union_rows.holders.values())
        # a row that is no token's (an embedding padded past its tokenizer) is left out of the union
        spare = spare_rows(models)
        if padded or forced or sources or spare or (union_rows.holders and (method.prepares_tensors or shared)):
            # rows some model lacks enter the method's whole-tensor step, or are merged from several models' rows:
            # every model gets mergekit's rows before the merge (ram_trl.io.vocabulary)
            if method.needs_fisher:
                raise ConfigError(
                    f"{where}: tokenizer source 'union' with {method.name} is not supported here: the union builds "
                    "vocabulary rows that the agents' Fisher files do not have" + (f" ({spare})" if spare else "")
                )
            notes.append(
                f"tokenizer source 'union' ({union_rows.rows} tokens): the rows of {len(union_rows.holders)} token(s) "
                f"that some model lacks and of {len(union_rows.forced)} forced token(s) are built in every model "
                "before the merge, as mergekit builds them"
                + (f"; {spare}: mergekit leaves such rows out, and so does ram_trl" if spare else "")
            )
        else:
            union_rows = None
        tokenizer_source, union = donor, union_rows is None
    elif tokenizer_name not in (None, "base"):
        tokenizer_source = resolve_model_ref(tokenizer_name, config_dir, f"{where}: tokenizer source")
        if not tokenizer_source.is_dir():
            raise ConfigError(f"{where}: tokenizer source {tokenizer_name!r} is not a directory")
    if config.tokenizer is not None and config.tokenizer.tokens and tokenizer_name != "union":
        check_token_rules(config.tokenizer.tokens, tokenizer_source, [base_path, *(a.path for a in agents)], where)
    if tokenizer_name == "base" and config.tokenizer is not None and config.tokenizer.pad_to_multiple_of:
        models = [base_path, *(a.path for a in agents)]
        if not shares_numbering(base_path, models):
            raise ConfigError(
                f"{where}: tokenizer.pad_to_multiple_of with source 'base' needs every model's tokenizer.json to "
                "number the base's tokens as the base does; re-numbered rows are not implemented"
            )
        size = max((tokenizer_vocabulary(base_path) or {}).values()) + 1
        padded = padded_rows(config, size)
        if padded is not None:
            union_rows = build_union_rows(models, config.dtype, size)
            union_rows = dataclasses.replace(union_rows, padded_rows=padded)
            notes.append(f"tokenizer padded to {padded} rows as mergekit pads them (each model's mean row)")
    shape_mismatch = "merge_common_rows" if union else config.shape_mismatch
    if union_rows is not None:
        shape_mismatch = "error"  # every model's vocabulary rows are built to one count
    elif (
        tokenizer_name is not None
        and shape_mismatch == "error"
        and shares_numbering(tokenizer_source, [base_path, *(a.path for a in agents)])
    ):
        # mergekit re-indexes each model's vocabulary rows to the config's tokenizer: with one numbering that keeps
        # the base's rows and leaves out an agent's added-token rows past them
        shape_mismatch = "tokenizer_rows"
    chat_template = (
        resolve_chat_template(config.chat_template, [base_path, *(a.path for a in agents)], f"{where}: chat_template")
        if config.chat_template
        else None
    )
    if config.chat_template == "auto" and chat_template is None:
        notes.append("chat_template 'auto': no input model has a chat template; none is set, as mergekit does")
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
        base_reference=base_model,
    )
