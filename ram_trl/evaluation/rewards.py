"""Reward functions imported by path and wrapped so that a failure names the stage and the function."""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from typing import Any

from ram_trl.errors import ConfigError, RamTrlError

__all__ = ["StageFailure", "check_reward_values", "import_object", "wrap_reward"]


def import_object(path: str, what: str = "object") -> Any:
    """Import ``package.module:attribute`` (or ``package.module.attribute``)."""
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ConfigError(f"{what} {path!r}: write it as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what} {path!r}: cannot import module {module_name!r} ({exc})") from None
    obj = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {path!r}: module {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    return obj


class StageFailure(RamTrlError, RuntimeError):
    """A stage's user code (reward function, generator) failed; the message names the stage and the function."""


def wrap_reward(fn: Callable[..., Any], path: str, stage: str) -> Callable[..., Any]:
    """Wrap a reward function so its exceptions and malformed outputs (:func:`check_reward_values`) name the stage."""

    @functools.wraps(fn)
    def reward(*args: Any, **kwargs: Any) -> list[float | None]:
        try:
            values = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised with the stage and function named
            raise StageFailure(f"stage {stage!r}: reward function {path} raised {exc!r}") from exc
        count = len(kwargs["completions"]) if "completions" in kwargs else len(args[0]) if args else 0
        try:
            return check_reward_values(values, count, f"stage {stage!r}: reward function {path}")
        except ConfigError as exc:
            raise StageFailure(str(exc)) from None

    if not hasattr(reward, "__name__"):
        reward.__name__ = path.rpartition(":")[2] or path
    return reward


def check_reward_values(values: Any, count: int, where: str) -> list[float | None]:
    """A reward function's output: one finite number (or ``None``, TRL's "does not apply") per completion."""
    if values is None or isinstance(values, str | bytes | dict) or not hasattr(values, "__len__"):
        raise ConfigError(f"{where} returned {type(values).__name__}; return a list with one float per completion")
    if len(values) != count:
        raise ConfigError(
            f"{where} returned {len(values)} values for {count} completions; return one float per completion"
        )
    out: list[float | None] = []
    for index, value in enumerate(values):
        if value is None:
            out.append(None)
            continue
        try:
            if isinstance(value, str | bytes):
                raise TypeError
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"{where}: value {index} is {value!r:.40}, not a number; return a float (None: not scored)"
            ) from None
        if not math.isfinite(number):
            raise ConfigError(
                f"{where}: value {index} is {number}; return a finite float, or None for a completion the "
                "function does not score"
            )
        out.append(number)
    return out
