"""The statistics pass of a merge (RAM+, RAM+s need the whole model's counts before the first write): per agent, the
active / unique / shared elements of every floating tensor into ``run.state``, the chunks kept in the input cache
within its budget for the merge pass, and the method's per-agent factors from the counts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ram_trl.merging.context import RunContext
from ram_trl.merging.planner import TensorTask
from ram_trl.merging.streaming import RawChunk, iter_chunks, statistics_blocks, to_deltas, to_device
from ram_trl.parallel import compute_pool, plan_threads, submit_blocks
from ram_trl.statistics import MAX_SUBSET_AGENTS, OverlapStatistics, counting, subset_counts


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar over ``total`` tensors for a pass (shared by both passes), or ``None`` when ``enabled`` is off."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(None, total=total, desc=desc, unit="tensor", dynamic_ncols=True)


def method_factors(run: RunContext, stats: OverlapStatistics) -> list[float]:
    """The method's per-agent factors from overlap statistics (its ``factors`` hook)."""
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
    bar = progress_bar(len(floating), "statistics", run.progress)
    by_subsets = len(agents) <= MAX_SUBSET_AGENTS
    current: OverlapStatistics | None = None
    current_task: TensorTask | None = None
    subsets: torch.Tensor | None = None  # the current tensor's subset counts so far (converted once, at its end)
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
        counts = OverlapStatistics.summary(len(agents))
        counts.update(flags)
        return counts

    def absorb(chunk: RawChunk, results: list[torch.Tensor | OverlapStatistics]) -> None:
        nonlocal current, current_task, subsets, numel
        if chunk.task is not current_task:
            finish()
            current, current_task = OverlapStatistics.summary(len(agents)), chunk.task
            subsets, numel = None, 0
        assert current is not None
        for counts in results:
            if isinstance(counts, OverlapStatistics):
                current.add(counts)
            else:
                subsets = counts if subsets is None else subsets.add_(counts)
        numel += (chunk.stop - chunk.start) * chunk.task.row_numel

    threads = plan_threads()  # how many threads, never what they compute: the counts are integers
    with compute_pool(device, threads.compute) as pool:
        # one chunk in flight ahead: its blocks are queued before the previous chunk's results are awaited
        pending: tuple[RawChunk, Callable[[], list[torch.Tensor | OverlapStatistics]]] | None = None
        chunks = iter_chunks(base, agents, floating, reader, counter=state.read, readers=threads.readers)
        for chunk in chunks:
            if state.cache is not None:  # staged on the device once, kept (within budget) for the merge pass
                chunk = to_device(chunk, device)
                state.cache.keep(chunk)
            started = (chunk, submit_blocks(pool, count, statistics_blocks(chunk, device)))
            if pending is not None:
                absorb(pending[0], pending[1]())
            pending = started
        if pending is not None:
            absorb(pending[0], pending[1]())
    finish()
    if bar is not None:
        bar.close()


__all__ = ["method_factors", "progress_bar", "statistics_pass"]
