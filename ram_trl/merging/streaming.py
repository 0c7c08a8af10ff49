"""Streaming task vectors: the base's and every agent's stored values, one row chunk at a time, as float32 deltas.

The merge's passes and the sparsity analysis read their inputs through this module: :func:`iter_chunks` yields
:class:`RawChunk` objects (read ahead on a background thread) and :func:`to_deltas` turns one into float32 task
vectors, refusing NaN/Inf inputs with an error that names the checkpoint and tensor.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ram_trl.errors import NonFiniteError
from ram_trl.io.checkpoint import Checkpoint
from ram_trl.io.fisher_files import fill_fisher, read_fisher_rows
from ram_trl.io.prefetch import read_ahead
from ram_trl.io.safetensors_io import RowReader
from ram_trl.merging.planner import TensorTask


@dataclass
class RawChunk:
    """The stored values of one row range of one tensor: the base's and each agent's (``None``: rows it lacks).

    Args:
        task: The tensor.
        start: First row.
        stop: One past the last row.
        base: The base's rows in their stored dtype (``None`` for rows past the base's: a resized vocabulary).
        agents: Each agent's rows in their stored dtype; ``None`` where an agent stores none of these rows (a LoRA
            adapter that does not save the tensor, or a shorter tensor), fewer rows than ``stop - start`` where its
            tensor is shorter than the base's.
        lora: Each agent's float32 LoRA delta of these rows, or ``None`` (full checkpoints, untouched tensors).
        fishers: With Fisher inputs, the agents' float32 Fishers of these rows, shape ``(num_agents, n)``, checked
            finite and non-negative (zero on rows a file lacks); else ``None``.
    """

    task: TensorTask
    start: int
    stop: int
    base: torch.Tensor | None
    agents: list[torch.Tensor | None]
    lora: list[torch.Tensor | None]
    fishers: torch.Tensor | None = None

    @property
    def extra_rows(self) -> bool:
        """Rows past the base's (a resized vocabulary)."""
        return self.start >= self.task.base_rows


#: Elements of the blocks a chunk's arithmetic runs in on the CPU (:func:`compute_blocks`): small enough that a
#: block's float32 temporaries stay in the CPU caches, large enough that the per-operation overhead stays small.
COMPUTE_BLOCK_ELEMENTS = 1 << 17

#: Elements of the blocks of the merge's statistics pass: it keeps only the task vectors (turned into flags in place),
#: so twice as many elements fit the caches, and fewer, longer operations per element cost less Python and lock
#: hand-over between the threads (measured: the pass took 15-25% less time than with 2**17 on a 270M model).
STATISTICS_BLOCK_ELEMENTS = 1 << 18


