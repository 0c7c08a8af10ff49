"""File-system errors of an output (full disk, read-only, no permission) as one :class:`OutputError` line."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator

from ram_trl.errors import OutputError

#: File-system errors of an output that are the user's to fix (space, read-only, permissions, quota, size).
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG})


def as_output_error(exc: OSError, what: str) -> OutputError:
    """An :class:`OutputError` for a file-system error of the output ``what``, with what to do about it."""
    reason = exc.strerror or str(exc)
    hint = {
        errno.ENOSPC: "free some space or choose another output location",
        errno.EROFS: "the file system is read-only: choose another output location",
        errno.EACCES: "no permission: choose another output location",
        errno.EPERM: "no permission: choose another output location",
    }.get(exc.errno or 0, "choose another output location")
    where = exc.filename or what
    return OutputError(f"cannot write {what} ({where}: {reason}); {hint}")


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def wrapped_errno(exc: BaseException) -> int | None:
    """The ``errno`` of a file-system error that a library reports as its own exception type: safetensors' Rust
    writer raises ``SafetensorError("... (os error 28) ...")`` for a full disk."""
    if type(exc).__name__ != "SafetensorError":
        return None
    match = _OS_ERROR.search(str(exc))
    return int(match.group(1)) if match else None


def guard_os_errors(what: str) -> contextlib.AbstractContextManager[None]:
    """A context that turns file-system errors of the output (``ENOSPC``, ``EROFS``, ...) into :class:`OutputError`."""

    @contextlib.contextmanager
    def guard() -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            if exc.errno in OUTPUT_ERRNOS:
                raise as_output_error(exc, what) from exc
            raise
        except Exception as exc:
            code = wrapped_errno(exc)
            if code in OUTPUT_ERRNOS:
                raise as_output_error(OSError(code, os.strerror(code)), what) from exc
            raise

    return guard()


__all__ = ["OUTPUT_ERRNOS", "as_output_error", "guard_os_errors", "wrapped_errno"]
