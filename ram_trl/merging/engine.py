"""The streaming merge engine (read -> statistics -> merge -> write, one row chunk at a time): validate, plan, run the
passes over this process's tensors, and finalise the output through the one commit protocol. Design:
docs/development.md ("The merge engine") and docs/architecture.md."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ram_trl.distributed import DistContext, partition_by_bytes
from ram_trl.errors import ConfigError
from ram_trl.io.checkpoint import Checkpoint, copy_tokenizer, write_chat_template
from ram_trl.io.fisher_files import (
    check_fisher_headers,
    default_fisher_path,
    fisher_itemsize,
    fisher_nbytes,
    open_fisher,
)
from ram_trl.io.hub import cached_revision, needs_weights
from ram_trl.io.safetensors_io import RowReader, ShardFile
from ram_trl.io.vocabulary import is_vocabulary_tensor
from ram_trl.merging import report as reporting
from ram_trl.merging.config.resolve import resolve_config
from ram_trl.merging.config.schema import MergeConfig, load_config
from ram_trl.merging.config.settings import AgentSpec, ResolvedConfig
from ram_trl.merging.context import (
    MergeOptions,
    MergeState,
    RunContext,
    check_densities,
    open_inputs,
    task_input_bytes,
)
from ram_trl.merging.lora.export import export_lora, print_export
from ram_trl.merging.lora.svd import LoraExportOptions, lora_options
from ram_trl.merging.passes.merge import planned_tensors, write_tensors
from ram_trl.merging.passes.statistics import method_factors, statistics_pass
from ram_trl.merging.planner import (
    DEFAULT_CHUNK_BUDGET,
    DEFAULT_MAX_SHARD_SIZE,
    MergePlan,
    build_plan,
    parse_size,
    write_index,
)
from ram_trl.merging.stack import is_passthrough, stack_merge
from ram_trl.merging.streaming import InputCache, check_input_cache, input_cache_budget
from ram_trl.output import OutputDir, temp_name
from ram_trl.statistics import OverlapStatistics

REPORT_FILE = reporting.REPORT_FILE

logger = logging.getLogger(__name__)


def merge(
    config: str | os.PathLike | dict[str, Any] | MergeConfig,
    output_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    dry_run: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    device: str = "cpu",
    allow_pickle: bool = False,
    chunk_budget: str | int = DEFAULT_CHUNK_BUDGET,
    progress: bool = True,
    output_format: str = "full",
    lora_rank: int | None = None,
    lora_max_rank: int | None = None,
    lora_energy: float | None = None,
    allow_external_shards: bool = False,
    print_summary: bool = False,
    input_cache: str | int = "auto",
) -> dict[str, Any]:
    """Merge a base model and N agents into one model directory.

    A library call prints nothing (progress bars aside, see ``progress``): it logs a one-line summary through the
    ``ram_trl.merging.engine`` logger (``logging.INFO``) and returns the report; ``print_summary=True`` prints the tables
    that ``ram-trl merge`` shows.

    Args:
        config: A merge config: a YAML path, a dict, or a :class:`~ram_trl.merging.config.schema.MergeConfig`.
        output_dir: Where the merged model goes. Must not exist unless ``overwrite``.
        overwrite: Replace an existing ``output_dir`` (only once the new one is complete).
        dry_run: Validate and plan, and return the plan without reading tensor data (printed with
            ``print_summary``).
        max_shard_size: Largest output safetensors file.
        device: ``"cpu"`` or ``"cuda"`` for the arithmetic.
        allow_pickle: Accept pickle checkpoints (loaded with ``torch.load(weights_only=True)``).
        chunk_budget: Bytes allowed for one chunk's buffers; bounds peak memory (see :mod:`ram_trl.merging.planner`).
        progress: Show progress bars.
        output_format: ``"full"`` (a model directory) or ``"lora"`` (a PEFT LoRA adapter on the base: the SVD of
            each merged delta, see :mod:`ram_trl.merging.lora.export`).
        lora_rank: With ``"lora"``: the rank of every LoRA module.
        lora_max_rank: With ``"lora"`` and ``lora_energy``: the largest rank of a module.
        lora_energy: With ``"lora"``: per module, the smallest rank keeping this share (0, 1] of the squared
            singular values of its delta (at most ``lora_max_rank``).
        allow_external_shards: Accept index files (``model.safetensors.index.json``) whose shards resolve outside
            their checkpoint directory (refused by default).
        print_summary: Print the plan (dry run) or the per-agent summary table (and, with ``"lora"``, the export's)
            in the terminal, on the main process, as the command line does.
        input_cache: For methods with a statistics pass (RAM+, RAM+s): memory that may keep the inputs that pass
            read, on the compute device, so that the merge pass neither reads nor copies them again. ``"auto"``
            (default): half the free memory of an accelerator, none on the CPU; ``"off"``; or a size (``"8GB"``).
            The output is the same bytes either way.

    Returns:
        The merge report (also written to ``output_dir/ram_merge_report.json``): method, parameters, per-agent
        statistics and lambda_t, output files, timings (with ``"lora"``, also a ``lora_export`` section). With
        ``dry_run``, the plan.

    Raises:
        ConfigError: for an invalid config (before any tensor is read).
        CheckpointError: for missing, corrupt or mismatched inputs (before any tensor is written where possible).
        NonFiniteError: for NaN/Inf values in an input, unless the config allows them.
    """
    lora = lora_options(output_format, lora_rank, lora_max_rank, lora_energy)
    options = MergeOptions(
        overwrite=overwrite,
        dry_run=dry_run,
        max_shard_size=max_shard_size,
        device=device,
        allow_pickle=allow_pickle,
        chunk_budget=chunk_budget,
        progress=progress,
        allow_external_shards=allow_external_shards,
        print_summary=print_summary,
        input_cache=input_cache,
    )
    parsed, config_path = load_config(config)
    if is_passthrough(parsed):
        if lora is not None:
            raise ConfigError(
                "output_format 'lora' is an adapter on the base; passthrough writes a deeper model: use 'full'"
            )
        return stack_merge(parsed, config_path, Path(output_dir), options)
    resolved = resolve_config(parsed, config_path, allow_external_shards=allow_external_shards)
    if lora is not None:
        return run_lora_merge(resolved, Path(output_dir), options, lora)
    return run_merge(resolved, Path(output_dir), options)


def output_for(resolved: ResolvedConfig, output_dir: Path, overwrite: bool) -> OutputDir:
    """The commit protocol of a merge's output directory (a previous output holds ``ram_merge_report.json``)."""
    return OutputDir(output_dir, overwrite=overwrite, reads=resolved.inputs(), markers=(REPORT_FILE,))


def check_normalized_weights(resolved: ResolvedConfig, plan: MergePlan) -> None:
    """Refuse weights whose per-tensor sum a normalising method would divide by when it is zero."""
    if not (resolved.method.divides_by_weight_sum and resolved.params.get("normalize")):
        return
    sums = {
        t.name: sum(resolved.agent_value(a, "weight", t.name) for a in resolved.agents)
        for t in plan.tasks
        if t.floating
    }
    check_weight_sums(sums, str(resolved.source or "merge config"), resolved.method.name)


def prepare(
    resolved: ResolvedConfig, output_dir: Path, options: MergeOptions
) -> tuple[Checkpoint, list[Checkpoint], MergePlan]:
    """Everything that can fail cheaply: output checks, input headers, the plan."""
    check_device(options.device)
    check_input_cache(options.input_cache)
    if resolved.method.check is not None:
        where = str(resolved.source or "merge config")
        resolved.method.check(resolved.params, [a.name for a in resolved.agents], where)
    if not options.dry_run:
        output_for(resolved, output_dir, options.overwrite).check()
    if not options.dry_run and any(needs_weights(p) for p in [resolved.base_path, *(a.path for a in resolved.agents)]):
        _open_and_plan(resolved, options, fetch=False)  # every header checked before a weight file is fetched
    return _open_and_plan(resolved, options, fetch=not options.dry_run)


def _open_and_plan(
    resolved: ResolvedConfig, options: MergeOptions, fetch: bool
) -> tuple[Checkpoint, list[Checkpoint], MergePlan]:
    base, agents = open_inputs(resolved, options.allow_pickle, options.allow_external_shards, fetch=fetch)
    for spec, agent in zip(resolved.agents, agents, strict=True):
        spec.kind = agent.kind
        if agent.adapter is not None:
            _check_adapter_base(resolved, spec, agent)
    fishers = open_fishers(resolved) if resolved.method.needs_fisher else None
    plan = build_plan(
        base,
        agents,
        out_dtype=resolved.out_dtype,
        shape_mismatch=resolved.shape_mismatch,
        needs_statistics=resolved.method.needs_statistics,
        trims_by_magnitude=resolved.method.prepares_tensors,
        chunk_budget=parse_size(options.chunk_budget, name="chunk_budget"),
        max_shard_size=parse_size(options.max_shard_size, name="max_shard_size"),
        fisher_itemsize=max((fisher_itemsize(f) for f in fishers), default=0) if fishers else 0,
        resizable=is_vocabulary_tensor,
        merges_weights=resolved.method.merges_weights,
        prepare_bytes=resolved.method.preparation_bytes(len(agents)),
    )
    check_normalized_weights(resolved, plan)
    if fishers is not None:
        names = [t.name for t in plan.tasks if t.floating]
        for fisher, agent in zip(fishers, agents, strict=True):
            check_fisher_headers(fisher, agent, base, names)
            plan.input_bytes += fisher_nbytes(fisher, names)
        plan.fishers = fishers
    return base, agents, plan


def open_fishers(resolved: ResolvedConfig) -> list[Checkpoint]:
    """Each agent's Fisher file (``fisher`` parameter, else ``fisher.safetensors`` beside it), named in the report."""
    fishers = []
    for spec in resolved.agents:
        where = spec.parameters.get("fisher") or default_fisher_path(spec.path)
        fisher = open_fisher(where, f"agent {spec.index} ({spec.name})", str(cached_revision(spec.path) or spec.path))
        spec.parameters["fisher"] = str(fisher.files[0])
        fishers.append(fisher)
    return fishers


def _check_adapter_base(resolved: ResolvedConfig, spec: AgentSpec, agent: Checkpoint) -> None:
    """Warn when an adapter says it was trained on another base than the merge's."""
    assert agent.adapter is not None
    claimed = agent.adapter.config.get("base_model_name_or_path")
    if not claimed:
        return
    base = resolved.base_path
    same = claimed == str(base) or Path(claimed).name == base.name
    if not same and Path(claimed).exists():
        same = Path(claimed).resolve() == base.resolve()
    if not same:
        message = (
            f"agent {spec.index} ({spec.name}): the adapter's base_model_name_or_path is {claimed!r}, the merge's "
            f"base is {base}; merging it onto another base is only meaningful if the weights are the same"
        )
        resolved.notes.append(message)
        warnings.warn(message, stacklevel=3)


def run_copy(resolved: ResolvedConfig) -> ResolvedConfig:
    """The run's own copy of a validated config: what a run learns on the way (each agent's kind, the Fisher file
    each agent's Fisher came from, notes, the LoRA export's float32 output) is written into it, never into the
    caller's config, which stays as validated (and can be merged again)."""
    agents = [dataclasses.replace(a, parameters=dict(a.parameters)) for a in resolved.agents]
    return dataclasses.replace(resolved, agents=agents, notes=list(resolved.notes))


def run_merge(resolved: ResolvedConfig, output_dir: Path, options: MergeOptions) -> dict[str, Any]:
    """Run a resolved merge (see :func:`merge`), over all processes when launched with accelerate or torchrun."""
    resolved = run_copy(resolved)
    ctx = DistContext.from_env(options.device)
    try:
        return _run_merge(resolved, output_dir, options, ctx)
    finally:
        ctx.close()


def _run_merge(resolved: ResolvedConfig, output_dir: Path, options: MergeOptions, ctx: DistContext) -> dict[str, Any]:
    started = time.perf_counter()
    base, agents, plan = ctx.guarded(lambda: prepare(resolved, output_dir, options))
    if options.dry_run:
        cache = 0
        if resolved.method.needs_statistics and plan.fishers is None:  # as the run below keeps them
            budget = input_cache_budget(check_input_cache(options.input_cache), ctx.device(options.device))
            cache = min(budget, plan.input_bytes)
        summary = reporting.plan_summary(resolved, plan, cache)
        if ctx.is_main and options.print_summary:
            reporting.print_plan(resolved, plan, cache)
        return summary

    owned = partition_by_bytes([task_input_bytes(t, agents) for t in plan.tasks], ctx.world_size)[ctx.rank]
    run = RunContext(
        resolved=resolved,
        options=options,
        base=base,
        agents=agents,
        plan=plan,
        dist=ctx,
        state=MergeState(stats=OverlapStatistics.summary(len(agents))),
        device=ctx.device(options.device),
        tasks=[plan.tasks[i] for i in owned],
    )
    state = run.state
    timings: dict[str, float] = {}
    with RowReader() as run.reader:
        if resolved.method.needs_statistics:
            budget = input_cache_budget(check_input_cache(options.input_cache), run.device)
            if budget > 0 and plan.fishers is None:  # the statistics pass reads no Fisher rows to keep
                state.cache = InputCache(budget)
            tick = time.perf_counter()
            ctx.guarded(lambda: statistics_pass(run))
            _reduce_statistics(ctx, state)
            timings["statistics_seconds"] = time.perf_counter() - tick
            state.lambdas = method_factors(run, state.stats)
            check_densities(resolved, state, ctx.is_main)

        output = output_for(resolved, output_dir, options.overwrite)
        with output.shared(ctx) as temp_dir:
            ctx.guarded(lambda: _create_shards(plan, temp_dir) if ctx.is_main else None)
            tick = time.perf_counter()
            ctx.guarded(lambda: write_tensors(run, temp_dir))
            state.effect.all_reduce(ctx)
            if state.cache is not None:
                state.cache.clear()
            written = ctx.all_reduce_int(state.bytes_written)
            if written != plan.output_bytes:
                raise RuntimeError(f"{temp_dir}: {written} of {plan.output_bytes} tensor bytes were written")
            timings["merge_seconds"] = time.perf_counter() - tick
            if not resolved.method.needs_statistics:
                _reduce_statistics(ctx, state)
                check_densities(resolved, state, ctx.is_main)
            state.read.bytes = ctx.all_reduce_int(state.read.bytes)
            timings["total_seconds"] = time.perf_counter() - started

            def finish() -> dict[str, Any] | None:
                if not ctx.is_main:
                    return None
                built = reporting.build_report(resolved, plan, state, timings, output_dir)
                built["processes"] = ctx.world_size
                finalize_output(resolved, base, plan, temp_dir, built)
                output.commit()
                return built

            report = ctx.broadcast_object(ctx.guarded(finish))
    assert report is not None
    if ctx.is_main:
        if options.print_summary:
            reporting.print_summary(report)
        logger.info(
            "%s merge of %d agents -> %s: %d bytes in %d file(s) in %.1f s",
            report["merge_method"],
            len(report["agents"]),
            report["output_dir"],
            report["output"]["bytes"],
            len(report["output"]["files"]),
            report["timings"].get("total_seconds", 0.0),
        )
    return report


def run_lora_merge(
    resolved: ResolvedConfig, output_dir: Path, options: MergeOptions, lora: LoraExportOptions
) -> dict[str, Any]:
    """Merge in float32 into a temporary full model beside ``output_dir``, export it as LoRA, remove it."""
    resolved = run_copy(resolved)
    resolved.out_dtype = torch.float32  # exact deltas for the SVD (in the run's copy)
    merge_options = dataclasses.replace(options, overwrite=False)
    if options.dry_run:
        summary = run_merge(resolved, output_dir, merge_options)
        summary["output_format"] = "lora"
        summary["lora_export"] = lora.as_dict()
        return summary
    ctx = DistContext.from_env(options.device)
    try:
        output = output_for(resolved, output_dir, options.overwrite)
        ctx.guarded(lambda: output.check() if ctx.is_main else None)
        name = temp_name(output_dir, "full").name if ctx.is_main else None
        full_dir = output_dir.parent / ctx.broadcast_object(name)
        try:
            # the temporary full model is not what the user asked for: the summary names the adapter, after it
            merged_report = run_merge(resolved, full_dir, dataclasses.replace(merge_options, print_summary=False))

            def export() -> dict[str, Any] | None:
                if not ctx.is_main:
                    return None
                report = export_lora(
                    resolved.base_path,
                    full_dir,
                    output_dir,
                    rank=lora.rank,
                    max_rank=lora.max_rank,
                    energy=lora.energy,
                    report=merged_report,
                    overwrite=options.overwrite,
                    allow_pickle=options.allow_pickle,
                    progress=options.progress,
                )
                if options.print_summary:
                    reporting.print_summary(report)
                    print_export(report)
                return report

            return ctx.broadcast_object(ctx.guarded(export))
        finally:
            if ctx.is_main:
                shutil.rmtree(full_dir, ignore_errors=True)
    finally:
        ctx.close()


def _reduce_statistics(ctx: DistContext, state: MergeState) -> None:
    """Sum every rank's counts; gather per-tensor statistics (tensor-local rho) for the report."""
    if not ctx.enabled:
        return
    state.stats.all_reduce(ctx)
    if state.tensor_stats:
        merged: dict[str, OverlapStatistics] = {}
        for part in ctx.gather_objects(state.tensor_stats):
            merged.update(part)
        state.tensor_stats = merged


def _create_shards(plan: MergePlan, temp_dir: Path) -> None:
    for shard in plan.shards:
        ShardFile.create(temp_dir / shard.file_name, planned_tensors(shard))


# ---------------------------------------------------------------------------------------------------------------
# Output


def finalize_output(
    resolved: ResolvedConfig, base: Checkpoint, plan: MergePlan, out_dir: Path, report: dict[str, Any]
) -> None:
    """Write the index (sharded outputs), config, generation config, tokenizer, model card and report."""
    write_index(plan.shards, out_dir)
    write_model_config(resolved, base, plan, out_dir)
    base_dir = resolved.base_path if resolved.base_path.is_dir() else resolved.base_path.parent
    generation = base_dir / "generation_config.json"
    if generation.is_file():
        shutil.copy2(generation, out_dir / generation.name)
    if not copy_tokenizer(resolved.tokenizer_source, out_dir):
        report["warnings"].append(
            f"no tokenizer files found in {resolved.tokenizer_source}"
            + ("; chat_template not written (no tokenizer to hold it)" if resolved.chat_template else "")
        )
    elif resolved.chat_template is not None:
        write_chat_template(out_dir, resolved.chat_template)
    reporting.write_report(out_dir, report, reporting.model_card(report))


def write_model_config(resolved: ResolvedConfig, base: Checkpoint, plan: MergePlan, out_dir: Path) -> None:
    """Copy the base's ``config.json`` with the output dtype and any resized vocabulary."""
    if base.config_path is None:
        warnings.warn(f"base model {resolved.base_path} has no config.json; the output has none either", stacklevel=2)
        return
    config = json.loads(base.config_path.read_text())
    if resolved.out_dtype is not None:
        dtype_name = str(resolved.out_dtype).removeprefix("torch.")
        key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
        config[key] = dtype_name
    vocab = config.get("vocab_size")
    if resolved.union_rows is not None:  # every model's vocabulary rows were built in the union's numbering
        config["vocab_size"] = resolved.union_rows.total
    for name in plan.resized:
        task = next(t for t in plan.tasks if t.name == name)
        if vocab == task.base_rows:
            config["vocab_size"] = task.out_rows
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


__all__ = ["check_device", "check_weight_sums", "merge", "run_lora_merge", "run_merge"]


def check_weight_sums(sums: Mapping[str, float], where: str, method: str) -> None:
    """Refuse per-tensor weight sums that a normalising method would divide by: zero or not finite."""
    for tensor, total in sums.items():
        if not math.isfinite(total) or abs(total) < 1e-8:
            raise ConfigError(
                f"{where}: {method} with normalize: the agents' weights for tensor {tensor!r} sum to {total:g}, "
                "and the merge divides by that sum; change the weights (or their filter rules) or set "
                "normalize: false"
            )


def check_device(device: Any) -> torch.device:
    """A device the merge can compute on: ``cpu``, ``cuda`` or ``cuda:N`` (with CUDA available)."""
    try:
        parsed = torch.device(str(device))
    except (RuntimeError, ValueError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: unknown device; use cpu, cuda or cuda:N")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: no CUDA device is available; use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s); use cuda:0.."
            )
    return parsed
