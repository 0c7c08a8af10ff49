"""The one output-commit protocol: merge, LoRA export, analysis, Fisher files and recipe runs write through it.

A run writes into a temporary sibling of its target (``.NAME.ram-trl-tmp-PID-XXXXXXXX``, with a lock file naming the
process and the host), and renames it into place only when everything is written:

- **inputs are never removed**: an output directory that holds (or is) a file or directory the run reads is refused,
  with or without ``--overwrite``;
- **``--overwrite`` only replaces a recognisable previous output** (a directory holding one of the run's marker
  files, e.g. ``ram_merge_report.json``, or an empty one); anything else is refused with the list of what would be
  deleted;
- **the commit never replaces a directory that appeared meanwhile**: the final rename is atomic and no-replace
  (``renameat2(RENAME_NOREPLACE)`` on Linux, else a ``mkdir`` reservation), so two concurrent runs cannot silently
  replace each other's output;
- **SIGINT, SIGTERM and SIGHUP** are turned into :class:`Interrupted` while the temporary directory exists, so it is
  removed, together with any parent directory the run created;
- **leftovers of a killed run** (``kill -9``, a power cut) are recognised by the dead process id in their lock file
  (or name) and removed, naming them, by the next run writing to the same place;
- file-system errors (read-only, full, no permission) become an :class:`OutputError` naming the path.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ram_trl.digest import text_digest
from ram_trl.errors import OutputError
from ram_trl.signals import raising_signals

logger = logging.getLogger(__name__)

T = TypeVar("T")

LOCK_FILE = ".ram-trl-lock"
_LEFTOVER = re.compile(r"\.ram-trl-(?:tmp|full|old)-(?P<pid>\d+)-[0-9a-f]{8}$")
#: File-system errors of an output that are the user's to fix (space, read-only, permissions, quota, size).
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG})
_CAUGHT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """A catchable termination signal (SIGTERM, SIGHUP) arrived while an output was being written."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


# ---------------------------------------------------------------------------------------------------------------
# Atomic no-replace rename


