"""Merges of flat element ranges in memory, one agent per process (docs/distributed.md, docs/merge-preview.md)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ram_trl.digest import hasher, update_tensor
from ram_trl.distributed import DistContext
from ram_trl.errors import ConfigError, NonFiniteError
from ram_trl.io.checkpoint import Checkpoint
from ram_trl.io.safetensors_io import RowReader
from ram_trl.merging.config.settings import ResolvedConfig
from ram_trl.merging.context import open_inputs, run_eps
from ram_trl.merging.passes.epilogue import kernel_output
from ram_trl.merging.passes.tensors import agent_parameter_values
from ram_trl.merging.planner import TensorTask, build_plan
from ram_trl.merging.streaming import fill_delta, fill_weights, read_agent_rows
from ram_trl.methods import ChunkInputs, MergeMethod
from ram_trl.statistics import OverlapStatistics
from ram_trl.statistics.counting import active_flags

BLOCK_ELEMENTS = 1 << 20  #: Elements of a range merged at once (every agent's float32 task vectors held).

__all__ = ["BLOCK_ELEMENTS", "FlatRange", "RangeMerge", "check_range_method", "merge_ranges"]


@dataclass(frozen=True)
class FlatRange:
    """Elements ``[offset, offset + values.numel())`` of one flattened tensor of the in-memory agent."""

    name: str
    offset: int
    values: torch.Tensor
    counted: bool = True


@dataclass
class RangeMerge:
    """The result of :func:`merge_ranges` on this process."""

    values: list[torch.Tensor]
    factors: list[float] | None
    stats: OverlapStatistics | None
    digest: str
    tensor_factors: dict[str, list[float]] = field(default_factory=dict)


def check_range_method(method: MergeMethod) -> None:
    """Refuse a method that cannot merge flat ranges of partitioned parameters."""
    if method.prepare_tensor is not None or method.scan is not None or method.needs_fisher:
        what = "Fisher inputs" if method.needs_fisher else "whole tensors (a per-tensor preparation)"
        raise ConfigError(
            f"merge method {method.name!r} needs {what}, which a partitioned model (DeepSpeed ZeRO-3) does not hold "
            "on any one process; a partition-local merge supports the methods whose kernel works element by element "
            "with global statistics: ram, ram_plus, ram_plus_soft, task_arithmetic, linear, dare_linear, dare_ties"
        )


@dataclass
class _Inputs:
    """What a range merge's blocks read: config, checkpoints, base tensors, the in-memory agent, device, reader."""

    resolved: ResolvedConfig
    base: Checkpoint
    agents: list[Checkpoint]
    tasks: dict[str, TensorTask]
    current: int
    device: torch.device
    reader: RowReader


def merge_ranges(
    resolved: ResolvedConfig,
    current: int,
    ranges: Sequence[FlatRange],
    ctx: DistContext,
    *,
    device: str | torch.device = "cpu",
    block_elements: int = BLOCK_ELEMENTS,
) -> RangeMerge:
    """Merge this process's flat ranges of agent ``current`` (held in memory) with the other agents and the base."""
    method = resolved.method
    check_range_method(method)
    if not 0 <= current < len(resolved.agents):
        raise ConfigError(f"agent index {current} is not one of the config's {len(resolved.agents)} agents")
    base, agents = open_inputs(resolved, allow_pickle=False)
    plan = build_plan(
        base,
        agents,
        out_dtype=resolved.out_dtype,
        shape_mismatch="error",
        needs_statistics=method.needs_statistics,
        trims_by_magnitude=False,
        merges_weights=method.merges_weights,
    )
    tasks = {t.name: t for t in plan.tasks if t.floating}
    _check_coverage(ranges, tasks, ctx)
    with RowReader() as reader:
        inputs = _Inputs(resolved, base, agents, tasks, current, torch.device(device), reader)
        factors: list[float] | None = None
        stats: OverlapStatistics | None = None
        tensor_factors: dict[str, list[float]] = {}
        if method.needs_statistics:
            stats, per_tensor = _statistics(inputs, ranges, ctx, block_elements)
            assert method.factors is not None
            factors = method.factors(stats, resolved.params)
            tensor_factors = {n: method.factors(s, resolved.params) for n, s in per_tensor.items()}
        values = [_merge_range(inputs, r, factors, tensor_factors, block_elements) for r in ranges]
    digest = hasher()
    for part in ctx.gather_objects(_range_digest(ranges, values)):
        digest.update(part.encode())
    return RangeMerge(values, factors, stats, digest.hexdigest(), tensor_factors)


