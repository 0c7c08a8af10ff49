"""Overlap reading and writing with arithmetic: a read-ahead iterator and a background writer (reads, writes and
torch's kernels release the GIL, so one I/O thread keeps the disk busy while the merge computes)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ram_trl.parallel import imap_blocks

Item = TypeVar("Item")
Result = TypeVar("Result")


def read_ahead(
    items: Iterable[Item], read: Callable[[Item], Result], depth: int = 1, readers: int = 1
) -> Iterator[Result]:
    """Yield ``read(item)`` for each item in order, reading up to ``depth`` items ahead in background threads."""
    if depth <= 0:
        for item in items:
            yield read(item)
        return
    with ThreadPoolExecutor(max_workers=max(1, readers), thread_name_prefix="ram-trl-read") as pool:
        # in flight: the item being consumed and the ``depth`` read ahead of it
        yield from imap_blocks(pool, read, items, ahead=depth + 1)


class BackgroundWriter:
    """Run write calls in order on one background thread, with at most ``depth`` calls queued."""

    def __init__(self, depth: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ram-trl-write")
        self._pending: deque[Future[Any]] = deque()
        self._depth = depth

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)``; raises the error of an earlier call if one failed."""
        while len(self._pending) >= self._depth:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(fn, *args))

    def drain(self) -> None:
        """Wait for every queued call; raises the first error."""
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def abort(self) -> None:
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
