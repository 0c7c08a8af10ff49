"""The passes of a merge over its inputs: the statistics pass and the merge-and-write pass, chunk by chunk.

Both take the run's :class:`~ram_trl.context.RunContext` (config, inputs, plan, state, device, reader) and stream
this process's share of the tensors (``run.tasks``):

- :func:`statistics_pass` counts, per agent, the active / unique / shared elements of every floating tensor (the
  global statistics of RAM+ and RAM+s), into ``run.state``;
- :func:`write_tensors` merges every tensor a row chunk at a time with the method's kernel (its ``merge`` hook, after
  its ``prepare_tensor`` and ``scan`` hooks where it has them) and writes the rows into the output shards already
  created in the temporary output directory; methods without a statistics pass have their counts taken here.

One chunk is in flight ahead of the one being finished: its blocks are queued on the compute pool before the previous
chunk's results are awaited (and written in the background). The engine never names a method: every
method-specific step is one of the method's hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ram_trl import counting
from ram_trl.config import ResolvedConfig
from ram_trl.context import RunContext
from ram_trl.errors import NonFiniteError
from ram_trl.io.checkpoint import Checkpoint
from ram_trl.io.prefetch import BackgroundWriter
from ram_trl.io.safetensors_io import PlannedTensor, ShardFile
from ram_trl.methods import ChunkInputs
from ram_trl.parallel import compute_pool, map_blocks, submit_blocks
from ram_trl.planner import ShardPlan, TensorTask
from ram_trl.statistics import MAX_SUBSET_AGENTS, OverlapStatistics, subset_counts
from ram_trl.streaming import (
    RawChunk,
    compute_blocks,
    fill_delta,
    fill_weights,
    iter_chunks,
    read_agent_rows,
    statistics_blocks,
    to_deltas,
)

_NEGATIVE_ZERO_BITS = -(2**31)  # float32 -0.0 viewed as int32


def planned_tensors(shard: ShardPlan) -> list[PlannedTensor]:
    """The header entries of one output shard."""
    return [PlannedTensor(t.name, t.out_dtype, t.out_shape) for t in shard.tasks]


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(None, total=total, desc=desc, unit="tensor", dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------------------------
# Statistics


def method_factors(run: RunContext, stats: OverlapStatistics) -> list[float]:
    """The method's per-agent factors from overlap statistics (its ``factors`` hook).

    Args:
        run: The run (its method and parameters).
        stats: The overlap counts the factors are computed from (global, or one tensor's).

    Returns:
        One factor per agent (RAM+'s ``lambda_t``).
    """
    method = run.resolved.method
    assert method.factors is not None
    return method.factors(stats, run.resolved.params)


def statistics_pass(run: RunContext) -> None:
    """Count shared/unique/active elements of every agent over this process's floating tensors (``run.tasks``)
    into ``run.state`` (global, and per tensor for tensor-local methods)."""
    resolved, state, device = run.resolved, run.state, run.device
    base, agents, reader = run.base, run.agents, run.require_reader()
    eps = run.eps
    per_tensor = resolved.method.tensor_local_statistics(resolved.params)
    floating = [t for t in run.tasks if t.floating]
    bar = _progress(len(floating), "statistics", run.progress)
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
        flags = torch.gt(deltas.abs_(), counting.float32_threshold(eps), out=deltas)  # active_flags, in place
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


# ---------------------------------------------------------------------------------------------------------------
# Per-tensor preparation


class TensorInputs:
    """One whole tensor of the inputs, for a method's ``prepare_tensor`` hook (a
    :class:`~ram_trl.methods.base.TensorView`, which documents its methods).

    Args:
        run: The run.
        task: The tensor.
        params: The method's parameters for this tensor.
        pool: The compute pool (``None``: compute on this thread).
    """

    def __init__(
        self, run: RunContext, task: TensorTask, params: dict[str, Any], pool: ThreadPoolExecutor | None
    ) -> None:
        self.name = task.name
        self.shape = tuple(task.base.shape)
        self.numel = task.base.numel
        self.num_agents = len(run.agents)
        self.params = params
        self.seed = run.resolved.seed
        self._run, self._task, self._pool = run, task, pool
        self._base: torch.Tensor | None = None

    def agent_value(self, t: int, parameter: str) -> float:
        resolved = self._run.resolved
        return resolved.agent_value(resolved.agents[t], parameter, self.name)

    def base(self) -> torch.Tensor:
        if self._base is None:
            rows = self._run.base.read_rows(self.name, self._run.require_reader())
            self._base = rows.to(device=self._run.device, dtype=torch.float32).reshape(-1)
        return self._base

    def _agent_rows(self, t: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        reader = self._run.require_reader()
        return read_agent_rows(self._run.agents[t], self._task, t, reader, 0, self._task.base_rows)

    def model(self, t: int) -> torch.Tensor:
        values, lora = self._agent_rows(t)
        out = torch.empty_like(self.base())
        fill_weights(out, values, lora, self.base())
        return out

    def magnitudes(self, t: int) -> tuple[torch.Tensor, int]:
        base_values = self.base()
        values, lora = self._agent_rows(t)
        magnitudes = torch.empty_like(base_values)
        nonzero = fill_magnitudes(magnitudes, values, lora, base_values, self._pool)
        return magnitudes, nonzero

    def map_blocks(self, fn: Callable[[Any], Any], items) -> list[Any]:
        return map_blocks(self._pool, fn, items)


def fill_magnitudes(
    out: torch.Tensor,
    values: torch.Tensor | None,
    lora: torch.Tensor | None,
    base_values: torch.Tensor,
    pool: ThreadPoolExecutor | None,
) -> int:
    """``|tau|`` of one agent's whole tensor into ``out`` (flat), in blocks on ``pool`` when there is one (the
    blocks of the TIES histograms, :data:`ram_trl.counting.HISTOGRAM_BLOCK`).

    Args:
        out: Float32, flat, the tensor's length: receives the magnitudes.
        values: The agent's stored values of the tensor (``None`` where it stores none, e.g. a LoRA agent).
        lora: The agent's LoRA delta of the tensor, or ``None``.
        base_values: The base's float32 values, flat.
        pool: The compute pool (``None``: one block on this thread).

    Returns:
        The number of nonzero magnitudes (NaN counts as nonzero).
    """
    numel = out.numel()
    flat_values = None if values is None else values.reshape(-1)
    flat_lora = None if lora is None else lora.reshape(-1)
    block = counting.HISTOGRAM_BLOCK if pool is not None else max(numel, 1)

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
class TensorContext:
    """Per-tensor inputs of the merge pass: parameters, factors, the method's preparation, the running scan."""

    params: dict[str, Any]
    agent_params: dict[str, torch.Tensor]
    factors: list[float] | None
    prepared: Any
    ordered: bool
    seen: list[int]
    stats: OverlapStatistics | None

    def add_counts(self, counts: OverlapStatistics | None) -> None:
        """Add a block's overlap counts (methods without a statistics pass count while merging)."""
        if counts is not None:
            assert self.stats is not None
            self.stats.add(counts)