def _check_coverage(ranges: Sequence[FlatRange], tasks: dict[str, TensorTask], ctx: DistContext) -> None:
    counted: dict[str, int] = {}
    for r in ranges:
        task = tasks.get(r.name)
        if task is None:
            raise ConfigError(
                f"tensor {r.name!r} of the in-memory agent is not a floating tensor of the base checkpoint; the agent "
                "was not trained from this base"
            )
        if r.values.dim() != 1 or r.offset < 0 or r.offset + r.values.numel() > task.base.numel:
            raise ConfigError(
                f"tensor {r.name!r}: the range [{r.offset}, {r.offset + r.values.numel()}) is not inside its "
                f"{task.base.numel} elements (shape {tuple(task.base.shape)} in the base)"
            )
        if not r.values.dtype.is_floating_point:
            raise ConfigError(f"tensor {r.name!r}: the in-memory agent's values are {r.values.dtype}, not floating")
        if r.counted:
            counted[r.name] = counted.get(r.name, 0) + r.values.numel()
    totals: dict[str, int] = {}
    for part in ctx.gather_objects(counted):
        for name, numel in part.items():
            totals[name] = totals.get(name, 0) + numel
    wrong = [n for n, t in tasks.items() if totals.get(n, 0) != t.base.numel]
    if wrong:
        name = wrong[0]
        raise ConfigError(
            f"tensor {name!r}: the processes' ranges hold {totals.get(name, 0)} of its {tasks[name].base.numel} "
            f"elements ({len(wrong)} floating tensors of the base are not covered exactly once); a partition-local "
            "merge needs every floating tensor of the base as a parameter of the model"
        )


