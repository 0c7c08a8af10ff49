"""SHA-256 digests of files, model weights, tensors and text: the one module that hashes. File and weight digests
are kept in a bounded LRU cache (:data:`CACHE_ENTRIES`) keyed on each file's resolved path, inode, size and mtime in
nanoseconds, so a rewritten or replaced file is hashed again."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["file_digest", "hasher", "key_bytes", "stream_digest", "text_digest", "update_tensor", "weights_digest"]

CACHE_ENTRIES = 1024  #: Digests the cache keeps.
_BLOCK = 1 << 20
_cache: OrderedDict[tuple[Any, ...], str] = OrderedDict()
_lock = threading.Lock()


def hasher() -> Any:
    """A new SHA-256 hash object (``update`` it with bytes, then read ``hexdigest()``), for digests of several parts."""
    return hashlib.sha256()


def text_digest(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def key_bytes(text: str) -> bytes:
    """8 bytes of a BLAKE2b digest of ``text`` (UTF-8): a stable key for seeding random numbers (DARE's masks)."""
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def stream_digest(handle: BinaryIO) -> str:
    """The SHA-256 hex digest of an open binary file's remaining bytes, read into one reused buffer (the GIL is
    released while each block hashes). Not a memory map: a file truncated meanwhile gives a short read, not SIGBUS."""
    digest = hashlib.sha256()
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    if hasattr(handle, "readinto"):
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    else:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _stat_key(path: Path) -> tuple[str, int, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns


def _cached(key: tuple[Any, ...], compute: Callable[[], str]) -> str:
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    value = compute()
    with _lock:
        _cache[key] = value
        _cache.move_to_end(key)
        while len(_cache) > CACHE_ENTRIES:
            _cache.popitem(last=False)
    return value


def file_digest(file: str | os.PathLike) -> str:
    """The SHA-256 hex digest of a file's bytes, streamed; remembered (see the module docstring)."""
    path = Path(file)

    def compute() -> str:
        with path.open("rb", buffering=0) as handle:
            return stream_digest(handle)

    return _cached(("file", *_stat_key(path)), compute)


def update_tensor(digest: Any, header: str, tensor: torch.Tensor) -> None:
    """Add ``header`` (UTF-8: name, dtype, shape or offset) and then the raw bytes of a CPU ``tensor`` (in its own
    dtype, row-major) to a :func:`hasher`."""
    digest.update(header.encode())
    digest.update(tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())


def weights_digest(model_dir: str | os.PathLike) -> str:
    """SHA-256 (hex) of a model directory's safetensors tensors in name order (name, dtype, shape, raw bytes): equal
    digests mean bit-for-bit equal weights, whatever the sharding; cached per set of files."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    return _cached(("weights", *map(_stat_key, files)), lambda: _weights(files))


def _weights(files: Sequence[Path]) -> str:
    from safetensors import safe_open

    handles = {}
    for file in files:
        handle = safe_open(str(file), framework="pt")
        handles.update({name: handle for name in handle.keys()})  # noqa: SIM118 - safe_open has no __iter__
    digest = hashlib.sha256()
    for name in sorted(handles):
        tensor = handles[name].get_tensor(name)
        update_tensor(digest, f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}|", tensor)
    return digest.hexdigest()