def tensor_factors(run: RunContext, task: TensorTask) -> list[float] | None:
    """The method's per-agent factors for one tensor: global, tensor-local, or none.

    Args:
        run: The run (its method, parameters and the statistics gathered in ``run.state``).
        task: The tensor.

    Returns:
        One factor per agent, or ``None`` for a method without statistics.
    """
    method = run.resolved.method
    if not method.needs_statistics:
        return None
    if method.tensor_local_statistics(run.resolved.params):
        return method_factors(run, run.state.tensor_stats[task.name])
    return run.state.lambdas


def tensor_context(
    run: RunContext, task: TensorTask, pool: ThreadPoolExecutor | None = None
) -> TensorContext:
    """Prepare one tensor for the merge pass (its parameters, factors and the method's ``prepare_tensor``).

    Args:
        run: The run.
        task: The tensor.
        pool: The compute pool the method's ``prepare_tensor`` hook may use (default ``None``: this thread).

    Returns:
        The tensor's context; it counts overlaps while merging (``stats``) when the method has no statistics pass.
    """
    resolved = run.resolved
    method = resolved.method
    agent_params = agent_parameter_values(resolved, task.name, run.device)
    params = resolved.params_for(task.name)
    prepared = None
    if method.prepare_tensor is not None and task.floating:
        view = TensorInputs(run, task, params, pool)
        prepared = method.prepare_tensor(view)
        del view
    count_inline = task.floating and not method.needs_statistics
    return TensorContext(
        params=params,
        agent_params=agent_params,
        factors=tensor_factors(run, task),
        prepared=prepared,
        ordered=method.scan is not None and prepared is not None,
        seen=[0] * (len(run.agents) * method.scan_width),
        stats=OverlapStatistics.zeros(len(run.agents)) if count_inline else None,
    )


