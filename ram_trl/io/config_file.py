"""A YAML config file read in one step that refuses, in one line, what is not a readable regular file (missing, a
directory, a FIFO or device that would block), text that is not YAML, and YAML nested too deep to build."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from ram_trl.errors import ConfigError

__all__ = ["read_yaml_file"]

#: Nesting deeper than this (flow or block collections) is refused before parsing: no config needs it, and the
#: parser's recursion would overflow.
MAX_DEPTH = 200


def _kind(path: Path) -> str | None:
    """What ``path`` is when it is not a regular file (``None`` when it is one)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return "does not exist"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, not a YAML file"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (named pipe), not a YAML file"
    return "is not a regular file (a device or socket)"


def _too_deep(text: str) -> bool:
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    indents = {len(line) - len(line.lstrip(" -")) for line in text.splitlines() if line.strip()}
    return deepest > MAX_DEPTH or len(indents) > MAX_DEPTH


def read_yaml_file(path: Path, what: str) -> Any:
    """The parsed content of a YAML file."""
    import yaml

    kind = _kind(path)
    if kind is not None:
        raise ConfigError(f"{what} {path} {kind}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path} cannot be read ({exc})") from None
    if _too_deep(text):
        raise ConfigError(f"{what} {path} is nested more than {MAX_DEPTH} levels deep; no config needs that")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    except RecursionError:
        raise ConfigError(f"{what} {path} is nested too deep to read") from None
