"""Task-vector sparsity analysis: the numbers behind a choice of merge method, for N agents (docs/analysis.md)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ram_trl.analysis.inputs import AnalysisInputs, resolve_inputs
from ram_trl.analysis.measure import analysis_pass, bf16_view_agents
from ram_trl.analysis.render import JSON_FILE, print_tables, write_outputs
from ram_trl.analysis.result import build_result
from ram_trl.distributed import DistContext, partition_by_bytes
from ram_trl.io.checkpoint import Checkpoint
from ram_trl.merging.config.schema import MergeConfig
from ram_trl.merging.config.settings import ResolvedConfig
from ram_trl.merging.context import open_inputs, task_input_bytes
from ram_trl.merging.planner import DEFAULT_CHUNK_BUDGET, MergePlan, build_plan, parse_size
from ram_trl.merging.streaming import ReadCounter
from ram_trl.output import OutputDir
from ram_trl.statistics import MagnitudeStatistics, TensorAnalysis


def analyze(
    base: str | os.PathLike | None = None,
    agents: Sequence[str | os.PathLike] = (),
    out_dir: str | os.PathLike | None = None,
    eps: float | None = None,
    r: float | None = None,
    alpha: float | None = None,
    *,
    config: str | os.PathLike | dict[str, Any] | MergeConfig | None = None,
    names: Sequence[str] | None = None,
    allow_pickle: bool = False,
    chunk_budget: str | int = DEFAULT_CHUNK_BUDGET,
    figures: bool = True,
    progress: bool = True,
    print_summary: bool = False,
    allow_external_shards: bool = False,
) -> dict[str, Any]:
    """Measure the sparsity, overlap, anatomy and magnitudes of the task vectors of ``agents`` against ``base``.

    Give ``base`` and ``agents``, or a merge ``config`` (with its ``eps``, ``r`` and ``alpha`` when it has them).
    Reads every input once, chunk by chunk: memory is about ``chunk_budget`` plus 1.5 MB per agent, at any size.

    Args:
        base: The base checkpoint directory.
        agents: Agent checkpoint directories (fine-tuned from ``base``).
        out_dir: Where to write ``analysis.json``, ``analysis.md`` and the figures (a previous analysis or an empty
            directory is replaced once the new one is complete, any other is refused). ``None``: write nothing.
        eps: Activity threshold, ``|tau| > eps`` (default: the config's, else 1e-5).
        r: Rescale strength for the lambda_t of RAM+ and RAM+s (default: the config's, else 0.1).
        alpha: RAM+ clip bound of rho_t (default: the config's, else 2.0).
        config: A merge config (YAML path, dict or :class:`~ram_trl.MergeConfig`) instead of base/agents.
        names: Agent labels for the reports (default: directory names).
        allow_pickle: Accept ``pytorch_model*.bin`` checkpoints (loaded with ``torch.load(weights_only=True)``).
        chunk_budget: Bytes for one chunk's buffers, e.g. ``"256MB"``.
        figures: Write the PNG figures (needs matplotlib).
        progress: Show a progress bar while streaming.
        print_summary: Print the summary tables to the terminal (rank 0).
        allow_external_shards: Accept index files whose shards resolve outside their checkpoint directory.

    Returns:
        The analysis (``analysis.json``): per-agent densities, counts, rho_t, lambda_t, overlaps and magnitudes;
        pairwise Jaccard indices; the anatomy; per-tensor counts. Infinite values are ``"inf"``, undefined ``None``.

    Raises:
        ConfigError: for missing or contradictory arguments, missing paths, or out-of-range parameters.
        CheckpointError: for unreadable, corrupt or mismatched checkpoints (before any tensor is read).
        NonFiniteError: for NaN/Inf in an input (unless the config sets ``allow_nonfinite``).
    """
    inputs = resolve_inputs(
        base, agents, eps, r, alpha, config=config, names=names, allow_external_shards=allow_external_shards
    )
    ctx = DistContext.from_env("cpu")
    try:
        out = None if out_dir is None else Path(out_dir)
        return _run(
            AnalysisRun(
                inputs,
                out,
                ctx,
                allow_pickle=allow_pickle,
                chunk_budget=chunk_budget,
                figures=figures,
                progress=progress,
                print_summary=print_summary,
                allow_external_shards=allow_external_shards,
            )
        )
    finally:
        ctx.close()


@dataclass(frozen=True)
class AnalysisRun:
    """One analysis run: what is analysed, where it is written, this process's place, and the options."""

    inputs: AnalysisInputs
    out_dir: Path | None
    ctx: DistContext
    allow_pickle: bool = False
    chunk_budget: str | int = DEFAULT_CHUNK_BUDGET
    figures: bool = True
    progress: bool = True
    print_summary: bool = False
    allow_external_shards: bool = False


def _run(run: AnalysisRun) -> dict[str, Any]:
    inputs, out_dir, ctx = run.inputs, run.out_dir, run.ctx
    started = time.perf_counter()
    resolved = inputs.resolved
    output = None if out_dir is None else analysis_output(out_dir, resolved)
    if output is not None:
        ctx.guarded(output.check)

    def prepare() -> tuple[Checkpoint, list[Checkpoint], MergePlan]:
        base, agents = open_inputs(resolved, run.allow_pickle, run.allow_external_shards)
        plan = build_plan(
            base,
            agents,
            out_dtype=None,
            shape_mismatch="error",
            needs_statistics=False,
            trims_by_magnitude=False,
            chunk_budget=parse_size(run.chunk_budget, name="chunk_budget"),
        )
        return base, agents, plan

    base, agents, plan = ctx.guarded(prepare)
    floating = [t for t in plan.tasks if t.floating]
    owned = partition_by_bytes([task_input_bytes(t, agents) for t in floating], ctx.world_size)[ctx.rank]
    wide = bf16_view_agents(base, agents, floating)
    magnitudes = MagnitudeStatistics.zeros(len(agents))
    read = ReadCounter()
    records = ctx.guarded(
        lambda: analysis_pass(
            base,
            agents,
            [floating[i] for i in owned],
            eps=inputs.eps,
            bf16=any(wide),
            magnitudes=magnitudes,
            read=read,
            allow_nonfinite=resolved.allow_nonfinite,
            progress=run.progress and ctx.is_main,
        )
    )
    merged: dict[str, TensorAnalysis] = {}
    for part in ctx.gather_objects(records):
        merged.update(part)
    magnitudes.all_reduce(ctx)
    read.bytes = ctx.all_reduce_int(read.bytes)
    timings = {"seconds": time.perf_counter() - started}

    def finish() -> dict[str, Any] | None:
        if not ctx.is_main:
            return None
        result = build_result(
            inputs, base=base, agents=agents, tasks=floating, records=merged, magnitudes=magnitudes, wide=wide
        )
        result.update(timings=timings, bytes_read=read.bytes, processes=ctx.world_size)
        if output is not None:
            output.write(lambda temp: write_outputs(result, temp, run.figures))
        return result

    result = ctx.broadcast_object(ctx.guarded(finish))
    if run.print_summary and ctx.is_main:
        print_tables(result)
    return result


def analysis_output(out_dir: Path, resolved: ResolvedConfig) -> OutputDir:
    """An analysis directory's commit protocol: never an input; a previous analysis or empty directory is replaced."""
    return OutputDir(out_dir, reads=resolved.inputs(), markers=(JSON_FILE,), replace_previous=True)


__all__ = ["AnalysisRun", "analysis_output", "analyze"]