def agent_parameter_values(
    resolved: ResolvedConfig, tensor_name: str, device: torch.device
) -> dict[str, torch.Tensor]:
    """The per-agent numbers of the method for one tensor (:attr:`ChunkInputs.agent_params`): each a float32
    tensor of shape ``(num_agents,)`` on ``device``, filter rules resolved.

    Args:
        resolved: The merge config (its method and agents).
        tensor_name: The tensor the filter rules are matched against.
        device: Where the tensors are put.

    Returns:
        Each per-agent float parameter of the method by name.
    """
    return {
        p.name: torch.tensor(
            [resolved.agent_value(a, p.name, tensor_name) for a in resolved.agents],
            dtype=torch.float32,
            device=device,
        )
        for p in resolved.method.parameters
        if p.scope == "agent" and p.kind is float
    }


# ---------------------------------------------------------------------------------------------------------------
# Merge and write


def write_tensors(run: RunContext, out_dir: Path) -> None:
    """Merge this process's tensors (``run.tasks``) and write them into the output files already created in
    ``out_dir``; adds the bytes written (and the inline overlap counts) to ``run.state``.

    Args:
        run: The run (its plan fixes which shard file each tensor goes to).
        out_dir: The temporary output directory holding the shard files.

    Raises:
        NonFiniteError: for NaN/Inf inputs or merged values that overflow (unless ``allow_nonfinite``); the shard
            files are aborted on any error.
    """
    state, plan = run.state, run.plan
    shard_of = {t.name: shard for shard in plan.shards for t in shard.tasks}
    files: dict[str, ShardFile] = {}
    bar = _progress(len(run.tasks), "merge", run.progress)
    background = BackgroundWriter(depth=2)
    try:
        current: TensorTask | None = None
        context: TensorContext | None = None
        # one chunk in flight ahead: its blocks are queued before the previous chunk's are awaited and written
        pending: tuple[RawChunk, TensorContext, Callable[[], torch.Tensor]] | None = None

        def complete(job: tuple[RawChunk, TensorContext, Callable[[], torch.Tensor]], done: bool) -> None:
            chunk, job_context, result = job
            shard = shard_of[chunk.task.name]
            if shard.file_name not in files:
                files[shard.file_name] = ShardFile(out_dir / shard.file_name, planned_tensors(shard))
            background.submit(files[shard.file_name].write_rows, chunk.task.name, chunk.start, result())
            if done:  # the job held its tensor's last chunk
                _finish_tensor(run, job_context, bar)

        with compute_pool(run.device) as pool:
            chunks = iter_chunks(
                run.base,
                run.agents,
                run.tasks,
                run.require_reader(),
                floating_only=False,
                counter=state.read,
                fishers=plan.fishers,
            )
            for chunk in chunks:
                task = chunk.task
                if task is not current:
                    current = task
                    context = tensor_context(run, task, pool)
                    if bar is not None:
                        bar.set_postfix_str(task.name[-40:], refresh=False)
                assert context is not None
                started = (chunk, context, start_chunk(run, chunk, context, pool))
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


def _finish_tensor(run: RunContext, context: TensorContext | None, bar) -> None:
    if context is None:
        return
    if context.stats is not None:
        run.state.stats.add(context.stats)
    if bar is not None:
        bar.update(1)