def compute_blocks(chunk: RawChunk, device: torch.device, elements: int | None = None) -> list[RawChunk]:
    """Split a chunk of the base's rows into consecutive row blocks of about ``elements`` elements (views, no copy).

    Elementwise arithmetic gives the same values block by block as on the whole chunk, but its temporaries stay in
    the CPU caches instead of streaming through memory once per operation. On an accelerator the chunk stays whole.

    Args:
        chunk: A chunk of the base's rows (not rows past them).
        device: Where the arithmetic runs.
        elements: Target elements per block (at least one row); default :data:`COMPUTE_BLOCK_ELEMENTS`.

    Returns:
        The blocks, in row order; ``[chunk]`` when it is small enough or the device is not the CPU.
    """
    rows = max(1, (elements or COMPUTE_BLOCK_ELEMENTS) // chunk.task.row_numel)
    if device.type != "cpu" or chunk.stop - chunk.start <= rows:
        return [chunk]
    blocks = []
    for lo in range(0, chunk.stop - chunk.start, rows):
        hi = min(chunk.stop - chunk.start, lo + rows)
        blocks.append(
            RawChunk(
                chunk.task,
                chunk.start + lo,
                chunk.start + hi,
                None if chunk.base is None else chunk.base[lo:hi],
                [_row_slice(values, lo, hi) for values in chunk.agents],
                [_row_slice(lora, lo, hi) for lora in chunk.lora],
                None
                if chunk.fishers is None
                else chunk.fishers[:, lo * chunk.task.row_numel : hi * chunk.task.row_numel],
            )
        )
    return blocks


def statistics_blocks(chunk: RawChunk, device: torch.device) -> list[RawChunk]:
    """:func:`compute_blocks` of :data:`STATISTICS_BLOCK_ELEMENTS` elements (the merge's statistics pass).

    Args:
        chunk: A chunk of the base's rows.
        device: Where the arithmetic runs (the chunk stays whole off the CPU).

    Returns:
        The blocks, in row order.
    """
    return compute_blocks(chunk, device, STATISTICS_BLOCK_ELEMENTS)


def _row_slice(rows: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """Rows ``lo:hi`` of a chunk's tensor, ``None`` when it has none of them (a shorter agent tensor)."""
    if rows is None or rows.shape[0] <= lo:
        return None
    return rows[lo:hi]


def chunk_nbytes(chunk: RawChunk) -> int:
    """Bytes held by a chunk's tensors (stored values, LoRA deltas, Fishers).

    Args:
        chunk: The chunk.

    Returns:
        The bytes.
    """
    tensors = [chunk.base, *chunk.agents, *chunk.lora, chunk.fishers]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def to_device(chunk: RawChunk, device: torch.device) -> RawChunk:
    """The chunk with every tensor on ``device``, in its stored dtype (the chunk itself on the CPU).

    Args:
        chunk: A chunk as read (host tensors).
        device: Where the arithmetic runs.

    Returns:
        The chunk on ``device``.
    """
    if device.type == "cpu":
        return chunk

    def move(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values.to(device)

    return RawChunk(
        chunk.task,
        chunk.start,
        chunk.stop,
        move(chunk.base),
        [move(v) for v in chunk.agents],
        [move(v) for v in chunk.lora],
        move(chunk.fishers),
    )


class InputCache:
    """The chunks the merge's statistics pass has read, kept (on the compute device) for the merge pass, up to a
    budget of bytes: the merge pass takes each kept chunk instead of reading it again, so a method with a statistics
    pass (RAM+, RAM+s) reads and copies to the device the kept part of its inputs once instead of twice.

    Chunks are kept in reading order until the next one would exceed the budget; the rest are read again as without
    a cache. Thread-safe: the merge pass takes chunks on its reader threads.

    Args:
        budget: Bytes of chunks that may be kept.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.kept_bytes = 0
        self.kept_chunks = 0
        self.taken_chunks = 0
        self._full = False
        self._chunks: dict[tuple[str, int, int], RawChunk] = {}
        self._lock = threading.Lock()

    def keep(self, chunk: RawChunk) -> bool:
        """Keep a chunk for the merge pass if it fits the budget (and every chunk before it did).

        Args:
            chunk: A chunk the statistics pass read (its tensors must not be modified afterwards).

        Returns:
            Whether it was kept.
        """
        size = chunk_nbytes(chunk)
        with self._lock:
            if self._full or self.kept_bytes + size > self.budget:
                self._full = True  # keep a prefix: the merge pass then finds the kept chunks first
                return False
            self._chunks[(chunk.task.name, chunk.start, chunk.stop)] = chunk
            self.kept_bytes += size
            self.kept_chunks += 1
            return True

    def take(self, task: TensorTask, start: int, stop: int) -> RawChunk | None:
        """Remove and return the kept chunk of these rows, or ``None`` if none was kept.

        Args:
            task: The tensor.
            start: First row.
            stop: One past the last row.

        Returns:
            The chunk, or ``None``.
        """
        with self._lock:
            chunk = self._chunks.pop((task.name, start, stop), None)
            if chunk is not None:
                self.taken_chunks += 1
            return chunk

    def clear(self) -> None:
        """Drop every kept chunk (their device memory is freed with the last reference)."""
        with self._lock:
            self._chunks.clear()

    def summary(self) -> dict[str, int]:
        """The cache's figures for the merge report.

        Returns:
            ``budget``, ``kept_bytes``, ``kept_chunks`` and ``taken_chunks``.
        """
        return {
            "budget": self.budget,
            "kept_bytes": self.kept_bytes,
            "kept_chunks": self.kept_chunks,
            "taken_chunks": self.taken_chunks,
        }


def input_cache_budget(setting: int | None, device: torch.device) -> int:
    """Bytes the :class:`InputCache` of a merge may keep.

    Args:
        setting: The checked ``input_cache`` option (:func:`~ram_trl.validation.check_input_cache`): bytes, or
            ``None`` for ``auto``.
        device: Where the arithmetic runs.

    Returns:
        The setting's bytes; for ``auto``, half the free memory of an accelerator (the merge's own buffers need
        little: one chunk in flight), 0 on the CPU (its second read comes from the page cache, and keeping the
        inputs would make the merge's memory grow with the model).
    """
    if setting is not None:
        return setting
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return 0


@dataclass
class ReadCounter:
    """Bytes read so far."""

    bytes: int = 0


def chunk_refs(tasks: list[TensorTask], floating_only: bool) -> Iterator[tuple[TensorTask, int, int]]:
    """Every ``(task, start, stop)`` row range to process, in order.

    Args:
        tasks: The tensors (their ``chunks()`` fix the row ranges).
        floating_only: Skip the tensors that are copied (not floating) and the rows past the base's.

    Returns:
        The row ranges, tensor by tensor.
    """
    for task in tasks:
        if floating_only and not task.floating:
            continue
        for start, stop in task.chunks():
            if floating_only and start >= task.base_rows:
                continue
            yield task, start, stop


def iter_chunks(
    base: Checkpoint,
    agents: list[Checkpoint],
    tasks: list[TensorTask],
    reader: RowReader,
    *,
    floating_only: bool = True,
    counter: ReadCounter | None = None,
    read_ahead_depth: int = 1,
    fishers: list[Checkpoint] | None = None,
    readers: int = 1,
    cache: InputCache | None = None,
) -> Iterator[RawChunk]:
    """Read the row chunks of ``tasks`` in order, ``read_ahead_depth`` chunks ahead on background threads.

    Args:
        base: The base checkpoint.
        agents: The agents, in order.
        tasks: Tensors to read (their ``chunks()`` fix the row ranges).
        reader: The positioned reader.
        floating_only: Skip non-floating tensors and rows past the base's.
        counter: Accumulates the bytes read.
        read_ahead_depth: Chunks read ahead (0: synchronous).
        fishers: Each agent's Fisher file, read in the same row ranges as its weights (floating tensors, base rows).
        readers: Threads reading chunks at once (:attr:`ram_trl.parallel.ThreadPlan.readers`); the chunks and their
            order are the same for any number.
        cache: Chunks kept by an earlier pass: each is taken from it instead of being read (not counted as read).
    """
    counter = counter if counter is not None else ReadCounter()
    counted = threading.Lock()  # several readers add to the counter

    def read(ref: tuple[TensorTask, int, int]) -> RawChunk:
        task, start, stop = ref
        if cache is not None and (kept := cache.take(task, start, stop)) is not None:
            return kept
        raw_base = None if start >= task.base_rows else base.read_rows(task.name, reader, start, stop)
        raws: list[torch.Tensor | None] = []
        loras: list[torch.Tensor | None] = []
        if task.floating:
            for t, agent in enumerate(agents):
                values, lora = read_agent_rows(agent, task, t, reader, start, stop)
                raws.append(values)
                loras.append(lora)
        read_bytes = sum(r.numel() * r.element_size() for r in [raw_base, *raws] if r is not None)
        fisher_values = None
        if fishers is not None and task.floating and start < task.base_rows:
            rows_shape = (len(fishers), (stop - start) * task.row_numel)
            fisher_values = torch.empty(rows_shape, dtype=torch.float32)  # host: read rows land here
            for t, fisher in enumerate(fishers):
                rows = read_fisher_rows(fisher, task.name, reader, start, stop)
                if rows is not None:
                    read_bytes += rows.numel() * rows.element_size()
                fill_fisher(fisher_values[t], rows, fisher, task.name, start)
        with counted:
            counter.bytes += read_bytes
        return RawChunk(task, start, stop, raw_base, raws, loras, fisher_values)

    return read_ahead(chunk_refs(tasks, floating_only), read, read_ahead_depth, readers)


def read_agent_rows(
    agent: Checkpoint, task: TensorTask, index: int, reader: RowReader, start: int, stop: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One agent's stored values and LoRA delta (either may be ``None``) for rows ``start:stop`` of a tensor.

    Args:
        agent: The agent's checkpoint.
        task: The tensor.
        index: The agent's index (its row count in ``task.agent_rows``).
        reader: The positioned reader.
        start: First row.
        stop: One past the last row (cut to the agent's rows).

    Returns:
        The stored values (``None`` when the agent stores none of the tensor) and the float32 LoRA delta (``None``
        without one); both ``None`` when the agent has no row in the range.
    """
    have = min(stop, task.agent_rows[index])
    if have <= start:
        return None, None
    values = agent.read_rows(task.name, reader, start, have) if agent.has_values(task.name) else None
    return values, agent.lora_delta_rows(task.name, reader, start, have)


def fill_delta(
    out: torch.Tensor, values: torch.Tensor | None, lora: torch.Tensor | None, base_values: torch.Tensor
) -> None:
    """Write one agent's float32 task vector for a chunk into ``out`` (flat, the chunk's length).

    The stored values minus the base (where the agent stores values), plus the LoRA delta (where it has one); zero
    where it has neither (rows or tensors the agent does not touch).

    Args:
        out: Float32, flat: receives the task vector.
        values: The agent's stored values of the chunk, or ``None``.
        lora: The agent's LoRA delta of the chunk, or ``None``.
        base_values: The base's float32 values of the chunk, flat.
    """
    n = 0
    if values is not None:
        n = values.numel()
        out[:n].copy_(values.reshape(-1))
        out[:n].sub_(base_values[:n])
    if lora is not None:
        m = lora.numel()
        if values is None:
            out[:m].copy_(lora.reshape(-1))
        else:
            out[:m].add_(lora.reshape(-1).to(out.device))
        n = max(n, m)
    if n < out.numel():
        out[n:].zero_()


def fill_weights(
    out: torch.Tensor, values: torch.Tensor | None, lora: torch.Tensor | None, base_values: torch.Tensor
) -> None:
    """Write one agent's float32 weights for a chunk into ``out`` (flat, the chunk's length): for methods that
    merge weights rather than task vectors.

    The stored values where the agent stores them, the base's elsewhere (rows or tensors it does not touch), plus
    its LoRA delta where it has one.

    Args:
        out: Float32, flat: receives the weights.
        values: The agent's stored values of the chunk, or ``None``.
        lora: The agent's LoRA delta of the chunk, or ``None``.
        base_values: The base's float32 values of the chunk, flat.
    """
    n = 0
    if values is not None:
        n = values.numel()
        out[:n].copy_(values.reshape(-1))
    if n < out.numel():
        out[n:].copy_(base_values[n:])
    if lora is not None:
        out[: lora.numel()].add_(lora.reshape(-1).to(out.device))


def to_deltas(
    chunk: RawChunk,
    device: torch.device,
    base: Checkpoint,
    agents: list[Checkpoint],
    reader: RowReader,
    allow_nonfinite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 task vectors ``(num_agents, n)`` and base values ``(n,)`` of a chunk of the base's rows.

    An agent with fewer rows than the base (resized vocabulary) contributes zero deltas on the rows it lacks.

    Args:
        chunk: A chunk of the base's rows.
        device: Where the tensors are made.
        base: The base checkpoint (read again to name a NaN/Inf input).
        agents: The agents, in order (likewise).
        reader: The positioned reader.
        allow_nonfinite: Skip the NaN/Inf check (default ``False``).

    Returns:
        The task vectors and the base values, float32, on ``device``.

    Raises:
        NonFiniteError: naming the checkpoint and tensor, if an input holds NaN/Inf and ``allow_nonfinite`` is off.
    """
    assert chunk.base is not None
    base_values = chunk.base.to(device=device, dtype=torch.float32).reshape(-1)
    deltas = torch.empty((len(chunk.agents), base_values.numel()), dtype=torch.float32, device=device)
    for t, (values, lora) in enumerate(zip(chunk.agents, chunk.lora, strict=True)):
        fill_delta(deltas[t], values, lora, base_values)
    if not allow_nonfinite and not math.isfinite(float(deltas.sum())):
        raise_nonfinite(chunk.task, base, agents, reader, chunk.start, chunk.stop, deltas)
    return deltas, base_values


def raise_nonfinite(
    task: TensorTask,
    base: Checkpoint,
    agents: list[Checkpoint],
    reader: RowReader,
    start: int,
    stop: int,
    deltas: torch.Tensor | None = None,
) -> None:
    """Find which input holds the NaN/Inf that made a chunk's task vectors non-finite, and say so.

    Checks the base's stored values, each agent's stored values and LoRA delta (its factors), and finally the task
    vectors themselves (finite inputs whose difference overflows float32). Returns when everything is finite (only
    the sum used as a quick check overflowed).

    Args:
        task: The tensor.
        base: The base checkpoint.
        agents: The agents, in order.
        reader: The positioned reader.
        start: The chunk's first row.
        stop: One past its last row.
        deltas: The chunk's task vectors, checked last (default ``None``: not checked).

    Raises:
        NonFiniteError: naming the input, the tensor and the rows.
    """
    hint = "set allow_nonfinite: true in the config to merge anyway"
    base_values = base.read_rows(task.name, reader, start, stop).to(torch.float32)
    bad = int((~torch.isfinite(base_values)).sum())
    if bad:
        raise NonFiniteError(
            f"{base.role}: tensor {task.name!r} holds {bad} NaN/Inf values (rows {start}:{stop}); {hint}"
        )
    for index, agent in enumerate(agents):
        values, lora = read_agent_rows(agent, task, index, reader, start, stop)
        for what, part in (("holds", values), ("has a LoRA delta (B @ A * scaling) with", lora)):
            if part is None:
                continue
            bad = int((~torch.isfinite(part.to(torch.float32))).sum())
            if bad:
                raise NonFiniteError(
                    f"{agent.role}: tensor {task.name!r} {what} {bad} NaN/Inf values (rows {start}:"
                    f"{min(stop, task.agent_rows[index])}); fix the agent's weights or {hint}"
                )
    if deltas is not None:
        for index, agent in enumerate(agents):
            if not bool(torch.isfinite(deltas[index]).all()):
                raise NonFiniteError(
                    f"{agent.role}: tensor {task.name!r}: its difference from the base overflows float32 "
                    f"(|agent - base| > 3.4e38, rows {start}:{stop}); these weights are not a fine-tune of this "
                    "base, check the agent and the base"
                )
