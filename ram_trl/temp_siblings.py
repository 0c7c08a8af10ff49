"""Temporary siblings of an output: their names, their lock file, and the removal of those killed runs left."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import uuid
import warnings
from pathlib import Path

from ram_trl.digest import text_digest

logger = logging.getLogger(__name__)

LOCK_FILE = ".ram-trl-lock"
_LEFTOVER = re.compile(r"\.ram-trl-(?:tmp|full|old)-(?P<pid>\d+)-[0-9a-f]{8}$")


def temp_name(target: Path, kind: str = "tmp") -> Path:
    """A fresh temporary sibling of ``target`` named after this process (``kind``: tmp, full or old)."""
    return target.parent / f".{_temp_stem(target.name)}.ram-trl-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


_STEM_BYTES = 200  #: The longest output name kept whole in a temporary sibling's name (file names stop at 255 bytes).


def _temp_stem(name: str) -> str:
    """``name`` in a temporary sibling's name: whole when short, else cut with its digest (names up to 255 bytes)."""
    if len(name.encode()) <= _STEM_BYTES:
        return name
    digest = text_digest(name)[:12]
    return name.encode()[: _STEM_BYTES - 13].decode(errors="ignore") + "-" + digest


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
    """Remove the temporary siblings of ``target`` left by runs that were killed (their process is gone)."""
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
            if entry.name.startswith(f".{name}.ram-trl-tmp-") or entry.name.startswith(f".{name}.ram-trl-old-"):
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


__all__ = ["LOCK_FILE", "remove_stale", "temp_name"]
