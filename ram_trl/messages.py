"""One voice for errors and warnings: pydantic's errors in our words, did-you-mean for names, dtype aliases accepted
alike everywhere, and (in the command line's own process only) each warning printed once as ``warning: ...``."""

from __future__ import annotations

import contextlib
import difflib
import logging
import re
import typing
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = [
    "DTYPE_ALIASES",
    "canonical_dtype",
    "did_you_mean",
    "one_voice",
    "processes_phrase",
    "owned_process_filters",
    "shown",
    "validation_message",
]

#: Other spellings of the float dtypes, as torch, mergekit and the command lines write them.
DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp64": "float64",
    "double": "float64",
}


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to a mistyped ``name``, else ``""``."""
    choices = [str(c) for c in choices]
    swapped = [c for c in choices if sorted(c) == sorted(str(name)) and c != name]  # two letters swapped
    close = swapped[:1] or difflib.get_close_matches(str(name), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def processes_phrase(count: int) -> str:
    """``"1 process"`` / ``"2 processes"``: how many processes ran (``accelerate launch --num_processes 2`` without
    ``--multi_gpu`` runs one), as merges, stages and their reports say it."""
    return f"{count} process" + ("" if count == 1 else "es")


def canonical_dtype(value: Any, allowed: Iterable[str] = ("bfloat16", "float16", "float32")) -> Any:
    """The canonical name of a dtype alias (``bf16``, ``fp16``, ``torch.float16``, ...); anything else unchanged."""
    if not isinstance(value, str):
        value = str(value) if type(value).__name__ == "dtype" else value
        if not isinstance(value, str):
            return value
    key = value.strip().lower().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    return key if key in tuple(allowed) else value


def _known_fields(model: type | None, loc: tuple[Any, ...]) -> list[str]:
    """The field names of the (nested) pydantic model at ``loc`` (list indices and dict keys skipped)."""
    for part in loc:
        if model is None:
            return []
        fields = getattr(model, "model_fields", {})
        if isinstance(part, int) or part not in fields:
            continue
        model = _model_in(fields[part].annotation)
    return list(getattr(model, "model_fields", {})) if model is not None else []


def _model_in(annotation: Any) -> type | None:
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def validation_message(exc: Any, model: type | None = None) -> str:
    """A pydantic ``ValidationError`` in our words: each problem as the field, the value given and what to change."""
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        kind, value, msg = err["type"], err.get("input"), err["msg"]
        if kind == "extra_forbidden":
            known = _known_fields(model, loc[:-1])
            hint = did_you_mean(str(loc[-1]), known) or (f"; known fields: {', '.join(known)}" if known else "")
            problems.append(f"unknown field {where!r}{hint}; remove it or correct its name")
        elif kind == "missing":
            problems.append(f"{where} is missing; add it")
        elif kind in ("value_error", "assertion_error"):
            problems.append(f"{where}: {msg.removeprefix('Value error, ').removeprefix('Assertion failed, ')}")
        elif kind in ("literal_error", "enum"):
            expected = str((err.get("ctx") or {}).get("expected", ""))
            choices = [c.strip().strip("'\"") for c in expected.replace(" or ", ", ").split(",") if c.strip()]
            problems.append(
                f"{where}: {value!r} is not one of {', '.join(choices)}{did_you_mean(str(value), choices)}"
            )
        else:
            text = re.sub(r"^(Input|String|Value|List|Dictionary) should", "must", msg) if msg else kind
            shown_value = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            problems.append(f"{where} = {shown_value}: {text[0].lower() + text[1:]}")
    return "; ".join(problems)


_SHOWN: set[str] = set()  #: Messages the command line has printed (empty outside it): summaries skip them.


def shown(message: str) -> bool:
    """Whether the command line has already printed ``message`` as a warning (always ``False`` outside it)."""
    return message in _SHOWN


class _Once(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        text = record.getMessage()
        if text in _SHOWN:
            return False
        _SHOWN.add(text)
        return True


class _Voice(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


class _ThirdPartyNoise(logging.Filter):
    """Notices a user cannot act on, dropped in the processes ram_trl owns (the command line, stage processes)."""

    NOTICES = {"DeepSpeed": ("Setting accelerator to CPU",)}

    def __init__(self, logger: str) -> None:
        super().__init__()
        self.starts = self.NOTICES[logger]

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def owned_process_filters() -> list[tuple[logging.Logger, logging.Filter]]:
    """Drop third-party notices a user cannot act on (DeepSpeed's "Setting accelerator to CPU" on a CPU machine).
    Only for processes ram_trl owns: the command line and its stage processes, never a user's script."""
    installed = []
    for name in _ThirdPartyNoise.NOTICES:
        logger, noise = logging.getLogger(name), _ThirdPartyNoise(name)
        logger.addFilter(noise)
        installed.append((logger, noise))
    return installed


@contextlib.contextmanager
def one_voice(level: int = logging.WARNING) -> Iterator[None]:
    """For the command line's own process: log records as ``warning: ...`` on standard error, Python warnings
    through the same path (no source line), each message once. Never used inside a user's process."""
    handler = logging.StreamHandler()
    handler.setFormatter(_Voice())
    handler.addFilter(_Once())
    root = logging.getLogger()
    previous_level = root.level
    root.addHandler(handler)
    root.setLevel(level)
    noise = owned_process_filters()

    def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        logging.getLogger("ram_trl").warning(str(message))

    try:
        with warnings.catch_warnings():
            warnings.showwarning = show
            yield
    finally:
        root.removeHandler(handler)
        root.setLevel(previous_level)
        for logger, installed in noise:
            logger.removeFilter(installed)
        _SHOWN.clear()
