"""mergekit's ``passthrough``: decoder layers of one or more models stacked into a deeper model, each tensor copied
as mergekit 0.1.5 writes it (cast to ``dtype`` then ``out_dtype``, times ``scale``, layers renumbered; embeddings
from the first slice's model, the rest outside the layers from the last's; docs/merging.md)."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import ram_trl
from ram_trl.distributed import DistContext
from ram_trl.errors import CheckpointError, ConfigError
from ram_trl.io.checkpoint import Checkpoint, copy_tokenizer, open_checkpoint, write_chat_template
from ram_trl.io.hub import describe, needs_weights
from ram_trl.io.safetensors_io import RowReader, ShardFile, TensorMeta
from ram_trl.merging import report as reporting
from ram_trl.merging.config.schema import DTYPES, MergeConfig, SliceEntry, SliceSource, full_model
from ram_trl.merging.config.settings import evaluate_setting, layer_count_key, num_layers
from ram_trl.merging.config.tokens import resolve_chat_template
from ram_trl.merging.context import MergeOptions
from ram_trl.merging.planner import TensorTask, plan_shards, write_index
from ram_trl.output import OutputDir
from ram_trl.sizes import format_bytes, parse_size
from ram_trl.statistics.anatomy import layer_index, module_type, with_layer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Source:
    """Where output tensors come from: a model (index into :attr:`LayerStack.models`), its layer (``None``: the
    tensors outside the layers), mergekit's gradient position ``t`` and the parameter scopes, highest first."""

    model: int
    layer: int | None
    t: float
    scopes: tuple[dict[str, Any], ...]


@dataclass
class LayerStack:
    """A ``passthrough`` config resolved: the models, each output layer's source, and where the rest comes from."""

    references: list[str]
    models: list[Path]
    layers: list[_Source]
    edges: tuple[_Source, _Source]
    donor: Path
    donor_reference: str
    slices: list[dict[str, Any]]
    dtype: torch.dtype | None
    out_dtype: torch.dtype | None
    chat_template: str | None
    raw: dict[str, Any]
    source: Path | None
    notes: list[str] = field(default_factory=list)


def is_passthrough(config: MergeConfig) -> bool:
    return config.merge_method.strip().lower() == "passthrough"


def _slices(
    config: MergeConfig, config_dir: Path | None, where: str
) -> tuple[list[SliceEntry], list[dict[str, Any]], str]:
    """The output slices, the module's parameter scope (if any) and how messages name the slices."""
    models, scopes, label = config.models, [], "models"
    if config.modules is not None:
        if len(config.modules) != 1:
            raise ConfigError(f"{where}: passthrough with {len(config.modules)} modules is not supported")
        ((name, module),) = config.modules.items()
        models, scopes, label = module.models, [module.parameters], f"modules.{name}.models"
        if module.slices is not None:
            return module.slices, scopes, f"modules.{name}.slices"
    if config.slices is not None:
        return config.slices, scopes, "slices"
    assert models is not None
    if len(models) != 1 or models[0].model is None or config.base_model not in (None, models[0].model):
        raise ConfigError(
            f"{where}: passthrough copies one model: {label} lists {len(models)} entries"
            + (f" besides base_model {config.base_model!r}" if config.base_model else "")
            + "; stack the layers of several models with 'slices' (one source each)"
        )
    entry = models[0]
    count = num_layers(full_model(entry.model, config_dir, f"{where}: {label}[0]"))
    whole = SliceSource(model=entry.model, layer_range=(0, count or 0), parameters=entry.parameters)
    return [SliceEntry(sources=[whole])], scopes, label


