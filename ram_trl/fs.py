"""File-system primitives of the output commit: an atomic no-replace rename, and the mode of a new file."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path


def libc_function(name: str, argtypes: list[type]) -> Callable[..., int] | None:
    """libc's ``name`` (an ``int`` result, errno kept) on Linux; ``None`` elsewhere or where libc lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = libc_function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def rename_noreplace(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` atomically, failing if ``target`` exists (even if it appears meanwhile)."""
    if _RENAMEAT2 is not None:
        result = _RENAMEAT2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE)
        if result == 0:
            return
        code = ctypes.get_errno()
        if code == errno.EEXIST or code == errno.ENOTEMPTY:
            raise FileExistsError(code, os.strerror(code), str(target))
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), str(target))
    _rename_reserved(source, target)


def _rename_reserved(source: Path, target: Path) -> None:
    """The portable fallback of :func:`rename_noreplace`: reserve ``target`` with ``mkdir``, then rename onto it."""
    if source.is_dir():
        os.mkdir(target)  # FileExistsError if it exists: only one process wins the reservation
        try:
            os.rename(source, target)  # replaces the empty directory this process just made
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(target)
            raise
        return
    os.link(source, target)  # FileExistsError if it exists
    os.unlink(source)


def new_file_mode(directory: Path) -> int:
    """The mode a file newly created in ``directory`` gets: ``0o666`` less the umask (and default ACLs), probed with
    a file rather than read with ``os.umask`` (which sets the process-wide umask)."""
    probe = directory / f".ram-trl-mode-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()


def make_readable(path: Path, mode: int) -> None:
    """Give ``path`` (a file, or every file under a directory) ``mode``, keeping execute bits: writers that go
    through a private temporary file (safetensors' ``save_file``) leave ``0600`` whatever the umask allows."""
    files = [path] if not path.is_dir() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    for file in files:
        current = file.stat().st_mode & 0o777
        wanted = mode | ((mode & 0o444) >> 2 if current & 0o100 else 0)
        if current != wanted:
            os.chmod(file, wanted)


__all__ = ["libc_function", "make_readable", "new_file_mode", "rename_noreplace"]
