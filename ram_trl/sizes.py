"""Values given by the user: the one parser of ``"5GB"``-style byte sizes (``KB``/``K`` ... powers of 1000, ``KiB`` ...
powers of 1024, a bare number counts bytes) and their formatting, and the one check of a number (finite, in float32,
within bounds), each error naming the place and the field. Imports nothing heavier than :mod:`ram_trl.errors`."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

from ram_trl.errors import ConfigError

__all__ = ["FLOAT32_MAX", "check_number", "check_optional_number", "format_bytes", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}
_UNITS.update({"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4, "K": 1000, "M": 1000**2, "G": 1000**3})


def parse_size(value: str | int, *, lowercase_b_is_bits: bool = False, name: str | None = None) -> int:
    """Bytes in a size such as ``"5GB"``, ``"500MiB"``, ``"1.5GB"`` or ``1048576``."""
    size = value if isinstance(value, int) and not isinstance(value, bool) else _parse(value, lowercase_b_is_bits)
    if name is not None and size < 1:
        raise ConfigError(f"{name}={value!r}: give a positive size, e.g. 5GB, 500MB or 256MiB")
    return size


def _parse(value: str, lowercase_b_is_bits: bool) -> int:
    if not isinstance(value, str):
        raise ConfigError(f"cannot parse size {value!r}; write e.g. 5GB, 500MB or 256MiB")
    match = _SIZE.match(value)
    unit = (match.group(2) or "").upper() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(f"cannot parse size {value!r}; write e.g. 5GB, 500MB or 256MiB")
    size = int(Decimal(match.group(1)) * _UNITS[unit])
    text = (match.group(2) or "").strip()
    if lowercase_b_is_bits and text.endswith("b") and unit in ("KB", "MB", "GB", "TB"):
        size //= 8
    return size


def format_bytes(num: float) -> str:
    """A byte count in decimal units with two decimals (``"1.50 GB"``; whole bytes below 1 KB: ``"512 B"``)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(num) < 1000 or unit == "TB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1000
    raise AssertionError


#: The largest finite float32: the merge computes in float32, so a parameter beyond it would be infinite there.
FLOAT32_MAX = 3.4028234663852886e38  # float(torch.finfo(torch.float32).max)


def check_number(
    value: Any,
    where: str,
    name: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    integer: bool = False,
) -> float:
    """A finite number within bounds, or a :class:`ConfigError` naming ``where`` and ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: {name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{where}: {name} must be a finite number, got {value!r}; give a finite value")
    if abs(number) > FLOAT32_MAX:
        raise ConfigError(
            f"{where}: {name} is {value!r}, beyond float32 (the merge computes in float32, |x| <= 3.4e38); give a "
            "smaller value"
        )
    if integer and not number.is_integer():
        raise ConfigError(f"{where}: {name} must be a whole number, got {value!r}")
    if minimum is not None and number < minimum:
        raise ConfigError(f"{where}: {name} must be >= {minimum}, got {value!r}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{where}: {name} must be <= {maximum}, got {value!r}")
    if above is not None and number <= above:
        raise ConfigError(f"{where}: {name} must be > {above}, got {value!r}")
    return number


def check_optional_number(value: Any, where: str, name: str, **bounds: Any) -> float | None:
    return None if value is None else check_number(value, where, name, **bounds)
