"""Process-level settings of the command-line tools (never applied on ``import ram_trl``).

A merge or an analysis allocates and frees the same few block-sized float32 temporaries thousands of times. glibc
returns freed blocks above its (dynamic) mmap threshold to the kernel and takes fresh, zero-filled pages for the next
one: a page fault per 4 KiB, about a third of a 270M-parameter merge's system time. :func:`tune_for_streaming` keeps
such blocks in the heap instead, and moves the objects created by the imports into the garbage collector's permanent
generation so that its full collections during the passes do not walk them. :func:`gc_paused` keeps the cyclic
collector off while a command imports torch and the merge stack.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Allocations up to this size come from the heap (glibc's largest allowed mmap threshold on 64-bit systems).
MMAP_THRESHOLD = 32 * 2**20

#: Free memory at the top of the heap kept for reuse instead of being returned to the kernel.
TRIM_THRESHOLD = 256 * 2**20


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector inside the block, then restore its previous state.

    Importing torch creates about a million objects; the collector would walk them over and over (about 0.3 s of
    every command's start-up) and find nothing to free. The command line pauses it around its imports only: a
    library must not change the collector for the program that imports it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def tune_for_streaming() -> bool:
    """Keep block-sized allocations in the heap and freeze the objects created so far (see the module docstring).

    Larger buffers (the chunks read from disk) are still mapped and returned to the kernel when freed, so the
    resident set stays bounded by the chunk budget plus at most :data:`TRIM_THRESHOLD`."""
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
