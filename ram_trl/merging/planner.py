"""Merge planning: which tensors, in which row chunks, into which output shards, with what memory (docs/memory.md)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ram_trl import defaults
from ram_trl.errors import CheckpointError
from ram_trl.io.checkpoint import Checkpoint, TensorMeta
from ram_trl.io.safetensors_io import dtype_itemsize
from ram_trl.sizes import parse_size

DEFAULT_CHUNK_BUDGET = parse_size(defaults.CHUNK_BUDGET)  #: In bytes (:data:`ram_trl.defaults.CHUNK_BUDGET`).
DEFAULT_MAX_SHARD_SIZE = parse_size(defaults.MAX_SHARD_SIZE)  #: In bytes (:data:`ram_trl.defaults.MAX_SHARD_SIZE`).
PROCESS_BASELINE_BYTES = 450 * 1024**2


def bytes_per_element(
    num_agents: int, in_itemsize: int = 4, out_itemsize: int = 4, fisher_itemsize: int = 0, model_buffers: bool = False
) -> int:
    """Upper bound on live buffer bytes per chunk element during a merge with ``num_agents`` agents."""
    total = 10 * num_agents + 20 + 2 * (num_agents + 1) * in_itemsize + 3 * out_itemsize
    if fisher_itemsize:
        total += num_agents * (8 + fisher_itemsize)
    if model_buffers:
        total += 4 * num_agents
    return total


def chunk_elements(
    budget: int,
    num_agents: int,
    in_itemsize: int = 4,
    out_itemsize: int = 4,
    fisher_itemsize: int = 0,
    model_buffers: bool = False,
) -> int:
    """Largest chunk (in elements) whose buffers fit in ``budget`` bytes."""
    per = bytes_per_element(num_agents, in_itemsize, out_itemsize, fisher_itemsize, model_buffers)
    return max(1, budget // per)


@dataclass(frozen=True)
class TensorTask:
    """One output tensor."""

    name: str
    base: TensorMeta
    out_dtype: torch.dtype
    out_rows: int
    agent_rows: tuple[int, ...]
    floating: bool
    rows_per_chunk: int

    @property
    def out_shape(self) -> tuple[int, ...]:
        if not self.base.shape:
            return ()
        return (self.out_rows, *self.base.shape[1:])

    @property
    def base_rows(self) -> int:
        return self.base.shape[0] if self.base.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.base.shape[1:]) if len(self.base.shape) > 1 else 1

    @property
    def out_numel(self) -> int:
        return math.prod(self.out_shape)

    @property
    def out_bytes(self) -> int:
        return self.out_numel * dtype_itemsize(self.out_dtype)

    def chunks(self) -> list[tuple[int, int]]:
        """Row ranges ``(start, stop)`` to process, split at the base's row count (rows past it are extra rows)."""
        ranges: list[tuple[int, int]] = []
        for lo, hi in ((0, self.base_rows), (self.base_rows, self.out_rows)):
            for start in range(lo, hi, self.rows_per_chunk):
                ranges.append((start, min(hi, start + self.rows_per_chunk)))
        return ranges or [(0, 0)]


@dataclass
class ShardPlan:
    """One output safetensors file and the tensors it holds, in order."""

    file_name: str
    tasks: list[TensorTask]

    @property
    def nbytes(self) -> int:
        return sum(t.out_bytes for t in self.tasks)


@dataclass
class MergePlan:
    """Everything the merge will do, known before it reads a tensor."""

    tasks: list[TensorTask]
    shards: list[ShardPlan]
    num_agents: int
    chunk_budget: int
    passes: int
    input_bytes: int
    trims_by_magnitude: bool
    resized: list[str] = field(default_factory=list)
    fisher_itemsize: int = 0
    fishers: list[Checkpoint] | None = None
    merges_weights: bool = False
    prepare_bytes: int = 12

    @property
    def output_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def bytes_read(self) -> int:
        total = self.input_bytes * self.passes
        if self.trims_by_magnitude:
            total += sum(
                t.base.numel * dtype_itemsize(t.base.dtype) * (self.num_agents + 1) for t in self.tasks if t.floating
            )
        return total

    @property
    def largest_tensor_numel(self) -> int:
        return max((t.out_numel for t in self.tasks), default=0)

    def largest_chunk_bytes(self) -> int:
        """The largest chunk's buffer estimate (what :func:`bytes_per_element` bounds)."""
        worst = 0
        for task in self.tasks:
            rows = min(task.rows_per_chunk, max(task.out_rows, 1))
            elements = rows * task.row_numel
            per = bytes_per_element(
                self.num_agents,
                dtype_itemsize(task.base.dtype),
                dtype_itemsize(task.out_dtype),
                self.fisher_itemsize,
                self.merges_weights,
            )
            worst = max(worst, elements * per)
        return worst

    def peak_memory_estimate(self) -> int:
        """Estimated peak resident memory of the whole process (see the module docstring)."""
        peak = PROCESS_BASELINE_BYTES + self.largest_chunk_bytes()
        if self.trims_by_magnitude:
            peak += self.prepare_bytes * self.largest_tensor_numel
        return peak


