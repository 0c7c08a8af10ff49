"""Process-level settings of the command-line tools, never applied on ``import ram_trl``: block-sized temporaries
kept in glibc's heap (a page fault per 4 KiB otherwise), the import's objects frozen, the collector paused while
torch imports (docs/memory.md, "Process settings of the command line")."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc ``mallopt`` parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  #: Allocations up to this size stay in the heap (glibc's maximum mmap threshold, 64-bit).
TRIM_THRESHOLD = 256 * 2**20  #: Free memory at the top of the heap kept for reuse, not returned to the kernel.


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector inside the block, then restore its previous state: importing torch creates
    about a million objects it would walk in vain (0.3 s of start-up). The command line's imports only."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def tune_for_streaming() -> bool:
    """Keep block-sized allocations in the heap and freeze the objects created so far; larger buffers (chunks) are
    still mapped, so the resident set stays within the chunk budget plus :data:`TRIM_THRESHOLD`."""
    gc.freeze()
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    logger.debug("allocator tuned for streaming: %s", applied)
    return applied