def _blocks(r: FlatRange, task: TensorTask, block_elements: int) -> Iterator[tuple[int, int]]:
    """Flat ``[lo, hi)`` blocks of a range, whole rows of at most ``block_elements`` elements (at least one row)."""
    row = task.row_numel
    step = max(row, block_elements // row * row)
    end = r.offset + r.values.numel()
    lo = r.offset
    while lo < end:
        hi = min(end, (lo // row) * row + step)
        yield lo, hi
        lo = hi


def _block_inputs(inputs: _Inputs, r: FlatRange, task: TensorTask, lo: int, hi: int):
    """Float32 task vectors ``(num_agents, hi - lo)``, base values and (for weight-merging methods) the agents'
    weights of elements ``[lo, hi)`` of ``task``."""
    row = task.row_numel
    start, stop = lo // row, -(-hi // row)
    window = slice(lo - start * row, hi - start * row)
    base_rows = inputs.base.read_rows(task.name, inputs.reader, start, stop)
    whole_base = base_rows.to(device=inputs.device, dtype=torch.float32).reshape(-1)
    base_values = whole_base[window]
    method = inputs.resolved.method
    deltas = torch.empty((len(inputs.agents), hi - lo), dtype=torch.float32, device=inputs.device)
    models = torch.empty_like(deltas) if method.merges_weights else None
    full: torch.Tensor | None = None
    for t, agent in enumerate(inputs.agents):
        if t == inputs.current:
            own = r.values[lo - r.offset : hi - r.offset].to(device=inputs.device, dtype=torch.float32)
            torch.sub(own, base_values, out=deltas[t])
            if models is not None:
                models[t].copy_(own)
            continue
        values, lora = read_agent_rows(agent, task, t, inputs.reader, start, stop)
        if full is None:
            full = torch.empty_like(whole_base)
        fill_delta(full, values, lora, whole_base)
        deltas[t].copy_(full[window])
        if models is not None:
            fill_weights(full, values, lora, whole_base)
            models[t].copy_(full[window])
    if not inputs.resolved.allow_nonfinite and not math.isfinite(float(deltas.sum())):
        bad = next(t for t in range(len(inputs.agents)) if not bool(torch.isfinite(deltas[t]).all()))
        raise NonFiniteError(
            f"{_role(inputs, bad)}: tensor {task.name!r} holds NaN/Inf values (or its base does) in elements "
            f"[{lo}, {hi}); set allow_nonfinite: true in the config to merge anyway"
        )
    return deltas, base_values.contiguous(), models


def _role(inputs: _Inputs, t: int) -> str:
    spec = inputs.resolved.agents[t]
    if t == inputs.current:
        return f"agent {spec.index} ({spec.name}, the in-memory policy)"
    return inputs.agents[t].role


def _statistics(
    inputs: _Inputs, ranges: Sequence[FlatRange], ctx: DistContext, block_elements: int
) -> tuple[OverlapStatistics, dict[str, OverlapStatistics]]:
    """The global overlap statistics (and per tensor, for tensor-local factors), summed over the processes."""
    resolved = inputs.resolved
    eps = run_eps(resolved)
    per_tensor = resolved.method.tensor_local_statistics(resolved.params)
    num_agents = len(inputs.agents)
    names = sorted(inputs.tasks)
    index = {n: i for i, n in enumerate(names)}
    # one row per tensor: histogram and pairwise counts, flattened, so one all-reduce sums them all
    width = num_agents * (num_agents + 1) + num_agents * num_agents
    table = torch.zeros((len(names), width + 1), dtype=torch.int64)  # host
    for r in ranges:
        if not r.counted:
            continue
        task = inputs.tasks[r.name]
        counts = OverlapStatistics.zeros(num_agents)
        for lo, hi in _blocks(r, task, block_elements):
            deltas, _, _ = _block_inputs(inputs, r, task, lo, hi)
            counts.update(active_flags(deltas, eps))
        row = table[index[r.name]]
        row[: num_agents * (num_agents + 1)] += counts.histogram.reshape(-1)
        row[num_agents * (num_agents + 1) : width] += counts.pairwise.reshape(-1)
        row[width] += counts.numel
    ctx.all_reduce_sum(table)
    total = OverlapStatistics.zeros(num_agents)
    tensors: dict[str, OverlapStatistics] = {}
    for name in names:
        row = table[index[name]]
        stats = OverlapStatistics(
            num_agents,
            row[: num_agents * (num_agents + 1)].reshape(num_agents, num_agents + 1).clone(),
            row[num_agents * (num_agents + 1) : width].reshape(num_agents, num_agents).clone(),
            int(row[width]),
        )
        total.add(stats)
        if per_tensor:
            tensors[name] = stats
    return total, tensors


def _merge_range(
    inputs: _Inputs,
    r: FlatRange,
    factors: list[float] | None,
    tensor_factors: dict[str, list[float]],
    block_elements: int,
) -> torch.Tensor:
    resolved = inputs.resolved
    task = inputs.tasks[r.name]
    out = torch.empty(r.values.numel(), dtype=task.out_dtype)  # host
    params = resolved.params_for(task.name)
    agent_params = agent_parameter_values(resolved, task.name, inputs.device)
    row = task.row_numel
    for lo, hi in _blocks(r, task, block_elements):
        deltas, base_values, models = _block_inputs(inputs, r, task, lo, hi)
        chunk = ChunkInputs(
            name=task.name,
            start=lo,
            deltas=deltas,
            base=base_values,
            params=params,
            agent_params=agent_params,
            factors=tensor_factors.get(task.name, factors),
            seed=resolved.seed,
            models=models,
        )
        merged = kernel_output(resolved, chunk, task.out_dtype, (lo // row, -(-hi // row)))
        out[lo - r.offset : hi - r.offset].copy_(merged.cpu())
    return out


def _range_digest(ranges: Sequence[FlatRange], values: list[torch.Tensor]) -> str:
    digest = hasher()
    for r, merged in zip(ranges, values, strict=True):
        update_tensor(digest, f"{r.name}|{r.offset}|{str(merged.dtype).removeprefix('torch.')}|", merged)
    return digest.hexdigest()
