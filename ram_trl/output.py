"""The one output-commit protocol (merge, LoRA export, analysis, Fisher files, recipe runs): write into a temporary
sibling with a lock file, commit by an atomic no-replace rename; inputs are never removed, ``--overwrite`` replaces
only a recognisable previous output, signals and killed runs leave nothing behind (docs/bad-input.md, "The output")."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ram_trl.errors import OutputError
from ram_trl.fs import make_readable, new_file_mode, rename_noreplace
from ram_trl.output_errors import as_output_error, guard_os_errors
from ram_trl.signals import catch_signals
from ram_trl.temp_siblings import LOCK_FILE, remove_stale, temp_name

T = TypeVar("T")


def _describe(path: Path, limit: int = 8) -> str:
    entries = sorted(p.name for p in path.iterdir())
    shown = ", ".join(entries[:limit])
    return shown + (f" and {len(entries) - limit} more" if len(entries) > limit else "")


_NAME_BYTES = 255  #: The longest file name (bytes) of common file systems (ext4, XFS, btrfs, APFS, tmpfs).


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
    """The commit protocol of one output directory."""

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
            make_readable(self.temp, new_file_mode(self.temp))
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
        """The protocol over a distributed run's processes: the main process begins (and aborts on any failure) and
        calls :meth:`commit` once every file is written; every process writes into the directory it yields."""
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
    ones restored."""
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
            make_readable(temp, new_file_mode(temp.parent))
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
    """Refuse to write one file over an input or over an existing file (without ``overwrite``)."""
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
        raise OutputError(f"{what} {target} already exists; pass {flag} to replace it, or choose another name")