def build_plan(
    base: Checkpoint,
    agents: list[Checkpoint],
    *,
    out_dtype: torch.dtype | None,
    shape_mismatch: str,
    needs_statistics: bool,
    trims_by_magnitude: bool,
    chunk_budget: int = DEFAULT_CHUNK_BUDGET,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    fisher_itemsize: int = 0,
    resizable: Callable[[str], bool] | None = None,
    merges_weights: bool = False,
    prepare_bytes: int = 12,
) -> MergePlan:
    """Check all inputs against the base and plan the merge."""
    num_agents = len(agents)
    for agent in agents:
        extra = sorted(set(agent.tensors) - set(base.tensors))
        if extra:
            more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
            what = "the adapter targets tensor" if agent.kind == "lora" else "tensor"
            raise CheckpointError(
                f"{agent.role}: {what} {extra[0]!r}{more}, which is not in the base model ({base.path}); is this "
                "agent derived from this base (same architecture and vocabulary)?"
            )
    tasks: list[TensorTask] = []
    resized: list[str] = []
    names = sorted(base.tensors, key=lambda n: _storage_order(base, n))
    for name in names:
        meta = base.tensors[name]
        floating = meta.dtype.is_floating_point
        rows = []
        for agent in agents:
            other = agent.tensors.get(name)
            if other is None:
                if agent.kind == "lora":  # a tensor the adapter does not touch: zero task vector
                    rows.append(0)
                    continue
                raise CheckpointError(f"{agent.role}: tensor {name!r} of the base model is missing in {agent.path}")
            if floating and not other.dtype.is_floating_point:
                raise CheckpointError(
                    f"{agent.role}: tensor {name!r} has dtype {other.dtype} in {agent.path}, the base has {meta.dtype}"
                )
            if other.shape != meta.shape:
                rows_only = len(other.shape) == len(meta.shape) >= 1 and other.shape[1:] == meta.shape[1:]
                # "tokenizer_rows": the config's tokenizer numbers the tokens as every agent does, so an agent's
                # rows past the base's (its added tokens) are left out, as mergekit re-indexes them away
                common = shape_mismatch == "merge_common_rows" or (
                    shape_mismatch == "tokenizer_rows" and rows_only and other.shape[0] > meta.shape[0]
                )
                if common and rows_only and resizable is not None and not resizable(name):
                    what = "its LoRA delta" if agent.kind == "lora" else "tensor"
                    raise CheckpointError(
                        f"{agent.role}: {what} {name!r} has shape {list(other.shape)} in {agent.path}, the base "
                        f"{base.path} has {list(meta.shape)}; shape_mismatch: merge_common_rows only resizes "
                        "vocabulary tensors (embeddings, output head): this agent does not fit the base"
                    )
                if not (common and rows_only and floating):
                    hint = (
                        " (rows differ only: set shape_mismatch: merge_common_rows for resized vocabularies)"
                        if rows_only and (resizable is None or resizable(name))
                        else ""
                    )
                    raise CheckpointError(
                        f"{agent.role}: tensor {name!r} has shape {list(other.shape)} in {agent.path}, the base "
                        f"{base.path} has {list(meta.shape)}{hint}"
                    )
            rows.append(other.shape[0] if other.shape else 1)
        base_rows = meta.shape[0] if meta.shape else 1
        out_rows = base_rows if shape_mismatch == "tokenizer_rows" else max([base_rows, *rows])
        if out_rows != base_rows:
            resized.append(name)
        dtype = out_dtype if (out_dtype is not None and floating) else meta.dtype
        row_numel = math.prod(meta.shape[1:]) if len(meta.shape) > 1 else 1
        in_size = max(
            [dtype_itemsize(meta.dtype)] + [dtype_itemsize(a.tensors[name].dtype) for a in agents if name in a.tensors]
        )
        elements = chunk_elements(
            chunk_budget, num_agents, in_size, dtype_itemsize(dtype), fisher_itemsize, merges_weights
        )
        rows_per_chunk = max(1, elements // max(row_numel, 1))
        tasks.append(
            TensorTask(
                name=name,
                base=meta,
                out_dtype=dtype,
                out_rows=out_rows,
                agent_rows=tuple(rows),
                floating=floating,
                rows_per_chunk=rows_per_chunk,
            )
        )
    shards = plan_shards(tasks, max_shard_size)
    input_bytes = sum(t.base.numel * dtype_itemsize(t.base.dtype) for t in tasks) + sum(
        sum(m.numel * dtype_itemsize(m.dtype) for m in agent.tensors.values()) for agent in agents
    )
    return MergePlan(
        tasks=tasks,
        shards=shards,
        num_agents=num_agents,
        chunk_budget=chunk_budget,
        passes=2 if needs_statistics else 1,
        input_bytes=input_bytes,
        trims_by_magnitude=trims_by_magnitude,
        resized=resized,
        fisher_itemsize=fisher_itemsize,
        merges_weights=merges_weights,
        prepare_bytes=prepare_bytes,
    )


def plan_shards(tasks: list[TensorTask], max_shard_size: int) -> list[ShardPlan]:
    """Group tensors, in order, into files of at most ``max_shard_size`` bytes, named as transformers names them."""
    groups: list[list[TensorTask]] = [[]]
    size = 0
    for task in tasks:
        if groups[-1] and size + task.out_bytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(task)
        size += task.out_bytes
    if len(groups) == 1:
        return [ShardPlan("model.safetensors", groups[0])]
    total = len(groups)
    return [ShardPlan(f"model-{i + 1:05d}-of-{total:05d}.safetensors", group) for i, group in enumerate(groups)]


def write_index(shards: list[ShardPlan], out_dir: Path) -> None:
    """The ``model.safetensors.index.json`` of a sharded output (nothing for one file)."""
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in shards)},
            "weight_map": {t.name: s.file_name for s in shards for t in s.tasks},
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _storage_order(checkpoint: Checkpoint, name: str) -> tuple[str, int, str]:
    info = checkpoint.location(name)
    if info is None:
        return ("", 0, name)
    return (str(info.file), info.begin, name)
