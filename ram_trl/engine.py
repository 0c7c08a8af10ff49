"""The streaming merge engine: read -> statistics -> merge -> write, one row chunk at a time.

:func:`merge` validates the config and every input header, plans the work, runs a statistics pass when the method
needs global overlap counts (RAM+, RAM+s), then merges chunk by chunk into a temporary sibling of the output
directory, which is renamed into place only when everything (shards, index, config, tokenizer, model card, report)
has been written.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ram_trl import report as reporting
from ram_trl.config import AgentSpec, MergeConfig, ResolvedConfig, load_config, resolve_config
from ram_trl.distributed import DistContext, partition_by_bytes
from ram_trl.errors import CheckpointError, NonFiniteError
from ram_trl.io.checkpoint import TOKENIZER_FILES, Checkpoint, open_checkpoint
from ram_trl.io.fisher_files import (
    check_fisher_headers,
    default_fisher_path,
    fisher_itemsize,
    fisher_nbytes,
    open_fisher,
)
from ram_trl.io.prefetch import BackgroundWriter
from ram_trl.io.safetensors_io import PlannedTensor, RowReader, ShardFile, dtype_itemsize
from ram_trl.methods import ChunkInputs
from ram_trl.methods.ram import DEFAULT_EPS, active_flags, float32_threshold
from ram_trl.methods.ties import HISTOGRAM_BLOCK
from ram_trl.output import OutputDir, guard_os_errors
from ram_trl.parallel import compute_pool, map_blocks, submit_blocks
from ram_trl.planner import (
    DEFAULT_CHUNK_BUDGET,
    DEFAULT_MAX_SHARD_SIZE,
    MergePlan,
    ShardPlan,
    TensorTask,
    build_plan,
    parse_size,
)
from ram_trl.statistics import MAX_SUBSET_AGENTS, OverlapStatistics, subset_counts
from ram_trl.streaming import (
    RawChunk,
    ReadCounter,
    compute_blocks,
    fill_delta,
    fill_weights,
    iter_chunks,
    read_agent_rows,
    statistics_blocks,
    to_deltas,
)
from ram_trl.validation import check_device, check_model_config, check_weight_sums, is_vocabulary_tensor

logger = logging.getLogger(__name__)

REPORT_FILE = "ram_merge_report.json"
_NEGATIVE_ZERO_BITS = -(2**31)  # float32 -0.0 viewed as int32
DENSE_AGENT_WARNING = 0.99


@dataclass
class MergeOptions:
    """Run options (the CLI flags), separate from what is merged (the config).

    Args:
        overwrite: Replace an existing output directory.
        dry_run: Plan and print, write nothing.
        max_shard_size: Largest output file, e.g. ``"5GB"``.
        device: Where the arithmetic runs (``"cpu"`` or ``"cuda"``); reads and writes stay on the CPU.
        allow_pickle: Accept ``pytorch_model*.bin`` inputs.
        chunk_budget: Bytes allowed for one chunk's buffers, e.g. ``"256MB"``.
        progress: Show progress bars.
        allow_external_shards: Accept checkpoint index files naming shards outside their directory.
    """

    overwrite: bool = False
    dry_run: bool = False
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE
    device: str = "cpu"
    allow_pickle: bool = False
    chunk_budget: str | int = DEFAULT_CHUNK_BUDGET
    progress: bool = True
    allow_external_shards: bool = False


@dataclass
class MergeState:
    """What the passes accumulate: global and per-tensor overlap statistics, cuts, warnings."""

    stats: OverlapStatistics
    tensor_stats: dict[str, OverlapStatistics] = field(default_factory=dict)
    lambdas: list[float] | None = None
    warnings: list[str] = field(default_factory=list)
    read: ReadCounter = field(default_factory=ReadCounter)
    bytes_written: int = 0


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
) -> dict[str, Any]:
    """Merge a base model and N agents into one model directory.

    Args:
        config: A merge config: a YAML path, a dict, or a :class:`~ram_trl.config.MergeConfig`.
        output_dir: Where the merged model goes. Must not exist unless ``overwrite``.
        overwrite: Replace an existing ``output_dir`` (only once the new one is complete).
        dry_run: Validate and plan, print the plan, and return it without reading tensor data.
        max_shard_size: Largest output safetensors file.
        device: ``"cpu"`` or ``"cuda"`` for the arithmetic.
        allow_pickle: Accept pickle checkpoints (loaded with ``torch.load(weights_only=True)``).
        chunk_budget: Bytes allowed for one chunk's buffers; bounds peak memory (see :mod:`ram_trl.planner`).
        progress: Show progress bars.
        output_format: ``"full"`` (a model directory) or ``"lora"`` (a PEFT LoRA adapter on the base: the SVD of
            each merged delta, see :mod:`ram_trl.lora_export`).
        lora_rank: With ``"lora"``: the rank of every LoRA module.
        lora_max_rank: With ``"lora"`` and ``lora_energy``: the largest rank of a module.
        lora_energy: With ``"lora"``: per module, the smallest rank keeping this share (0, 1] of the squared
            singular values of its delta (at most ``lora_max_rank``).
        allow_external_shards: Accept index files (``model.safetensors.index.json``) whose shards resolve outside
            their checkpoint directory (refused by default).

    Returns:
        The merge report (also written to ``output_dir/ram_merge_report.json``): method, parameters, per-agent
        statistics and lambda_t, output files, timings (with ``"lora"``, also a ``lora_export`` section). With
        ``dry_run``, the plan.

    Raises:
        ConfigError: for an invalid config (before any tensor is read).
        CheckpointError: for missing, corrupt or mismatched inputs (before any tensor is written where possible).
        NonFiniteError: for NaN/Inf values in an input, unless the config allows them.
    """
    from ram_trl.lora_export import lora_options, run_lora_merge

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
    )
    check_device(device)
    parsed, config_path = load_config(config)
    resolved = resolve_config(parsed, config_path)
    if lora is not None:
        return run_lora_merge(resolved, Path(output_dir), options, lora)
    return run_merge(resolved, Path(output_dir), options)


def open_inputs(
    resolved: ResolvedConfig, allow_pickle: bool, allow_external_shards: bool = False
) -> tuple[Checkpoint, list[Checkpoint]]:
    """Open the base and every agent (headers only; the base's ``config.json`` is validated too)."""
    base = open_checkpoint(
        resolved.base_path,
        f"base model ({resolved.base_path})",
        allow_pickle=allow_pickle,
        allow_external_shards=allow_external_shards,
    )
    if base.config_path is not None:
        check_model_config(base.config_path, base.role)
    agents = [
        open_checkpoint(
            agent.path,
            f"agent {agent.index} ({agent.name}, {agent.path})",
            allow_pickle=allow_pickle,
            allow_external_shards=allow_external_shards,
        )
        for agent in resolved.agents
    ]
    return base, agents


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
    if not options.dry_run:
        output_for(resolved, output_dir, options.overwrite).check()
    base, agents = open_inputs(resolved, options.allow_pickle, options.allow_external_shards)
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
        chunk_budget=parse_size(options.chunk_budget),
        max_shard_size=parse_size(options.max_shard_size),
        fisher_itemsize=max((fisher_itemsize(f) for f in fishers), default=0) if fishers else 0,
        resizable=is_vocabulary_tensor,
        merges_weights=resolved.method.merges_weights,
        prepare_bytes=resolved.method.prepare_bytes,
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
    """Open every agent's Fisher file (its ``fisher`` parameter, else ``fisher.safetensors`` beside it); the
    report then names the file each agent's Fisher came from."""
    fishers = []
    for spec in resolved.agents:
        where = spec.parameters.get("fisher") or default_fisher_path(spec.path)
        fisher = open_fisher(where, f"agent {spec.index} ({spec.name})", spec.path)
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


def run_merge(resolved: ResolvedConfig, output_dir: Path, options: MergeOptions) -> dict[str, Any]:
    """Run a resolved merge (see :func:`merge`), over all processes when launched with accelerate or torchrun."""
    ctx = DistContext.from_env(options.device)
    try:
        return _run_merge(resolved, output_dir, options, ctx)
    finally:
        ctx.close()


def _run_merge(
    resolved: ResolvedConfig, output_dir: Path, options: MergeOptions, ctx: DistContext
) -> dict[str, Any]:
    started = time.perf_counter()
    base, agents, plan = ctx.guarded(lambda: prepare(resolved, output_dir, options))
    if options.dry_run:
        summary = reporting.plan_summary(resolved, plan)
        if ctx.is_main:
            reporting.print_plan(resolved, plan)
        return summary

    owned = partition_by_bytes([task_input_bytes(t, agents) for t in plan.tasks], ctx.world_size)[ctx.rank]
    tasks = [plan.tasks[i] for i in owned]
    progress = options.progress and ctx.is_main
    state = MergeState(stats=OverlapStatistics.zeros(len(agents)))
    device = ctx.device(options.device)
    timings: dict[str, float] = {}
    with RowReader() as reader:
        if resolved.method.needs_statistics:
            tick = time.perf_counter()
            ctx.guarded(
                lambda: statistics_pass(resolved, base, agents, plan, reader, state, device, progress, tasks)
            )
            _reduce_statistics(ctx, state)
            timings["statistics_seconds"] = time.perf_counter() - tick
            state.lambdas = _factors(resolved, state.stats)
            check_densities(resolved, state, ctx.is_main)

        output = output_for(resolved, output_dir, options.overwrite)
        temp = ctx.guarded(lambda: str(output.begin()) if ctx.is_main else None)
        temp_dir = Path(ctx.broadcast_object(temp))
        report: dict[str, Any] | None = None
        try:
            with guard_os_errors(f"output directory {output_dir}"):
                ctx.guarded(lambda: _create_shards(plan, temp_dir) if ctx.is_main else None)
                tick = time.perf_counter()
                ctx.guarded(
                    lambda: write_tensors(
                        resolved, base, agents, plan, tasks, temp_dir, reader, state, device, progress
                    )
                )
                written = ctx.all_reduce_int(state.bytes_written)
                if written != plan.output_bytes:
                    raise RuntimeError(
                        f"{temp_dir}: {written} of {plan.output_bytes} tensor bytes were written"
                    )
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
        except BaseException:
            if ctx.is_main:
                output.abort()
            raise
    if ctx.is_main:
        reporting.print_summary(report)
    assert report is not None
    return report


def task_input_bytes(task: TensorTask, agents: list[Checkpoint]) -> int:
    """Bytes of one tensor in the base and every agent (what :func:`~ram_trl.distributed.partition_by_bytes`
    balances over processes)."""
    total = task.base.numel * dtype_itemsize(task.base.dtype)
    if task.floating:
        total += sum(
            a.tensors[task.name].numel * dtype_itemsize(a.tensors[task.name].dtype)
            for a in agents
            if task.name in a.tensors
        )
    return total


def _reduce_statistics(ctx: DistContext, state: MergeState) -> None:
    """Sum every rank's counts; gather per-tensor statistics (tensor-local rho) for the report."""
    if not ctx.enabled:
        return
    ctx.all_reduce_sum(state.stats.histogram)
    ctx.all_reduce_sum(state.stats.pairwise)
    state.stats.numel = ctx.all_reduce_int(state.stats.numel)
    if state.tensor_stats:
        merged: dict[str, OverlapStatistics] = {}
        for part in ctx.gather_objects(state.tensor_stats):
            merged.update(part)
        state.tensor_stats = merged


def _create_shards(plan: MergePlan, temp_dir: Path) -> None:
    for shard in plan.shards:
        ShardFile.create(temp_dir / shard.file_name, _planned(shard))


def _planned(shard: ShardPlan) -> list[PlannedTensor]:
    return [PlannedTensor(t.name, t.out_dtype, t.out_shape) for t in shard.tasks]


# ---------------------------------------------------------------------------------------------------------------
# Passes


def _progress(iterable, total: int, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="tensor", dynamic_ncols=True)


def _eps(resolved: ResolvedConfig) -> float:
    return float(resolved.params.get("eps", DEFAULT_EPS))


def statistics_pass(
    resolved: ResolvedConfig,
    base: Checkpoint,
    agents: list[Checkpoint],
    plan: MergePlan,
    reader: RowReader,
    state: MergeState,
    device: torch.device,
    progress: bool,
    tasks: list[TensorTask] | None = None,
) -> None:
    """Count shared/unique/active elements of every agent over the given tensors (default: all)."""
    eps = _eps(resolved)
    per_tensor = resolved.method.tensor_local_statistics(resolved.params)
    tasks = plan.tasks if tasks is None else tasks
    floating = [t for t in tasks if t.floating]
    bar = _progress(None, len(floating), "statistics", progress) if progress else None
    by_subsets = len(agents) <= MAX_SUBSET_AGENTS
    current: OverlapStatistics | None = None
    current_task: TensorTask | None = None
    subsets: torch.Tensor | None = (
        None  # the current tensor's subset counts so far (converted once, at its end)
    )
    numel = 0

    def finish() -> None:
        if current is None or current_task is None:
            return
        if subsets is not None:
            current.add_subset_counts(subsets, numel)
        state.stats.add(current)
        if per_tensor:
            state.tensor_stats[current_task.name] = current
        if bar is not None:
            bar.update(1)

    def count(block: RawChunk) -> torch.Tensor | OverlapStatistics:
        deltas, _ = to_deltas(block, device, base, agents, reader, resolved.allow_nonfinite)
        flags = torch.gt(deltas.abs_(), float32_threshold(eps), out=deltas)  # active_flags, in place
        if by_subsets:
            return subset_counts(flags)
        counts = OverlapStatistics.zeros(len(agents))
        counts.update(flags)
        return counts

    def absorb(chunk: RawChunk, results: list[torch.Tensor | OverlapStatistics]) -> None:
        nonlocal current, current_task, subsets, numel
        if chunk.task is not current_task:
            finish()
            current, current_task = OverlapStatistics.zeros(len(agents)), chunk.task
            subsets, numel = None, 0
        assert current is not None
        for counts in results:
            if isinstance(counts, OverlapStatistics):
                current.add(counts)
            else:
                subsets = counts if subsets is None else subsets.add_(counts)
        numel += (chunk.stop - chunk.start) * chunk.task.row_numel

    with compute_pool(device) as pool:
        # one chunk in flight ahead: its blocks are queued before the previous chunk's results are awaited
        pending: tuple[RawChunk, Callable[[], list[torch.Tensor | OverlapStatistics]]] | None = None
        for chunk in iter_chunks(base, agents, floating, reader, counter=state.read):
            started = (
                chunk,
                submit_blocks(pool, count, statistics_blocks(chunk, device)),
            )
            if pending is not None:
                absorb(pending[0], pending[1]())
            pending = started
        if pending is not None:
            absorb(pending[0], pending[1]())
    finish()
    if bar is not None:
        bar.close()


class _TensorInputs:
    """One whole tensor of the inputs, for a method's ``prepare_tensor`` hook (a
    :class:`~ram_trl.methods.registry.TensorView`)."""

    def __init__(
        self,
        resolved: ResolvedConfig,
        task: TensorTask,
        params: dict[str, Any],
        base: Checkpoint,
        agents: list[Checkpoint],
        reader: RowReader,
        device: torch.device,
        pool: ThreadPoolExecutor | None,
    ) -> None:
        self.name = task.name
        self.shape = tuple(task.base.shape)
        self.numel = task.base.numel
        self.num_agents = len(agents)
        self.params = params
        self.seed = resolved.seed
        self._resolved, self._task, self._base_checkpoint, self._agents = resolved, task, base, agents
        self._reader, self._device, self._pool = reader, device, pool
        self._base: torch.Tensor | None = None

    def agent_value(self, t: int, parameter: str) -> float:
        return self._resolved.agent_value(self._resolved.agents[t], parameter, self.name)

    def base(self) -> torch.Tensor:
        if self._base is None:
            rows = self._base_checkpoint.read_rows(self.name, self._reader)
            self._base = rows.to(device=self._device, dtype=torch.float32).reshape(-1)
        return self._base

    def model(self, t: int) -> torch.Tensor:
        values, lora = read_agent_rows(self._agents[t], self._task, t, self._reader, 0, self._task.base_rows)
        out = torch.empty_like(self.base())
        fill_weights(out, values, lora, self.base())
        return out

    def magnitudes(self, t: int) -> tuple[torch.Tensor, int]:
        base_values = self.base()
        values, lora = read_agent_rows(self._agents[t], self._task, t, self._reader, 0, self._task.base_rows)
        magnitudes = torch.empty_like(base_values)
        nonzero = _fill_magnitudes(magnitudes, values, lora, base_values, self._pool)
        return magnitudes, nonzero

    def map_blocks(self, fn: Callable[[Any], Any], items) -> list[Any]:
        return map_blocks(self._pool, fn, items)


def _fill_magnitudes(
    out: torch.Tensor,
    values: torch.Tensor | None,
    lora: torch.Tensor | None,
    base_values: torch.Tensor,
    pool: ThreadPoolExecutor | None,
) -> int:
    """``|tau|`` of one agent's whole tensor into ``out`` (flat), in blocks on ``pool`` when there is one.

    Returns:
        The number of nonzero magnitudes (NaN counts as nonzero).
    """
    numel = out.numel()
    flat_values = None if values is None else values.reshape(-1)
    flat_lora = None if lora is None else lora.reshape(-1)
    block = HISTOGRAM_BLOCK if pool is not None else max(numel, 1)

    def fill(lo: int) -> int:
        hi = min(numel, lo + block)
        part = out[lo:hi]
        fill_delta(part, _flat_slice(flat_values, lo, hi), _flat_slice(flat_lora, lo, hi), base_values[lo:hi])
        return int(torch.count_nonzero(part.abs_()))

    return sum(map_blocks(pool, fill, range(0, max(numel, 1), block)))


def _flat_slice(values: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """Elements ``lo:hi`` of a flat tensor, ``None`` when it has none of them (a shorter agent tensor)."""
    if values is None or values.numel() <= lo:
        return None
    return values[lo:hi]


@dataclass
class _TensorContext:
    """Per-tensor inputs of the merge pass: parameters, factors, the method's preparation, the running scan."""

    params: dict[str, Any]
    agent_params: dict[str, torch.Tensor]
    factors: list[float] | None
    prepared: Any
    ordered: bool
    seen: list[int]
    stats: OverlapStatistics | None


def _tensor_context(
    resolved: ResolvedConfig,
    task: TensorTask,
    base: Checkpoint,
    agents: list[Checkpoint],
    reader: RowReader,
    state: MergeState,
    device: torch.device,
    pool: ThreadPoolExecutor | None = None,
) -> _TensorContext:
    method = resolved.method
    agent_params = {
        p.name: torch.tensor(
            [resolved.agent_value(a, p.name, task.name) for a in resolved.agents],
            dtype=torch.float32,
            device=device,
        )
        for p in method.parameters
        if p.scope == "agent" and p.kind is float
    }
    params = resolved.params_for(task.name)
    prepared = None
    if method.prepare_tensor is not None and task.floating:
        view = _TensorInputs(resolved, task, params, base, agents, reader, device, pool)
        prepared = method.prepare_tensor(view)
        del view
    count_inline = task.floating and not method.needs_statistics
    return _TensorContext(
        params=params,
        agent_params=agent_params,
        factors=_tensor_factors(resolved, task, state),
        prepared=prepared,
        ordered=method.scan is not None and prepared is not None,
        seen=[0] * (len(agents) * method.scan_width),
        stats=OverlapStatistics.zeros(len(agents)) if count_inline else None,
    )


def write_tensors(
    resolved: ResolvedConfig,
    base: Checkpoint,
    agents: list[Checkpoint],
    plan: MergePlan,
    tasks: list[TensorTask],
    out_dir: Path,
    reader: RowReader,
    state: MergeState,
    device: torch.device,
    progress: bool,
) -> None:
    """Merge ``tasks`` and write them into the output files already created in ``out_dir``."""
    eps = _eps(resolved)
    shard_of = {t.name: shard for shard in plan.shards for t in shard.tasks}
    files: dict[str, ShardFile] = {}
    bar = _progress(None, len(tasks), "merge", progress) if progress else None
    background = BackgroundWriter(depth=2)
    try:
        current: TensorTask | None = None
        context: _TensorContext | None = None
        # one chunk in flight ahead: its blocks are queued before the previous chunk's are awaited and written
        pending: tuple[RawChunk, _TensorContext, Callable[[], torch.Tensor]] | None = None

        def complete(job: tuple[RawChunk, _TensorContext, Callable[[], torch.Tensor]], done: bool) -> None:
            chunk, job_context, result = job
            shard = shard_of[chunk.task.name]
            if shard.file_name not in files:
                files[shard.file_name] = ShardFile(out_dir / shard.file_name, _planned(shard))
            background.submit(files[shard.file_name].write_rows, chunk.task.name, chunk.start, result())
            if done:  # the job held its tensor's last chunk
                _finish_tensor(state, job_context, bar)

        with compute_pool(device) as pool:
            chunks = iter_chunks(
                base, agents, tasks, reader, floating_only=False, counter=state.read, fishers=plan.fishers
            )
            for chunk in chunks:
                task = chunk.task
                if task is not current:
                    current = task
                    context = _tensor_context(resolved, task, base, agents, reader, state, device, pool)
                    if bar is not None:
                        bar.set_postfix_str(task.name[-40:], refresh=False)
                assert context is not None
                started = (
                    chunk,
                    context,
                    _start_chunk(resolved, chunk, context, base, agents, reader, device, eps, pool),
                )
                if pending is not None:
                    complete(pending, done=pending[1] is not context)
                pending = started
            if pending is not None:
                complete(pending, done=True)
        background.close()
        for file in files.values():
            file.close()
            state.bytes_written += file.bytes_written
    except BaseException:
        background.abort()
        for file in files.values():
            file.abort()
        raise
    finally:
        if bar is not None:
            bar.close()


def _finish_tensor(state: MergeState, context: _TensorContext | None, bar) -> None:
    if context is None:
        return
    if context.stats is not None:
        state.stats.add(context.stats)
    if bar is not None:
        bar.update(1)


def _start_chunk(
    resolved: ResolvedConfig,
    chunk: RawChunk,
    context: _TensorContext,
    base: Checkpoint,
    agents: list[Checkpoint],
    reader: RowReader,
    device: torch.device,
    eps: float,
    pool: ThreadPoolExecutor | None = None,
) -> Callable[[], torch.Tensor]:
    """Start merging one chunk; the returned function waits for it and returns the chunk's output values (in the
    output dtype, on the CPU).

    Blocks of methods without a ``scan`` hook are queued on ``pool`` and return at once, so that the caller can
    start the next chunk before this one is done; the returned function adds the chunk's overlap counts to
    ``context``, so call it in chunk order. Everything else is computed before returning.
    """
    task = chunk.task
    shape = (chunk.stop - chunk.start, *task.base.shape[1:]) if task.base.shape else ()
    if not task.floating:
        assert chunk.base is not None
        copied = chunk.base.to(task.out_dtype)
        return lambda: copied
    if chunk.extra_rows:
        extra = _extra_rows(chunk, shape, agents, resolved.allow_nonfinite)
        return lambda: extra
    blocks = compute_blocks(chunk, device)
    if len(blocks) == 1 and (not context.ordered or pool is None):
        parallel = pool if not context.ordered else None

        def single(block: RawChunk) -> tuple[torch.Tensor, OverlapStatistics | None]:
            return _merge_block(resolved, block, context, base, agents, reader, device, eps)

        wait_single = submit_blocks(parallel, single, blocks)

        def finish_single() -> torch.Tensor:
            ((merged, counts),) = wait_single()
            _add_counts(context, counts)
            return merged.reshape(shape).cpu()

        return finish_single
    out = torch.empty(shape, dtype=task.out_dtype)
    flat = out.reshape(-1)
    checked = resolved.allow_nonfinite or resolved.method.needs_statistics
    scan = resolved.method.scan
    if context.ordered and pool is not None:
        assert scan is not None

        # the method's kernel needs counts of the tensor's earlier blocks (TIES: its ties at the cut, ranked in flat
        # order): scan every block first (in parallel), so that each knows what came before it, then merge the
        # blocks in parallel
        def prepare(block: RawChunk) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
            deltas, base_values = to_deltas(block, device, base, agents, reader, checked)
            return deltas, base_values, scan(deltas, context.prepared)

        prepared = map_blocks(pool, prepare, blocks)
        seen = []
        for _, _, counts in prepared:
            seen.append(list(context.seen))
            context.seen[:] = [a + b for a, b in zip(context.seen, counts, strict=True)]
        work = [
            (block, ready[:2], before) for block, ready, before in zip(blocks, prepared, seen, strict=True)
        ]
        del prepared
        parallel = pool
    elif context.ordered:
        work = [(block, None, None) for block in blocks]
        parallel = None  # in order on this thread, the kernel counting on context.seen
    else:
        work = [(block, None, None) for block in blocks]
        parallel = pool

    def run(item: tuple[RawChunk, tuple[torch.Tensor, torch.Tensor] | None, list[int] | None]):
        block, ready, seen = item
        lo = (block.start - chunk.start) * task.row_numel
        hi = (block.stop - chunk.start) * task.row_numel
        _, counts = _merge_block(
            resolved, block, context, base, agents, reader, device, eps, ready, seen, flat[lo:hi]
        )
        return counts

    wait = submit_blocks(parallel, run, work)

    def finish() -> torch.Tensor:
        for counts in wait():
            _add_counts(context, counts)
        return out

    return finish


def _add_counts(context: _TensorContext, counts: OverlapStatistics | None) -> None:
    if counts is not None:
        assert context.stats is not None
        context.stats.add(counts)


def _merge_block(
    resolved: ResolvedConfig,
    chunk: RawChunk,
    context: _TensorContext,
    base: Checkpoint,
    agents: list[Checkpoint],
    reader: RowReader,
    device: torch.device,
    eps: float,
    ready: tuple[torch.Tensor, torch.Tensor] | None = None,
    seen: list[int] | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, OverlapStatistics | None]:
    """The flat output values of a block of the base's rows, in the output dtype, on ``device``, and its overlap
    counts (methods without a statistics pass count them while merging).

    ``ready`` holds the block's task vectors and base values if they are already computed; ``seen`` the method's
    scan counts of the tensor's blocks before this one (default: the tensor's running count, which the kernel
    updates); ``out`` a flat tensor of the output dtype the values are written into (and returned) instead of a
    new one.
    """
    task = chunk.task
    if ready is None:
        # the statistics pass has already refused non-finite inputs
        checked = resolved.allow_nonfinite or resolved.method.needs_statistics
        ready = to_deltas(chunk, device, base, agents, reader, checked)
    deltas, base_values = ready
    counts = None
    if context.stats is not None:
        counts = OverlapStatistics.zeros(len(agents))
        counts.update(active_flags(deltas, eps))
    method = resolved.method
    inputs = ChunkInputs(
        name=task.name,
        start=chunk.start * task.row_numel,
        deltas=deltas,
        base=base_values,
        params=context.params,
        agent_params=context.agent_params,
        factors=context.factors,
        prepared=context.prepared,
        seen=context.seen if seen is None else seen,
        seed=resolved.seed,
        fishers=None if chunk.fishers is None else chunk.fishers.to(device),
        models=_models(chunk, base_values) if method.merges_weights else None,
    )
    merged = method.merge(inputs)
    if not method.merges_weights:
        merged.add_(base_values)
        keep_signed_zeros(merged, base_values)
    if not resolved.allow_nonfinite:
        check_finite_output(merged, task.name, chunk.start, chunk.stop)
    result = merged.to(task.out_dtype) if out is None else out.copy_(merged)  # copy_ rounds as .to() does
    if (
        task.out_dtype == torch.float16 and not resolved.allow_nonfinite
    ):  # the one narrower range than float32
        check_finite_output(result, task.name, chunk.start, chunk.stop, " in float16 (|x| > 65504)")
    return result, counts


def keep_signed_zeros(merged: torch.Tensor, base_values: torch.Tensor) -> None:
    """Give merged elements that are zero where the base is zero the base's own zero (``-0.0`` stays ``-0.0``).

    ``base + 0.0`` turns a base ``-0.0`` into ``+0.0``; every other sum is already the base's bits where nothing
    changed. One integer reduction per block; the fix-up runs only in blocks whose base holds a ``-0.0``.
    """
    if base_values.dtype != torch.float32 or int(base_values.view(torch.int32).min()) != _NEGATIVE_ZERO_BITS:
        return  # -0.0 is the smallest int32 bit pattern: no -0.0 in this block
    zero = (merged == 0) & (base_values == 0)
    torch.where(zero, base_values, merged, out=merged)


def check_finite_output(merged: torch.Tensor, name: str, start: int, stop: int, where: str = "") -> None:
    """Refuse merged values that overflowed (every input was finite: the parameters scaled them too far).

    One sum per block decides; the values are counted only when it is not finite.
    """
    if math.isfinite(float(merged.sum(dtype=torch.float32))):
        return
    bad = int((~torch.isfinite(merged)).sum())
    if bad:
        raise NonFiniteError(
            f"tensor {name!r}: {bad} merged values overflow{where or ' float32'} (rows {start}:{stop}); the inputs "
            "are finite, so the weights / lambda / r scale the task vectors too far (or the output dtype is too "
            "narrow): use smaller values or another out_dtype"
        )


def _extra_rows(
    chunk: RawChunk, shape: tuple[int, ...], agents: list[Checkpoint], allow_nonfinite: bool
) -> torch.Tensor:
    """Rows past the base's (a resized vocabulary): the mean of the agents that have each row."""
    total = torch.zeros(shape, dtype=torch.float32)
    count = torch.zeros((shape[0],) + (1,) * (len(shape) - 1), dtype=torch.float32)
    for raw, lora, agent in zip(chunk.agents, chunk.lora, agents, strict=True):
        if raw is None:
            continue
        rows = raw.shape[0]
        values = raw.to(torch.float32)
        if lora is not None:
            values += lora.reshape(values.shape)
        if not allow_nonfinite and not bool(torch.isfinite(values).all()):
            raise NonFiniteError(
                f"{agent.role}: tensor {chunk.task.name!r} holds NaN/Inf values in the rows it adds past the base's "
                f"(rows {chunk.start}:{chunk.start + rows}); set allow_nonfinite: true in the config to merge anyway"
            )
        total[:rows] += values
        count[:rows] += 1
    return (total / count).to(chunk.task.out_dtype)


def _models(chunk: RawChunk, base_values: torch.Tensor) -> torch.Tensor:
    """The agents' float32 weights of a block of the base's rows, shape ``(num_agents, n)``."""
    models = torch.empty(
        (len(chunk.agents), base_values.numel()), dtype=torch.float32, device=base_values.device
    )
    for t, (values, lora) in enumerate(zip(chunk.agents, chunk.lora, strict=True)):
        fill_weights(models[t], values, lora, base_values)
    return models


def _factors(resolved: ResolvedConfig, stats: OverlapStatistics) -> list[float]:
    """The method's per-agent factors from overlap statistics (its ``factors`` hook)."""
    assert resolved.method.factors is not None
    return resolved.method.factors(stats, resolved.params)


def _tensor_factors(resolved: ResolvedConfig, task: TensorTask, state: MergeState) -> list[float] | None:
    if not resolved.method.needs_statistics:
        return None
    if resolved.method.tensor_local_statistics(resolved.params):
        return _factors(resolved, state.tensor_stats[task.name])
    return state.lambdas


def check_densities(resolved: ResolvedConfig, state: MergeState, emit: bool = True) -> None:
    """Warn about agents whose task vector is zero, or differs from the base almost everywhere (another base?).

    Args:
        resolved: The merge config.
        state: The accumulated overlap statistics; the warnings are appended to ``state.warnings``.
        emit: Also raise them as Python warnings and log them (the main process only).
    """
    for t, agent in enumerate(resolved.agents):
        density = state.stats.density(t)
        if state.stats.active(t) == 0:
            message = (
                f"agent {agent.index} ({agent.name}): its task vector is zero at eps={_eps(resolved):g} "
                "(identical to the base: density 0); it contributes nothing"
            )
        elif density > DENSE_AGENT_WARNING:
            message = (
                f"agent {agent.index} ({agent.name}): {density:.2%} of its elements differ from the base; "
                "is it derived from this base model (same checkpoint, same dtype)?"
            )
        else:
            continue
        state.warnings.append(message)
        if emit:
            warnings.warn(message, stacklevel=2)
            logger.warning(message)


# ---------------------------------------------------------------------------------------------------------------
# Output


def finalize_output(
    resolved: ResolvedConfig, base: Checkpoint, plan: MergePlan, out_dir: Path, report: dict[str, Any]
) -> None:
    """Write the index (sharded outputs), config, generation config, tokenizer, model card and report."""
    if len(plan.shards) > 1:
        index = {
            "metadata": {"total_size": plan.output_bytes},
            "weight_map": {t.name: s.file_name for s in plan.shards for t in s.tasks},
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_model_config(resolved, base, plan, out_dir)
    base_dir = resolved.base_path if resolved.base_path.is_dir() else resolved.base_path.parent
    generation = base_dir / "generation_config.json"
    if generation.is_file():
        shutil.copy2(generation, out_dir / generation.name)
    copied = 0
    for name in TOKENIZER_FILES:
        source = resolved.tokenizer_source / name
        if source.is_file():
            shutil.copy2(source, out_dir / name)
            copied += 1
    if copied == 0:
        report["warnings"].append(f"no tokenizer files found in {resolved.tokenizer_source}")
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2, default=reporting.json_default) + "\n")
    (out_dir / "README.md").write_text(reporting.model_card(report))


def write_model_config(resolved: ResolvedConfig, base: Checkpoint, plan: MergePlan, out_dir: Path) -> None:
    """Copy the base's ``config.json`` with the output dtype and any resized vocabulary."""
    if base.config_path is None:
        warnings.warn(
            f"base model {resolved.base_path} has no config.json; the output has none either", stacklevel=2
        )
        return
    config = json.loads(base.config_path.read_text())
    if resolved.out_dtype is not None:
        dtype_name = str(resolved.out_dtype).removeprefix("torch.")
        key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
        config[key] = dtype_name
    vocab = config.get("vocab_size")
    for name in plan.resized:
        task = next(t for t in plan.tasks if t.name == name)
        if vocab == task.base_rows:
            config["vocab_size"] = task.out_rows
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


__all__ = ["MergeOptions", "merge", "run_merge", "CheckpointError"]