def resolve_stack(config: MergeConfig, config_path: Path | None = None) -> LayerStack:
    """Check a ``passthrough`` config against the file system (configs and layer counts; tensors come later)."""
    where = str(config_path) if config_path else "merge config"
    config_dir = config_path.parent if config_path else None
    out_slices, module_scopes, label = _slices(config, config_dir, where)
    if config.tokenizer is not None or config.tokenizer_source not in (None, "base"):
        raise ConfigError(
            f"{where}: a tokenizer source with passthrough is not supported: the stacked model takes the tokenizer "
            "of base_model (else of the first slice's model); remove tokenizer_source / tokenizer"
        )
    references: list[str] = []
    models: list[Path] = []

    def model_index(reference: str, what: str) -> int:
        if reference not in references:
            path = full_model(reference, config_dir, what)
            if not path.exists():
                raise ConfigError(f"{what}: {reference!r} does not exist (resolved to {path})")
            references.append(reference)
            models.append(path)
        return references.index(reference)

    layers: list[_Source] = []
    slices, edges = [], []
    for k, out_slice in enumerate(out_slices):
        place = f"{where}: {label}[{k}]"
        if out_slice.residual_weight is not None:
            raise ConfigError(f"{place}.residual_weight is not supported")
        if len(out_slice.sources) != 1:
            raise ConfigError(
                f"{place} lists {len(out_slice.sources)} sources; passthrough copies the layers of one model per "
                "slice (mergekit takes at most one input): give each slice one source"
            )
        source = out_slice.sources[0]
        index = model_index(source.model, f"{place}.sources[0]")
        count = num_layers(models[index])
        start, stop = source.layer_range
        if count is None or not 0 <= start < stop <= count:
            raise ConfigError(
                f"{place}.sources[0] ({source.model}): layer_range {[start, stop]} is not within its layers "
                + (f"[0, {count}]" if count else "(no config.json with num_hidden_layers)")
            )
        scopes = (source.parameters, out_slice.parameters, *module_scopes, config.parameters)
        size = stop - start
        out_range = [len(layers), len(layers) + size]
        slices.append({"model": source.model, "layer_range": [start, stop], "output_layers": out_range})
        layers += [_Source(index, start + i, i / (size - 1) if size > 1 else 1.0, scopes) for i in range(size)]
        edges.append(_Source(index, None, 0.0, scopes))
    unused = sorted({key for s in edges for scope in s.scopes for key in scope} - {"scale"})
    donor_reference = config.base_model or out_slices[0].sources[0].model
    if donor_reference in references:
        donor = models[references.index(donor_reference)]
    else:  # the base gives config and tokenizer only: its weights are never read
        donor = full_model(donor_reference, config_dir, f"{where}: base_model")
        if not (donor / "config.json").is_file():
            raise ConfigError(f"{where}: base_model {donor_reference!r} has no config.json (resolved to {donor})")
    if layer_count_key(json.loads((donor / "config.json").read_text())) is None:
        raise ConfigError(f"{where}: {donor_reference} ({donor}) has no config.json with num_hidden_layers")
    out_name = config.out_dtype or config.dtype
    chat_template = (
        resolve_chat_template(config.chat_template, list(dict.fromkeys([donor, *models])), f"{where}: chat_template")
        if config.chat_template
        else None
    )
    stack = LayerStack(
        references=references,
        models=models,
        layers=layers,
        edges=(edges[0], edges[-1]),
        donor=donor,
        donor_reference=donor_reference,
        slices=slices,
        dtype=DTYPES[config.dtype.lower()] if config.dtype else None,
        out_dtype=DTYPES[out_name.lower()] if out_name else None,
        chat_template=chat_template,
        raw=config.model_dump(exclude_defaults=True),
        source=config_path,
    )
    if unused:
        stack.notes.append(f"passthrough takes only 'scale'; ignored, as mergekit does: {', '.join(unused)}")
    return stack


def _scale(scopes: tuple[dict[str, Any], ...], name: str, t: float, what: str) -> float | None:
    """mergekit's ``scale`` of an input tensor: the first scope with a value (filters match its name), or ``None``."""
    for scope in scopes:
        if "scale" in scope:
            try:
                return evaluate_setting(scope["scale"], name, t, what)
            except ConfigError:
                continue  # no filter rule matches: the next scope, as mergekit
            except (TypeError, ValueError, KeyError):
                raise ConfigError(f"{what}: 'scale' must be a number, a gradient or filter rules") from None
    return None


@dataclass(frozen=True)
class _Copy:
    task: TensorTask
    model: int
    name: str
    scale: float | None


