"""Bounded-memory reading and writing of safetensors files (https://github.com/huggingface/safetensors): inputs read
one row range at a time, outputs written by row range into shards whose headers the plan lays out up front
(docs/memory.md)."""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ram_trl.errors import CheckpointError
from ram_trl.fs import libc_function

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}

_MAX_HEADER_BYTES = 100 * 1024 * 1024


#: Smallest row range :class:`RowReader` returns as a memory map (smaller ones are copied: a mapping costs a system
#: call and a page-aligned address range).
MAP_MIN_BYTES = 1 << 20


def dtype_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def row_numel(self) -> int:
        """Elements per row (per index of the first dimension); 1 for 0-d and 1-d tensors."""
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 1


def read_safetensors_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header without reading tensor data."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read safetensors file ({exc.strerror})") from exc
    if size < 8:
        raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes; truncated or empty)")
    try:
        with open(path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len == 0 or header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors file (header claims {header_len} bytes, "
                    f"file has {size} bytes)"
                )
            raw = handle.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read safetensors file ({exc.strerror or exc})") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from exc
    data_start = 8 + header_len
    itemsizes = {name: dtype_itemsize(dtype) for name, dtype in SAFETENSORS_DTYPES.items()}
    entries, metadata = check_safetensors_header(header, path, size - data_start, itemsizes)
    tensors = {
        e.name: TensorInfo(
            e.name, SAFETENSORS_DTYPES[e.dtype], e.shape, path, data_start + e.begin, data_start + e.end
        )
        for e in entries
    }
    return tensors, metadata


class _Handle:
    """An open file descriptor shared by reads, with the number of reads holding it."""

    __slots__ = ("fd", "users", "evicted")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.evicted = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RowReader:
    """Reads of row ranges from safetensors files, with a small cache of open file handles."""

    def __init__(self, max_open_files: int = 64, map_min_bytes: int | None = MAP_MIN_BYTES) -> None:
        self._handles: OrderedDict[Path, _Handle] = OrderedDict()
        self._max_open = max_open_files
        self._map_min_bytes = map_min_bytes
        self._lock = threading.Lock()

    def _acquire(self, path: Path) -> _Handle:
        """An open descriptor of ``path``, held until :meth:`_release`: eviction (least recently used first, beyond
        ``max_open_files``) and :meth:`close` close a descriptor only once no read holds it, so a read in flight on
        another thread never sees its descriptor closed or reused."""
        with self._lock:
            handle = self._handles.get(path)
            if handle is None:
                while len(self._handles) >= self._max_open:
                    _, old = self._handles.popitem(last=False)
                    old.evicted = True
                    if old.users == 0:
                        old.close()
                handle = _Handle(os.open(path, os.O_RDONLY))
                self._handles[path] = handle
            else:
                self._handles.move_to_end(path)
            handle.users += 1
            return handle

    def _release(self, handle: _Handle) -> None:
        with self._lock:
            handle.users -= 1
            if handle.evicted and handle.users == 0:
                handle.close()

    def read_rows(self, info: TensorInfo, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Read rows ``start:stop`` (first dimension) of a tensor in its stored dtype."""
        if not info.shape:
            start, stop = 0, 1
        start = 0 if start is None else start
        stop = info.num_rows if stop is None else stop
        row_bytes = info.row_numel * dtype_itemsize(info.dtype)
        offset = info.begin + start * row_bytes
        nbytes = (stop - start) * row_bytes
        shape = info.shape[1:] if info.shape else ()
        rows = (stop - start,) if info.shape else ()
        if self._map_min_bytes is not None and nbytes >= self._map_min_bytes:
            buffer = self._map(info, offset, nbytes)
        else:
            buffer = self._pread(info, offset, nbytes)
        return buffer.view(info.dtype).reshape(rows + shape)

    def _pread(self, info: TensorInfo, offset: int, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            view = memoryview(buffer.numpy())
            handle = self._acquire(info.file)
            try:
                done = 0
                while done < nbytes:
                    got = os.preadv(handle.fd, [view[done:]], offset + done)
                    if got <= 0:
                        raise CheckpointError(
                            f"{info.file}: unexpected end of file while reading tensor {info.name!r}"
                        )
                    done += got
            finally:
                self._release(handle)
        return buffer

    def _map(self, info: TensorInfo, offset: int, nbytes: int) -> torch.Tensor:
        handle = self._acquire(info.file)
        try:
            if os.fstat(handle.fd).st_size < offset + nbytes:  # a mapping past the end would fault (SIGBUS)
                raise CheckpointError(f"{info.file}: unexpected end of file while reading tensor {info.name!r}")
            skip = offset % mmap.ALLOCATIONGRANULARITY
            # the mapping keeps its own duplicate of the descriptor: releasing ours afterwards is safe
            mapped = mmap.mmap(handle.fd, nbytes + skip, access=mmap.ACCESS_COPY, offset=offset - skip)
        finally:
            self._release(handle)
        if hasattr(mapped, "madvise"):
            mapped.madvise(mmap.MADV_WILLNEED)  # start reading ahead now if the pages are not cached
        return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=skip)

    def close(self) -> None:
        """Close every descriptor (those held by a read in flight when that read ends)."""
        with self._lock:
            for handle in self._handles.values():
                handle.evicted = True
                if handle.users == 0:
                    handle.close()
            self._handles.clear()

    def __enter__(self) -> RowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype and shape of a tensor: one stored in a checkpoint, or an output planned before it is computed."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)


#: The writer's name for an output tensor's metadata.
PlannedTensor = TensorMeta


def shard_layout(
    tensors: list[PlannedTensor], metadata: dict[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """The header of a safetensors file holding ``tensors`` in order, and where each tensor's data goes."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    relative: dict[str, tuple[int, int]] = {}
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": TORCH_TO_SAFETENSORS[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        relative[tensor.name] = (offset, offset + tensor.nbytes)
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    prefix = struct.pack("<Q", len(encoded)) + encoded
    locations = {name: (len(prefix) + b, len(prefix) + e) for name, (b, e) in relative.items()}
    return prefix, locations, len(prefix) + offset


_SYNC_FILE_RANGE = libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range's dirty pages, do not wait for it


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a just-written range to disk now, without waiting (Linux; else a no-op)."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # best effort: errors are not actionable


class ShardFile:
    """One output safetensors file whose layout is fixed by the plan; tensors are written by row range at fixed offsets."""

    def __init__(self, path: str | Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._planned = {t.name: t for t in tensors}
        _, self._locations, self.file_size = shard_layout(tensors, metadata)
        self._fd = os.open(self.path, os.O_WRONLY)
        self.bytes_written = 0

    @staticmethod
    def create(path: str | Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None) -> None:
        """Write the header and size the file; tensor data is filled in by :meth:`write_rows`."""
        prefix, _, size = shard_layout(tensors, metadata)
        with open(path, "wb") as handle:
            handle.write(prefix)
            handle.truncate(size)

    def write_rows(self, name: str, row_start: int, chunk: torch.Tensor) -> None:
        """Write ``chunk`` (rows ``row_start : row_start + len(chunk)`` of tensor ``name``, in its planned dtype)."""
        planned = self._planned.get(name)
        if planned is None:
            raise RuntimeError(f"{self.path}: tensor {name!r} is not planned in this file")
        if chunk.dtype != planned.dtype:
            raise RuntimeError(f"{self.path}: {name!r} chunk has dtype {chunk.dtype}, planned {planned.dtype}")
        begin, end = self._locations[name]
        row_bytes = (math.prod(planned.shape[1:]) if len(planned.shape) > 1 else 1) * dtype_itemsize(planned.dtype)
        offset = begin + row_start * row_bytes
        data = chunk.detach().contiguous().reshape(-1).view(torch.uint8)
        if data.device.type != "cpu":
            data = data.cpu()
        if offset + data.numel() > end:
            raise RuntimeError(f"{self.path}: rows written past the end of tensor {name!r}")
        view = memoryview(data.numpy())
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)
        self.bytes_written += len(view)
        start_writeback(self._fd, offset, len(view))

    def close(self) -> None:
        """Flush to disk and close."""
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True)
class HeaderEntry:
    """One validated tensor entry of a safetensors header (offsets relative to the end of the header)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_safetensors_header(
    header: Any, path: Path, data_bytes: int, itemsizes: Mapping[str, int]
) -> tuple[list[HeaderEntry], dict[str, str]]:
    """Validate a decoded safetensors header as the safetensors library would, with one message per problem."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(
            f"{path}: corrupt safetensors header: __metadata__ must map strings to strings, got "
            f"{type(metadata).__name__}; re-save the file with safetensors"
        )
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        entries.append(_check_entry(name, entry, path, data_bytes, itemsizes))
    ordered = sorted((e for e in entries if e.end > e.begin), key=lambda e: e.begin)
    for before, after in zip(ordered, ordered[1:], strict=False):
        if after.begin < before.end:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: the data of tensors {before.name!r} "
                f"[{before.begin}, {before.end}) and {after.name!r} [{after.begin}, {after.end}) overlap; "
                "re-save the file with safetensors"
            )
    return entries, dict(metadata)


def _check_entry(name: str, entry: Any, path: Path, data_bytes: int, itemsizes: Mapping[str, int]) -> HeaderEntry:
    where = f"{path}: corrupt safetensors header entry for tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: expected an object with dtype, shape, data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: dtype must be a string, got {dtype!r}")
    if dtype not in itemsizes:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(whole_number(d) for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(whole_number(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets must be two non-negative integers, got {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * itemsizes[dtype]
    if end - begin != expected:
        raise CheckpointError(
            f"{path}: corrupt safetensors header: tensor {name!r} spans {end - begin} bytes, "
            f"its shape {list(shape)} and dtype {dtype} need {expected}"
        )
    if end > data_bytes:
        raise CheckpointError(
            f"{path}: truncated safetensors file: tensor {name!r} ends at data byte {end}, the file has "
            f"{data_bytes} bytes of data"
        )
    return HeaderEntry(name, dtype, tuple(shape), begin, end)
