"""The merge-and-write pass: every tensor merged a row chunk at a time (``prepare_tensor``, then per chunk ``scan``,
``merge`` and the epilogue) into the output shards; one chunk's blocks are queued on the compute pool before the
previous chunk's results are awaited, and rows are written in the background."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ram_trl.errors import NonFiniteError
from ram_trl.io.checkpoint import Checkpoint
from ram_trl.io.prefetch import BackgroundWriter
from ram_trl.io.safetensors_io import PlannedTensor, ShardFile
from ram_trl.merging.context import RunContext
from ram_trl.merging.passes.epilogue import kernel_output
from ram_trl.merging.passes.statistics import progress_bar
from ram_trl.merging.passes.tensors import TensorContext, tensor_context
from ram_trl.merging.planner import ShardPlan, TensorTask
from ram_trl.merging.streaming import RawChunk, compute_blocks, fill_weights, iter_chunks, to_deltas
from ram_trl.methods import ChunkInputs
from ram_trl.parallel import compute_pool, map_blocks, plan_threads, submit_blocks
from ram_trl.statistics import OverlapStatistics, counting


def planned_tensors(shard: ShardPlan) -> list[PlannedTensor]:
    return [PlannedTensor(t.name, t.out_dtype, t.out_shape) for t in shard.tasks]


def write_tensors(run: RunContext, out_dir: Path) -> None:
    """Merge this process's tensors (``run.tasks``) and write them into the output files already created in
    ``out_dir``; adds the bytes written (and the inline overlap counts) to ``run.state``."""
    state, plan = run.state, run.plan
    shard_of = {t.name: shard for shard in plan.shards for t in shard.tasks}
    files: dict[str, ShardFile] = {}
    bar = progress_bar(len(run.tasks), "merge", run.progress)
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

        threads = plan_threads()  # how many threads, never what they compute: each block writes its own rows
        with compute_pool(run.device, threads.compute) as pool:
            chunks = iter_chunks(
                run.base,
                run.agents,
                run.tasks,
                run.require_reader(),
                floating_only=False,
                counter=state.read,
                fishers=plan.fishers,
                readers=threads.readers,
                cache=state.cache,
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
    """Start merging one chunk; the returned function waits for its output values (output dtype, on the CPU)."""
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
            deltas, base_values = to_deltas(block, run.device, run.base, run.agents, run.require_reader(), run.checked)
            return deltas, base_values, scan(deltas, context.prepared)

        prepared = map_blocks(pool, prepare, blocks)
        seen = []
        for _, _, counts in prepared:
            seen.append(list(context.seen))
            context.seen[:] = [a + b for a, b in zip(context.seen, counts, strict=True)]
        work = [(block, ready[:2], before) for block, ready, before in zip(blocks, prepared, seen, strict=True)]
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
    counts (methods without a statistics pass count them while merging)."""
    resolved = run.resolved
    task = chunk.task
    if ready is None:
        # the statistics pass has already refused non-finite inputs
        ready = to_deltas(chunk, run.device, run.base, run.agents, run.require_reader(), run.checked)
    deltas, base_values = ready
    counts = None
    if context.stats is not None:
        counts = OverlapStatistics.summary(len(run.agents))
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
        agent_names=tuple(a.name for a in resolved.agents),
    )
    merged = kernel_output(resolved, inputs, task.out_dtype, (chunk.start, chunk.stop), out, run.state.effect)
    return merged, counts


def extra_rows(
    chunk: RawChunk, shape: tuple[int, ...], agents: list[Checkpoint], allow_nonfinite: bool
) -> torch.Tensor:
    """Rows past the base's (a resized vocabulary): the mean of the agents that have each row."""
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
    models = torch.empty((len(chunk.agents), base_values.numel()), dtype=torch.float32, device=base_values.device)
    for t, (values, lora) in enumerate(zip(chunk.agents, chunk.lora, strict=True)):
        fill_weights(models[t], values, lora, base_values)
    return models


__all__ = ["extra_rows", "merge_block", "planned_tensors", "start_chunk", "write_tensors"]