def start_chunk(
    run: RunContext, chunk: RawChunk, context: TensorContext, pool: ThreadPoolExecutor | None = None
) -> Callable[[], torch.Tensor]:
    """Start merging one chunk; the returned function waits for it and returns the chunk's output values (in the
    output dtype, on the CPU).

    Blocks of methods without a ``scan`` hook are queued on ``pool`` and return at once, so that the caller can
    start the next chunk before this one is done; the returned function adds the chunk's overlap counts to
    ``context``, so call it in chunk order. Everything else is computed before returning.

    Args:
        run: The run.
        chunk: The chunk (rows of one tensor, as read).
        context: Its tensor's context (:func:`tensor_context`).
        pool: The compute pool the chunk's blocks run on (default ``None``: this thread).

    Returns:
        A function that waits for the chunk and returns its output values (shape of its rows, output dtype, CPU):
        non-floating tensors copied, rows past the base's averaged (:func:`extra_rows`), the rest merged.
    """
    task = chunk.task
    shape = (chunk.stop - chunk.start, *task.base.shape[1:]) if task.base.shape else ()
    if not task.floating:
        assert chunk.base is not None
        copied = chunk.base.to(task.out_dtype)
        return lambda: copied
    if chunk.extra_rows:
        extra = extra_rows(chunk, shape, run.agents, run.resolved.allow_nonfinite)
        return lambda: extra
    blocks = compute_blocks(chunk, run.device)
    if len(blocks) == 1 and (not context.ordered or pool is None):
        parallel = pool if not context.ordered else None

        def single(block: RawChunk) -> tuple[torch.Tensor, OverlapStatistics | None]:
            return merge_block(run, block, context)

        wait_single = submit_blocks(parallel, single, blocks)

        def finish_single() -> torch.Tensor:
            ((merged, counts),) = wait_single()
            context.add_counts(counts)
            return merged.reshape(shape).cpu()

        return finish_single
    out = torch.empty(shape, dtype=task.out_dtype)  # host
    flat = out.reshape(-1)
    scan = run.resolved.method.scan
    if context.ordered and pool is not None:
        assert scan is not None

        # the method's kernel needs counts of the tensor's earlier blocks (TIES: its ties at the cut, ranked in flat
        # order): scan every block first (in parallel), so that each knows what came before it, then merge the
        # blocks in parallel
        def prepare(block: RawChunk) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
            deltas, base_values = to_deltas(
                block, run.device, run.base, run.agents, run.require_reader(), run.checked
            )
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

    def run_block(item: tuple[RawChunk, tuple[torch.Tensor, torch.Tensor] | None, list[int] | None]):
        block, ready, seen = item
        lo = (block.start - chunk.start) * task.row_numel
        hi = (block.stop - chunk.start) * task.row_numel
        _, counts = merge_block(run, block, context, ready, seen, flat[lo:hi])
        return counts

    wait = submit_blocks(parallel, run_block, work)

    def finish() -> torch.Tensor:
        for counts in wait():
            context.add_counts(counts)
        return out

    return finish


def merge_block(
    run: RunContext,
    chunk: RawChunk,
    context: TensorContext,
    ready: tuple[torch.Tensor, torch.Tensor] | None = None,
    seen: list[int] | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, OverlapStatistics | None]:
    """The flat output values of a block of the base's rows, in the output dtype, on ``run.device``, and its overlap
    counts (methods without a statistics pass count them while merging).

    Args:
        run: The run.
        chunk: The block.
        context: Its tensor's context.
        ready: The block's task vectors and base values if they are already computed.
        seen: The method's scan counts of the tensor's blocks before this one (default: the tensor's running
            count, which the kernel updates).
        out: A flat tensor of the output dtype the values are written into (and returned) instead of a new one.

    Returns:
        The merged values (flat) and the block's overlap counts (``None`` unless ``context`` counts while merging).
    """
    resolved = run.resolved
    task = chunk.task
    if ready is None:
        # the statistics pass has already refused non-finite inputs
        ready = to_deltas(chunk, run.device, run.base, run.agents, run.require_reader(), run.checked)
    deltas, base_values = ready
    counts = None
    if context.stats is not None:
        counts = OverlapStatistics.zeros(len(run.agents))
        counts.update(counting.active_flags(deltas, run.eps))
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
        fishers=None if chunk.fishers is None else chunk.fishers.to(run.device),
        models=_models(chunk, base_values) if method.merges_weights else None,
    )
    return kernel_output(resolved, inputs, task.out_dtype, (chunk.start, chunk.stop), out), counts