def plan_stack(stack: LayerStack, checkpoints: list[Checkpoint], options: MergeOptions) -> list[_Copy]:
    """Every output tensor (in order: embeddings, layers, the rest) and where it is copied from; the tensors of
    every output layer must match the first output layer's (names and shapes)."""
    budget = parse_size(options.chunk_budget, name="chunk_budget")
    where = str(stack.source or "merge config")
    by_layer: list[dict[int | None, list[str]]] = []
    for checkpoint in checkpoints:
        groups: dict[int | None, list[str]] = {}
        for name in checkpoint.tensors:
            groups.setdefault(layer_index(name), []).append(name)
        by_layer.append(groups)
    first, last = stack.edges
    wanted = [(first, lambda n: module_type(n) == "embedding", None)]
    wanted += [(s, lambda n: True, j) for j, s in enumerate(stack.layers)]
    wanted += [(last, lambda n: module_type(n) != "embedding", None)]
    copies: list[_Copy] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for source, keep, out_layer in wanted:
        checkpoint = checkpoints[source.model]
        names = [n for n in by_layer[source.model].get(source.layer, []) if keep(n)]
        if source.layer is not None:
            theirs = {with_layer(n, 0): checkpoint.tensors[n].shape for n in names}
            shapes = shapes or theirs
            if theirs != shapes:
                differ = sorted(set(theirs) ^ set(shapes)) or [r for r in theirs if theirs[r] != shapes[r]]
                raise CheckpointError(
                    f"{where}: layer {source.layer} of {stack.references[source.model]} does not match the first "
                    f"output layer (tensor {differ[0]!r}): the stacked layers must share one architecture"
                )
        for name in names:
            meta = checkpoint.tensors[name]
            floating = meta.dtype.is_floating_point
            dtype = (stack.out_dtype or stack.dtype or meta.dtype) if floating else meta.dtype
            row_numel = max(1, meta.numel // max(1, meta.shape[0] if meta.shape else 1))
            out_name = name if out_layer is None else with_layer(name, out_layer)
            rows, per_chunk = (meta.shape[0] if meta.shape else 1), max(1, budget // (16 * row_numel))
            task = TensorTask(out_name, meta, dtype, rows, (), floating, per_chunk)
            what = f"{where}: tensor {name!r} of {stack.references[source.model]}"
            scale = _scale(source.scopes, name, source.t, what) if floating else None
            copies.append(_Copy(task, source.model, name, scale))
    return copies


def _open(stack: LayerStack, options: MergeOptions, fetch: bool) -> list[Checkpoint]:
    return [
        open_checkpoint(
            path,
            f"passthrough input {ref}",
            allow_pickle=options.allow_pickle,
            allow_external_shards=options.allow_external_shards,
            fetch=fetch,
        )
        for ref, path in zip(stack.references, stack.models, strict=True)
    ]


def stack_merge(
    config: MergeConfig, config_path: Path | None, output_dir: Path, options: MergeOptions
) -> dict[str, Any]:
    """Run a ``passthrough`` config (see :mod:`ram_trl.merging.stack`); the report, or with ``dry_run`` the plan.
    Under ``torchrun``/``accelerate launch`` the main process copies, the others get its report."""
    ctx = DistContext.from_env(options.device)
    try:
        run = lambda: _stack_merge(config, config_path, output_dir, options) if ctx.is_main else None  # noqa: E731
        return ctx.broadcast_object(ctx.guarded(run))
    finally:
        ctx.close()


def _stack_merge(
    config: MergeConfig, config_path: Path | None, output_dir: Path, options: MergeOptions
) -> dict[str, Any]:
    started = time.perf_counter()
    stack = resolve_stack(config, config_path)
    reads = [
        ("base model", stack.donor),
        *((f"model {r}", p) for r, p in zip(stack.references, stack.models, strict=True)),
    ]
    output = OutputDir(output_dir, overwrite=options.overwrite, reads=reads, markers=(reporting.REPORT_FILE,))
    if not options.dry_run:
        output.check()
        if any(needs_weights(p) for p in stack.models):
            plan_stack(stack, _open(stack, options, fetch=False), options)  # every header before any download
    checkpoints = _open(stack, options, fetch=not options.dry_run)
    copies = plan_stack(stack, checkpoints, options)
    shards = plan_shards([c.task for c in copies], parse_size(options.max_shard_size, name="max_shard_size"))
    report = _report(stack, shards, output_dir)
    if options.dry_run:
        report["dry_run"] = True
    else:

        def fill(temp: Path) -> None:
            _write(copies, checkpoints, shards, temp, stack.dtype)
            _finish(stack, shards, temp, report)
            report["timings"] = {"total_seconds": time.perf_counter() - started}
            reporting.write_report(temp, report, stack_card(report))

        output.write(fill)
    if options.print_summary:
        print(_summary(report))
    logger.info("%s", _summary(report))
    return report


def _write(
    copies: list[_Copy], checkpoints: list[Checkpoint], shards: list[Any], out_dir: Path, dtype: torch.dtype | None
) -> None:
    by_name = {c.task.name: c for c in copies}
    with RowReader() as reader:
        for shard in shards:
            planned = [TensorMeta(t.name, t.out_dtype, t.out_shape) for t in shard.tasks]
            ShardFile.create(out_dir / shard.file_name, planned)
            file = ShardFile(out_dir / shard.file_name, planned)
            try:
                for task in shard.tasks:
                    copy = by_name[task.name]
                    for start, stop in task.chunks():
                        rows = checkpoints[copy.model].read_rows(copy.name, reader, start, stop)
                        file.write_rows(task.name, start, _converted(rows, copy.scale, task, dtype))
                file.close()
            except BaseException:
                file.abort()
                raise


def _converted(rows: torch.Tensor, scale: float | None, task: TensorTask, dtype: torch.dtype | None) -> torch.Tensor:
    """mergekit's passthrough of one input: loaded in ``dtype``, times ``scale``, saved in ``out_dtype``."""
    if not task.floating:
        return rows
    rows = rows if dtype is None else rows.to(dtype)
    return (rows if scale is None else rows * scale).to(task.out_dtype)


def _finish(stack: LayerStack, shards: list[Any], out_dir: Path, report: dict[str, Any]) -> None:
    """Index, config (the layer count and per-layer lists of the output), generation config, tokenizer."""
    write_index(shards, out_dir)
    config = json.loads((stack.donor / "config.json").read_text())
    scope, key = layer_count_key(config) or ({}, "")
    old, scope[key] = scope[key], len(stack.layers)
    kinds = scope.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == old:  # transformers checks one entry per layer
        sources = [json.loads((p / "config.json").read_text()) for p in stack.models]
        scope["layer_types"] = [
            (layer_count_key(sources[s.model]) or ({}, ""))[0].get("layer_types", kinds)[s.layer] for s in stack.layers
        ]
    if stack.out_dtype is not None:
        dtype_key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
        config[dtype_key] = str(stack.out_dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (stack.donor / "generation_config.json").is_file():
        shutil.copy2(stack.donor / "generation_config.json", out_dir / "generation_config.json")
    if not copy_tokenizer(stack.donor, out_dir):
        report["warnings"].append(f"no tokenizer files found in {stack.donor}")
    elif stack.chat_template is not None:
        write_chat_template(out_dir, stack.chat_template)


def _report(stack: LayerStack, shards: list[Any], output_dir: Path) -> dict[str, Any]:
    slices = [
        {**s, "path": str(stack.models[stack.references.index(s["model"])])}
        | ({"hub": h} if (h := describe(stack.models[stack.references.index(s["model"])], s["model"])) else {})
        for s in stack.slices
    ]
    inputs = [stack.donor_reference, *stack.references]
    paths = [stack.donor, *stack.models]
    return {
        "ram_trl_version": ram_trl.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "merge_method": "passthrough",
        "method_pretty_name": "Passthrough (layer stacking)",
        "base_model": str(stack.donor),
        **({"base_hub": hub} if (hub := describe(stack.donor, stack.donor_reference)) else {}),
        "card_inputs": list(dict.fromkeys(reporting.hub_name(r, p) for r, p in zip(inputs, paths, strict=True))),
        "output_dir": str(output_dir),
        "num_hidden_layers": len(stack.layers),
        "slices": slices,
        "output": {
            "dtype": str(stack.out_dtype).removeprefix("torch.") if stack.out_dtype else "as stored",
            "files": [s.file_name for s in shards],
            "bytes": sum(s.nbytes for s in shards),
            "tensors": sum(len(s.tasks) for s in shards),
        },
        "warnings": list(stack.notes),
        "config": stack.raw,
    }


def _summary(report: dict[str, Any]) -> str:
    parts = ", ".join(f"{s['model']} {s['layer_range']}" for s in report["slices"])
    verb = "would write" if report.get("dry_run") else "wrote"
    return (
        f"passthrough: {report['num_hidden_layers']} layers ({parts}) -> {report['output_dir']}: {verb} "
        f"{report['output']['tensors']} tensors, {format_bytes(report['output']['bytes'])}"
    )


def stack_card(report: dict[str, Any]) -> str:
    """The model card of a stacked model: the Hub's merge convention, the slices, the config."""
    front = {
        "base_model": report["card_inputs"],
        "base_model_relation": "merge",
        "library_name": "transformers",
        "tags": ["merge", "ram_trl", "passthrough"],
    }
    lines = [
        f"# {report['config'].get('name') or 'Stacked model'}: passthrough",
        "",
        f"The decoder layers of these models stacked into {report['num_hidden_layers']} layers with ram_trl "
        f"{report['ram_trl_version']} (mergekit's passthrough; tensors copied, not merged):",
        "",
        "| output layers | model | its layers |",
        "|---|---|---|",
        *(
            f"| {s['output_layers'][0]}-{s['output_layers'][1] - 1} | `{s['model']}` | "
            f"{s['layer_range'][0]}-{s['layer_range'][1] - 1} |"
            for s in report["slices"]
        ),
    ]
    lines += reporting.warnings_and_config_lines(report)
    return reporting.front_matter(front) + "\n" + "\n".join(lines) + "\n" + reporting.upload_lines()