def _load_renameat2() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _load_renameat2()
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def rename_noreplace(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` atomically, failing if ``target`` exists (even if it appears meanwhile).

    Uses ``renameat2(RENAME_NOREPLACE)`` on Linux; where the kernel or file system lacks it, reserves ``target``
    with ``mkdir`` (atomic, fails if it exists) and renames onto that empty directory."""
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


# ---------------------------------------------------------------------------------------------------------------
# Signals


def catch_signals() -> contextlib.AbstractContextManager[None]:
    """Turn SIGTERM and SIGHUP into :class:`Interrupted` (SIGINT already raises ``KeyboardInterrupt``), so that
    ``finally`` blocks and ``except BaseException`` cleanups run; see :func:`~ram_trl.signals.raising_signals`."""
    return raising_signals(_CAUGHT_SIGNALS, Interrupted)


# ---------------------------------------------------------------------------------------------------------------
# Leftovers of killed runs


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(entry: Path) -> tuple[int | None, str | None]:
    """The process id and host that made a temporary entry (from its lock file, else its name)."""
    lock = entry / LOCK_FILE
    if lock.is_file():
        with contextlib.suppress(OSError, ValueError, TypeError, json.JSONDecodeError):
            data = json.loads(lock.read_text())
            return int(data["pid"]), str(data.get("host") or "")
    match = _LEFTOVER.search(entry.name)
    return (int(match.group("pid")), None) if match else (None, None)


def remove_stale(target: Path) -> list[Path]:
    """Remove the temporary siblings of ``target`` left by runs that were killed (their process is gone).

    Only entries named like this protocol's temporaries, made on this host by a process that no longer exists, are
    removed; each is named in a warning. Entries of live processes, of other hosts, or without a process id are
    left alone (the latter named in a warning)."""
    parent, name = target.parent, _temp_stem(target.name)
    if not parent.is_dir():
        return []
    removed = []
    host = socket.gethostname()
    for entry in sorted(parent.iterdir()):
        if not (entry.name.startswith(f".{name}.ram-trl-") or entry.name.startswith(f"..{name}.ram-trl-")):
            continue
        pid, owner_host = _owner(entry)
        if pid is None:
            if entry.name.startswith(f".{name}.ram-trl-tmp-") or entry.name.startswith(
                f".{name}.ram-trl-old-"
            ):
                warnings.warn(
                    f"{entry} looks like the leftover of an interrupted ram_trl run (an older version, no process "
                    "id); remove it if no run is writing there",
                    stacklevel=3,
                )
            continue
        if (owner_host and owner_host != host) or pid == os.getpid() or _pid_alive(pid):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
        if not entry.exists():
            removed.append(entry)
            message = f"removed {entry}: the leftover of a ram_trl run (process {pid}) that was killed"
            warnings.warn(message, stacklevel=3)
            logger.warning(message)
    return removed


# ---------------------------------------------------------------------------------------------------------------
# The protocol


def _describe(path: Path, limit: int = 8) -> str:
    entries = sorted(p.name for p in path.iterdir())
    shown = ", ".join(entries[:limit])
    return shown + (f" and {len(entries) - limit} more" if len(entries) > limit else "")


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


def temp_name(target: Path, kind: str = "tmp") -> Path:
    """A fresh temporary sibling of ``target`` named after this process (``kind``: tmp, full or old)."""
    return target.parent / f".{_temp_stem(target.name)}.ram-trl-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _new_file_mode(directory: Path) -> int:
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
    through a private temporary file (safetensors' ``save_file``) leave ``0600`` whatever the umask allows.

    Args:
        path: The file or directory, before it is moved into place.
        mode: The mode of a new file (from :func:`_new_file_mode`).
    """
    files = (
        [path] if not path.is_dir() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    )
    for file in files:
        current = file.stat().st_mode & 0o777
        wanted = mode | ((mode & 0o444) >> 2 if current & 0o100 else 0)
        if current != wanted:
            os.chmod(file, wanted)


#: The longest output name kept whole in a temporary sibling's name (file names stop at 255 bytes).
_STEM_BYTES = 200
#: The longest file name (bytes) of common file systems (ext4, XFS, btrfs, APFS, tmpfs).
_NAME_BYTES = 255


def _temp_stem(name: str) -> str:
    """``name`` as temporary siblings carry it: whole when short, else shortened with a digest of the whole name,
    so that an output name of up to 255 bytes still has a temporary sibling."""
    if len(name.encode()) <= _STEM_BYTES:
        return name
    digest = text_digest(name)[:12]
    return name.encode()[: _STEM_BYTES - 13].decode(errors="ignore") + "-" + digest


def check_name_length(target: Path, what: str) -> None:
    """Refuse an output path with a component longer than file names may be (255 bytes on common file systems)."""
    for part in target.parts:
        size = len(os.fsencode(part))
        if size > _NAME_BYTES:
            raise OutputError(
                f"{what} {target}: the name {part[:40]}... is {size} bytes, over the {_NAME_BYTES} bytes a file "
                "name may have; choose a shorter name"
            )


class OutputDir:
    """The commit protocol of one output directory.

    Example::

        out = OutputDir(Path("merged"), overwrite=False, reads=[("merge config", cfg)], markers=("report.json",))
        out.check()
        temp = out.begin()
        try:
            ...  # write into temp
            out.commit()
        except BaseException:
            out.abort()
            raise"""

    def __init__(
        self,
        target: str | os.PathLike,
        *,
        overwrite: bool = False,
        reads: Sequence[tuple[str, Path]] = (),
        markers: Sequence[str] = (),
        what: str = "output directory",
        replace_previous: bool = False,
        merge: bool = False,
    ) -> None:
        self.target = Path(target)
        self.merge = merge
        self.overwrite = overwrite
        self.reads = [(label, Path(path)) for label, path in reads]
        self.markers = tuple(markers)
        self.what = what
        self.replace_previous = replace_previous
        self.temp: Path | None = None
        self._created: list[Path] = []
        self._signals: contextlib.ExitStack | None = None

    # -- checks -------------------------------------------------------------------------------------------------

    def check(self) -> None:
        """Refuse an output that overlaps an input, or that exists and may not be replaced. Cheap; call it before
        reading any tensor (and :meth:`commit` checks again)."""
        check_name_length(self.target, self.what)
        self._check_inputs()
        self._check_existing()

    def _check_inputs(self) -> None:
        out = self.target.resolve()
        for label, path in self.reads:
            if not path.exists():
                continue
            source = path.resolve()
            inside = source == out or source.is_relative_to(out)
            if inside or (path.is_dir() and out.is_relative_to(source)):
                raise OutputError(
                    f"{self.what} {self.target} overlaps the {label} at {path}, which this run reads; write the "
                    "output elsewhere (--overwrite never removes an input)"
                )

    def replaceable(self) -> bool:
        """Whether the existing target may be replaced: an empty directory or one holding a marker file."""
        if not self.target.is_dir() or self.target.is_symlink():
            return False
        return not any(self.target.iterdir()) or any((self.target / m).is_file() for m in self.markers)

    def _check_existing(self) -> None:
        if not (self.target.exists() or self.target.is_symlink()):
            return
        if self.merge and self.target.is_dir():
            return
        if not (self.overwrite or self.replace_previous):
            raise OutputError(
                f"{self.what} {self.target} already exists; pass --overwrite (overwrite=True) to replace it, or "
                "choose another location"
            )
        if not self.replaceable():
            if not self.target.is_dir() or self.target.is_symlink():
                found = "a symbolic link" if self.target.is_symlink() else "a file"
                raise OutputError(
                    f"{self.what} {self.target} exists and is {found}, not a previous ram_trl output; remove it "
                    "yourself or choose another location"
                )
            markers = " or ".join(self.markers) or "a ram_trl marker file"
            raise OutputError(
                f"{self.what} {self.target} exists and is not a previous ram_trl output (no {markers}); replacing "
                f"it would delete: {_describe(self.target)}. Remove it yourself or choose another location"
            )

    # -- the run ------------------------------------------------------------------------------------------------

    def begin(self, temp: Path | None = None) -> Path:
        """Remove killed runs' leftovers, create missing parents and the temporary directory (with its lock file),
        and start catching SIGTERM/SIGHUP. Returns the temporary directory."""
        self.check()
        remove_stale(self.target)
        self.temp = temp or temp_name(self.target)
        stack = contextlib.ExitStack()
        stack.enter_context(catch_signals())
        self._signals = stack
        try:
            self._make_parents(self.temp.parent)
            self.temp.mkdir()
            lock = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            (self.temp / LOCK_FILE).write_text(json.dumps({**lock, "target": str(self.target)}) + "\n")
        except OSError as exc:
            self.abort()
            raise as_output_error(exc, f"{self.what} {self.target}") from exc
        except BaseException:
            self.abort()
            raise
        return self.temp

    def _make_parents(self, parent: Path) -> None:
        missing = []
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for directory in reversed(missing):
            directory.mkdir()
            self._created.append(directory)

    def commit(self, remove: Sequence[str] = ()) -> None:
        """Move the temporary directory into place: atomically, never onto a directory that appeared meanwhile;
        with ``overwrite``, the previous output is moved aside first and removed after."""
        assert self.temp is not None, "begin() first"
        try:
            (self.temp / LOCK_FILE).unlink(missing_ok=True)
            make_readable(self.temp, _new_file_mode(self.temp))
            if self.merge and self.target.is_dir():
                merge_into(self.temp, self.target, last=self.markers, remove=remove)
                shutil.rmtree(self.temp, ignore_errors=True)
                self.temp = None
                self._created = []
                self._release()
                return
            old = None
            if self.target.exists() or self.target.is_symlink():
                if not (self.overwrite or self.replace_previous):
                    raise OutputError(self._appeared())
                self._check_existing()
                old = temp_name(self.target, "old")
                os.rename(self.target, old)
            try:
                rename_noreplace(self.temp, self.target)
            except FileExistsError:
                raise OutputError(self._appeared()) from None
            except BaseException:
                if old is not None:
                    with contextlib.suppress(OSError):
                        rename_noreplace(old, self.target)
                raise
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            self.abort()
            raise as_output_error(exc, f"{self.what} {self.target}") from exc
        except BaseException:
            self.abort()
            raise
        self.temp = None
        self._created = []
        self._release()

    def _appeared(self) -> str:
        return (
            f"{self.what} {self.target} appeared while this run was writing (another run writing to the same place?); "
            "this run's output was discarded and the other left untouched. Choose another location or pass --overwrite"
        )

    def abort(self) -> None:
        """Remove the temporary directory and the parent directories this run created."""
        if self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)
            self.temp = None
        for directory in reversed(self._created):
            with contextlib.suppress(OSError):
                directory.rmdir()  # only if empty
        self._created = []
        self._release()

    def _release(self) -> None:
        if self._signals is not None:
            self._signals.close()
            self._signals = None

    # -- one place for the whole protocol -------------------------------------------------------------------------

    def write(self, fill: Callable[[Path], T], what: str | None = None) -> T:
        """Write the output in one go: :meth:`begin`, ``fill(temp)``, :meth:`commit`; :meth:`abort` on any failure."""
        temp = self.begin()
        try:
            with guard_os_errors(what or f"{self.what} {self.target}"):
                result = fill(temp)
            self.commit()
        except BaseException:
            self.abort()
            raise
        return result

    @contextlib.contextmanager
    def shared(self, dist: Any) -> Iterator[Path]:
        """The protocol over the processes of a distributed run: the main process begins (and aborts on any
        failure), every process writes into the temporary directory it yields; the main process calls
        :meth:`commit` once every file is written."""
        temp = dist.guarded(lambda: str(self.begin()) if dist.is_main else None)
        temp_dir = Path(dist.broadcast_object(temp))
        try:
            with guard_os_errors(f"{self.what} {self.target}"):
                yield temp_dir
        except BaseException:
            if dist.is_main:
                self.abort()
            raise

    def __enter__(self) -> Path:
        return self.begin()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def merge_into(source: Path, target: Path, last: Sequence[str] = (), remove: Sequence[str] = ()) -> None:
    """Move every entry of the directory ``source`` into the existing directory ``target``, replacing entries of
    the same name, all or nothing: on any failure (or signal) the entries moved in are removed and the replaced
    ones restored.

    The entries named in ``last`` (the markers of a complete output, e.g. ``ram_stage.json``) are moved aside
    before anything else and the new ones moved in after everything else, so that a process killed half-way
    (``kill -9``, where no rollback runs) leaves a ``target`` without them: detectably incomplete. The replaced
    entries wait in a temporary sibling (``.NAME.ram-trl-old-PID-...``), which :func:`remove_stale` removes."""
    names = sorted(p.name for p in source.iterdir() if p.name != LOCK_FILE)
    ordered = [n for n in names if n not in last] + [n for n in last if n in names]
    aside_order = [n for n in last if (target / n).exists()] + [n for n in ordered if n not in last]
    aside_order += [n for n in remove if n not in aside_order]
    old = temp_name(target, "old")
    old.mkdir()
    aside: list[str] = []
    moved: list[str] = []
    try:
        for name in aside_order:
            if (target / name).exists() or (target / name).is_symlink():
                os.rename(target / name, old / name)
                aside.append(name)
        for name in ordered:
            os.rename(source / name, target / name)
            moved.append(name)
    except BaseException:
        for name in reversed(moved):
            _remove(target / name)
        for name in reversed(aside):
            with contextlib.suppress(OSError):
                os.rename(old / name, target / name)
        with contextlib.suppress(OSError):
            old.rmdir()  # only if everything was restored
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike, what: str = "output file") -> Iterator[Path]:
    """Write one file atomically: yields a temporary sibling path (named after this process); on success it
    replaces ``target``, on any failure or catchable signal it is removed. Killed runs' leftovers beside
    ``target`` are removed first."""
    target = Path(target)
    remove_stale(target)
    temp = temp_name(target)
    try:
        with catch_signals(), guard_os_errors(f"{what} {target}"):
            yield temp
            make_readable(temp, _new_file_mode(temp.parent))
            os.replace(temp, target)
    except OSError as exc:
        raise as_output_error(exc, f"{what} {target}") from exc
    finally:
        with contextlib.suppress(OSError):
            temp.unlink()


def check_output_file(
    target: str | os.PathLike,
    reads: Sequence[tuple[str, Path]] = (),
    *,
    overwrite: bool = False,
    what: str = "output file",
    flag: str = "--overwrite",
) -> None:
    """Refuse to write one file over an input or over an existing file (without ``overwrite``).

    The rule of every writer: nothing is written over something the run reads (with or without ``overwrite``), nor
    over a file the run did not create unless the user asked for it with ``flag``."""
    target = Path(target)
    check_name_length(target, what)
    out = target.resolve()
    for label, path in reads:
        if not path.exists():
            continue
        source = path.resolve()
        if source == out or out.is_relative_to(source):
            raise OutputError(
                f"{what} {target} would write over the {label} at {path}, which this run reads; write it elsewhere "
                f"({flag} never replaces an input)"
            )
    if target.is_dir() or target.is_symlink():
        raise OutputError(f"{what} {target} is a directory or a symbolic link; give a new file name")
    if target.exists() and not overwrite:
        raise OutputError(
            f"{what} {target} already exists; pass {flag} to replace it, or choose another name"
        )


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