def kernel_output(
    resolved: ResolvedConfig,
    inputs: ChunkInputs,
    out_dtype: torch.dtype,
    rows: tuple[int, int],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the method's kernel on one block and return the merged weights in ``out_dtype``: the merged task vector
    added to the base (signed zeros kept), overflow refused, rounded to ``out_dtype`` as ``Tensor.to`` rounds.

    Args:
        resolved: The merge config (its method and ``allow_nonfinite``).
        inputs: The block's kernel inputs.
        out_dtype: The output tensor's dtype.
        rows: The block's rows ``(start, stop)`` (or flat elements, for a flat range), for error messages.
        out: A flat tensor of ``out_dtype`` the values are written into (and returned) instead of a new one.

    Returns:
        The merged weights of the block, flat.

    Raises:
        NonFiniteError: if the merged values overflow float32 (or float16 for a float16 output).
    """
    method = resolved.method
    merged = method.merge(inputs)
    if not method.merges_weights:
        merged.add_(inputs.base)
        keep_signed_zeros(merged, inputs.base)
    if not resolved.allow_nonfinite:
        check_finite_output(merged, inputs.name, *rows)
    result = merged.to(out_dtype) if out is None else out.copy_(merged)  # copy_ rounds as .to() does
    if out_dtype == torch.float16 and not resolved.allow_nonfinite:  # the one narrower range than float32
        check_finite_output(result, inputs.name, *rows, " in float16 (|x| > 65504)")
    return result


def keep_signed_zeros(merged: torch.Tensor, base_values: torch.Tensor) -> None:
    """Give merged elements that are zero where the base is zero the base's own zero (``-0.0`` stays ``-0.0``).

    ``base + 0.0`` turns a base ``-0.0`` into ``+0.0``; every other sum is already the base's bits where nothing
    changed. One integer reduction per block; the fix-up runs only in blocks whose base holds a ``-0.0``.

    Args:
        merged: The block's merged weights, modified in place.
        base_values: The block's base values (only float32 blocks are fixed up).
    """
    if base_values.dtype != torch.float32 or int(base_values.view(torch.int32).min()) != _NEGATIVE_ZERO_BITS:
        return  # -0.0 is the smallest int32 bit pattern: no -0.0 in this block
    zero = (merged == 0) & (base_values == 0)
    torch.where(zero, base_values, merged, out=merged)


def check_finite_output(merged: torch.Tensor, name: str, start: int, stop: int, where: str = "") -> None:
    """Refuse merged values that overflowed (every input was finite: the parameters scaled them too far).

    One sum per block decides; the values are counted only when it is not finite.

    Args:
        merged: The block's merged values.
        name: The tensor's name, for the message.
        start: The block's first row (or flat element), for the message.
        stop: One past its last, for the message.
        where: Says in what the values overflow (default ``""``: float32).

    Raises:
        NonFiniteError: if a merged value is NaN or infinite.
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


def extra_rows(
    chunk: RawChunk, shape: tuple[int, ...], agents: list[Checkpoint], allow_nonfinite: bool
) -> torch.Tensor:
    """Rows past the base's (a resized vocabulary): the mean of the agents that have each row.

    Args:
        chunk: A chunk of rows past the base's.
        shape: The chunk's output shape.
        agents: The agents (their roles name an agent in the error).
        allow_nonfinite: Merge NaN/Inf values instead of refusing them.

    Returns:
        The rows in the output dtype.

    Raises:
        NonFiniteError: if an agent's rows hold NaN/Inf and ``allow_nonfinite`` is off.
    """
    total = torch.zeros(shape, dtype=torch.float32)  # host
    count = torch.zeros((shape[0],) + (1,) * (len(shape) - 1), dtype=torch.float32)  # host
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


__all__ = [
    "TensorContext",
    "agent_parameter_values",
    "kernel_output",
    "TensorInputs",
    "check_finite_output",
    "keep_signed_zeros",
    "merge_block",
    "start_chunk",
    "statistics_pass",
    "tensor_context",
    "write_tensors",
]
