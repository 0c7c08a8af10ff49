"""The unit of work of a telemetry measurement: chunks of a region (:class:`Chunk`), what one chunk adds to a
measurement (:class:`ChunkCounts`) and the buffers every chunk a thread measures reuses (:class:`Workspace`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ram_trl.callbacks.telemetry.layout import ModelLayout, Region
from ram_trl.statistics import MagnitudeStatistics, MagnitudeWorkspace, OverlapStatistics


def lora_chunks(region: Region, size: int) -> Iterator[tuple[int, int, int, int]]:
    """The pieces of a LoRA region, each on whole rows of the delta (which is computed a row range at a time)."""
    shape = region.shard.shape
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    rows_per = max(1, size // row)
    first = region.shard.offset
    last = first + region.shard.numel
    row_start = first // row
    while row_start * row < last:
        row_stop = min(row_start + rows_per, math.ceil(last / row))
        lo, hi = max(first, row_start * row), min(last, row_stop * row)
        yield lo - first, hi - lo, row_start, row_stop
        row_start = row_stop


class Workspace:
    """Buffers reused by every chunk a thread measures (no allocation, no page faults in the hot loop)."""

    def __init__(self, numel: int, save_dtype: torch.dtype, device: torch.device) -> None:
        def f32() -> torch.Tensor:
            return torch.empty(numel, dtype=torch.float32, device=device)

        self.base, self.tau, self.saved, self.base_saved, self.scratch = f32(), f32(), f32(), f32(), f32()
        self.flags, self.saved_flags = f32(), f32()
        self.rounded = torch.empty(numel, dtype=save_dtype, device=device)
        self.magnitude = MagnitudeWorkspace(numel, device)
        self.device = device
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        #: the ``|tau|`` histogram of the chunks this workspace measured (reset by each measurement)
        self.histogram = MagnitudeStatistics.zeros(1)

    def stage(self, stored: torch.Tensor) -> torch.Tensor:
        """Host values bound for this workspace's accelerator, in a pinned host buffer (the copy to the device can
        then run asynchronously); values already on the workspace's device, or a CPU workspace, as they are."""
        if self.device.type != "cuda" or stored.device.type != "cpu":
            return stored
        count = stored.numel()
        buffer = self._staging.get(stored.dtype)
        if buffer is None or buffer.numel() < count:
            buffer = torch.empty(max(count, self.tau.numel()), dtype=stored.dtype, pin_memory=True)  # host
            self._staging[stored.dtype] = buffer
        return buffer[:count].copy_(stored)

    @property
    def nbytes(self) -> int:
        buffers = (self.base, self.tau, self.saved, self.base_saved, self.scratch, self.flags, self.saved_flags)
        staged = sum(t.numel() * t.element_size() for t in self._staging.values())
        return sum(t.numel() * t.element_size() for t in (*buffers, self.rounded)) + self.magnitude.nbytes + staged


@dataclass(frozen=True)
class Chunk:
    """Elements ``[start, start + count)`` of a region's local range, measured at once."""

    region: Region
    row: int
    start: int
    count: int
    rows: tuple[int, int] | None = None
    sampled: bool = True


@dataclass
class ChunkCounts:
    """What one chunk adds to a measurement (see :meth:`TaskVectorTracker._measure_chunk`)."""

    row: int
    changed: int = 0
    active: int = 0
    active_saved: int = 0
    nonfinite_base: int = 0
    square_sum: torch.Tensor | None = None
    overlap: OverlapStatistics | None = None


def flag_count(flags: torch.Tensor) -> int:
    """Number of ``1.0`` flags in a float32 tensor of ``0`` / ``1``: its sum, exact below ``2**24`` elements
    (comparisons that write float32 flags are several times faster than ones that write bools)."""
    if flags.numel() < 1 << 24:
        return int(flags.sum())
    return int(torch.count_nonzero(flags))


def nonfinite_count(values: torch.Tensor) -> int:
    """Number of NaN/Inf elements of ``values`` (one sum when there are none)."""
    if math.isfinite(float(values.sum())):
        return 0
    return int((~torch.isfinite(values)).sum())


def sample_windows(layout: ModelLayout, sample: int | None) -> tuple[dict[str, int], int]:
    """Where each base tensor starts with the model's tensors laid end to end (the same in every process), and the
    stride ``k`` of the sampled windows for a sample of about ``sample`` elements (1: every element)."""
    starts: dict[str, int] = {}
    total = measured = 0
    for region in layout.regions:
        if region.name not in starts:
            starts[region.name] = total
            total += region.shard.full_numel
            measured += region.shard.full_numel if region.kind != "frozen" else 0
    if sample is None:
        return starts, 1
    return starts, max(1, measured // sample)


def region_chunks(
    region: Region, row: int, tensor_start: int, stride: int, size: int, frozen: bool
) -> Iterator[Chunk]:
    """The chunks of ``size`` elements of a region that have something to count (``frozen``: count frozen regions)."""
    numel = region.shard.numel
    first = tensor_start + region.shard.offset  # position of the region's first element in the whole model

    def sampled(start: int) -> bool:
        return stride == 1 or (first + start) // size % stride == 0

    if region.kind == "lora":
        for start, count, row_start, row_stop in lora_chunks(region, size):
            yield Chunk(region, row, start, count, (row_start, row_stop), sampled(start))
    elif region.kind == "dense" or frozen:  # frozen: tau = 0, only the overlap to count
        start = 0
        while start < numel:
            stop = min(numel, start + size if stride == 1 else start + size - (first + start) % size)
            yield Chunk(region, row, start, stop - start, sampled=sampled(start))
            start = stop


def row_numel(shape: tuple[int, ...]) -> int:
    """Elements per row of a tensor of ``shape`` (1 for a scalar or a vector)."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


__all__ = [
    "Chunk",
    "ChunkCounts",
    "Workspace",
    "flag_count",
    "lora_chunks",
    "nonfinite_count",
    "region_chunks",
    "row_numel",
    "sample_windows",
]
