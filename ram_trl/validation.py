"""The one validation layer: every number, header, index, adapter config and device a command reads is checked here
before any tensor data is read.

Each check raises a :class:`~ram_trl.errors.RamTrlError` subclass whose message names the file, the field or
tensor, and what to change, so the command line can print it as one ``error:`` line and exit 2. The checks depend
only on :mod:`ram_trl.errors` and torch: the config, the checkpoint readers, the analysis and the Fisher tools all
call them, and none of them is called from inside the chunk loops (the data-dependent checks, NaN/Inf values,
stream with the data in :mod:`ram_trl.merging.streaming`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ram_trl.errors import CheckpointError, ConfigError, RamTrlError
from ram_trl.sizes import parse_size

#: Tensor names of vocabulary-sized tensors (rows = tokens): the only tensors ``merge_common_rows`` may resize.
VOCABULARY_PATTERN = re.compile(r"^(?!.*pos)(.*\.)?([^.]*embed[^.]*|wte|lm_head)(\.|$)|^(output|shared)\.")

#: The largest finite float32: the merge computes in float32, so a parameter beyond it would be infinite there.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


# ---------------------------------------------------------------------------------------------------------------
# Numbers


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
    """A finite number within bounds, or a :class:`ConfigError` naming ``where`` and ``name``.

    Args:
        value: The value as read (YAML, JSON or the command line).
        where: The file or context (e.g. ``"merge.yaml: models[1] (./coder)"``).
        name: The field's name.
        minimum: Inclusive lower bound.
        maximum: Inclusive upper bound.
        above: Exclusive lower bound.
        integer: Require a whole number.

    Returns:
        The value as a float (an ``int``-valued float when ``integer``).
    """
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
    """:func:`check_number` for a value that may be ``None`` (not given).

    Args:
        value: The value as read, or ``None``.
        where: The file or context.
        name: The field's name.
        **bounds: :func:`check_number`'s keyword arguments (``minimum``, ``maximum``, ``above``, ``integer``).

    Returns:
        ``None`` for ``None``, else the checked value as a float.
    """
    return None if value is None else check_number(value, where, name, **bounds)


def check_callback_arguments(arguments: Mapping[str, Any], where: str = "TaskVectorSparsityCallback") -> None:
    """Validate the arguments of the telemetry callback before any training: types, finiteness, ranges and the
    characters of names (a stage name becomes a directory label, a merge row and a model-card line).

    Args:
        arguments: The constructor's arguments by name (those absent are not checked).
        where: How messages name the callback.

    Raises:
        ConfigError: naming the argument, the value and what to give.
    """

    def fail(name: str, value: Any, want: str) -> None:
        raise ConfigError(f"{where}: {name}={value!r}: {want}")

    def positive_int(name: str) -> None:
        value = arguments.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            fail(name, value, "give a positive integer (or None)")

    positive_int("every_n_steps")
    positive_int("threads")
    positive_int("magnitude_sample")
    for name in ("eps", "r", "alpha"):
        if name in arguments:
            check_number(arguments[name], where, name, minimum=0.0)
    for name in ("magnitudes", "save_agent", "write_stage"):
        if name in arguments and not isinstance(arguments[name], bool):
            fail(name, arguments[name], "give True or False")
    base = arguments.get("base_model")
    if base is not None and not isinstance(base, str | os.PathLike):
        fail("base_model", base, "give the base checkpoint's directory (a path)")
    prior = arguments.get("prior_stages", ())
    if isinstance(prior, str | bytes | os.PathLike) or not isinstance(prior, Sequence):
        fail(
            "prior_stages", prior, "give a list of stage manifests or their directories, e.g. ['runs/coding']"
        )
    for item in prior:
        if not isinstance(item, str | os.PathLike):
            fail("prior_stages", prior, "every entry must be a path")
    prefix = arguments.get("prefix", "")
    if not isinstance(prefix, str) or any(ord(c) < 32 for c in prefix):
        fail("prefix", prefix, "give a string without control characters")
    for name in ("stage_name", "domain"):
        value = arguments.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip():
            fail(name, value, "give a non-empty string (or None)")
        if any(ord(c) < 32 or ord(c) == 127 for c in value) or len(value) > 200:
            fail(
                name, value, "give one line of at most 200 characters, without control characters (newlines)"
            )
        if name == "stage_name" and any(c in value for c in "/\\|"):
            fail(name, value, "a stage name may not hold '/', '\\' or '|' (it labels files, rows and tables)")


def check_reward_values(values: Any, count: int, where: str) -> list[float | None]:
    """A reward function's output: one finite number (or ``None``, TRL's "does not apply") per completion.

    Args:
        values: What the function returned.
        count: The number of completions it was given.
        where: The stage and the function, e.g. ``"stage 'coding': reward function pkg:fn"``.

    Returns:
        The values as floats (``None`` kept).

    Raises:
        ConfigError: naming the function, the completion and what to return instead.
    """
    if values is None or isinstance(values, str | bytes | dict) or not hasattr(values, "__len__"):
        raise ConfigError(
            f"{where} returned {type(values).__name__}; return a list with one float per completion"
        )
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


def check_weight_sums(sums: Mapping[str, float], where: str, method: str) -> None:
    """Refuse per-tensor weight sums that a normalising method would divide by: zero or not finite.

    Args:
        sums: Tensor name to the sum of the agents' weights for it (after filter rules).
        where: The config file.
        method: The method name.
    """
    for tensor, total in sums.items():
        if not math.isfinite(total) or abs(total) < 1e-8:
            raise ConfigError(
                f"{where}: {method} with normalize: the agents' weights for tensor {tensor!r} sum to {total:g}, "
                "and the merge divides by that sum; change the weights (or their filter rules) or set "
                "normalize: false"
            )


def check_device(device: Any) -> torch.device:
    """A device the merge can compute on: ``cpu``, ``cuda`` or ``cuda:N`` (with CUDA available).

    Raises:
        ConfigError: for anything else, naming the value and the choices.
    """
    try:
        parsed = torch.device(str(device))
    except (RuntimeError, ValueError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: unknown device; use cpu, cuda or cuda:N")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: no CUDA device is available; use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s); use cuda:0.."
            )
    return parsed


def check_input_cache(setting: Any) -> int | None:
    """An ``input_cache`` setting: ``"auto"``, ``"off"`` or a size.

    Args:
        setting: The value given (``--input-cache``).

    Returns:
        ``None`` for ``"auto"``, the bytes of a size (0 for ``"off"``).

    Raises:
        ConfigError: for anything else, naming the value and the choices.
    """
    if isinstance(setting, str) and setting.strip().lower() in ("auto", "off"):
        return None if setting.strip().lower() == "auto" else 0
    size = None
    if not isinstance(setting, bool):
        try:
            size = parse_size(setting)
        except (ConfigError, TypeError, AttributeError):
            size = None
    if size is None or size < 0:
        raise ConfigError(
            f"--input-cache {setting!r}: use auto, off or a size such as 8GB (memory that may keep the inputs "
            "the statistics pass read for the merge pass)"
        )
    return size


# ---------------------------------------------------------------------------------------------------------------
# safetensors headers


@dataclass(frozen=True)
class HeaderEntry:
    """One validated tensor entry of a safetensors header (offsets relative to the end of the header)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_safetensors_header(
    header: Any, path: Path, data_bytes: int, itemsizes: Mapping[str, int]
) -> tuple[list[HeaderEntry], dict[str, str]]:
    """Validate a decoded safetensors header as the safetensors library would, with one message per problem.

    Args:
        header: The decoded JSON.
        path: The file (for messages).
        data_bytes: Bytes in the file after the header.
        itemsizes: Supported dtype names to their element size.

    Returns:
        ``(entries, metadata)``.

    Raises:
        CheckpointError: for a field of the wrong JSON type, an unsupported dtype, a negative or non-integer shape,
            offsets that do not match the shape, lie outside the file or overlap another tensor's.
    """
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(
            f"{path}: corrupt safetensors header: __metadata__ must map strings to strings, got "
            f"{type(metadata).__name__}; re-save the file with safetensors"
        )
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        entries.append(_check_entry(name, entry, path, data_bytes, itemsizes))
    ordered = sorted((e for e in entries if e.end > e.begin), key=lambda e: e.begin)
    for before, after in zip(ordered, ordered[1:], strict=False):
        if after.begin < before.end:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: the data of tensors {before.name!r} "
                f"[{before.begin}, {before.end}) and {after.name!r} [{after.begin}, {after.end}) overlap; "
                "re-save the file with safetensors"
            )
    return entries, dict(metadata)


def _check_entry(
    name: str, entry: Any, path: Path, data_bytes: int, itemsizes: Mapping[str, int]
) -> HeaderEntry:
    where = f"{path}: corrupt safetensors header entry for tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: expected an object with dtype, shape, data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: dtype must be a string, got {dtype!r}")
    if dtype not in itemsizes:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_whole(d) for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_whole(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets must be two non-negative integers, got {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * itemsizes[dtype]
    if end - begin != expected:
        raise CheckpointError(
            f"{path}: corrupt safetensors header: tensor {name!r} spans {end - begin} bytes, "
            f"its shape {list(shape)} and dtype {dtype} need {expected}"
        )
    if end > data_bytes:
        raise CheckpointError(
            f"{path}: truncated safetensors file: tensor {name!r} ends at data byte {end}, the file has "
            f"{data_bytes} bytes of data"
        )
    return HeaderEntry(name, dtype, tuple(shape), begin, end)


# ---------------------------------------------------------------------------------------------------------------
# Index files and paths


def confine(path: Path, root: Path, what: str, allow_external: bool = False) -> Path:
    """``path`` if it resolves (symlinks followed) inside ``root``; else a :class:`CheckpointError`.

    Args:
        path: A file a checkpoint's index names.
        root: The checkpoint directory.
        what: How the message names the file's origin (e.g. ``"agent 0 (x): model.safetensors.index.json"``).
        allow_external: Accept paths outside ``root`` (``--allow-external-shards``).
    """
    if allow_external:
        return path
    resolved, inside = path.resolve(), root.resolve()
    if resolved != inside and not resolved.is_relative_to(inside):
        raise CheckpointError(
            f"{what} names {path}, which resolves to {resolved}, outside the checkpoint directory {root}; move the "
            "shard into the directory, or pass --allow-external-shards (allow_external_shards=True) if it is meant"
        )
    return path


def check_weight_map(
    data: Any, index: Path, root: Path, role: str, allow_external: bool = False
) -> dict[str, Path]:
    """The ``weight_map`` of a checkpoint index: tensor name to a shard file inside ``root``.

    Args:
        data: The index as loaded from JSON.
        index: The index file, for messages.
        root: The checkpoint directory the shards must lie in.
        role: How messages name the checkpoint (e.g. ``"agent 0 (coder)"``).
        allow_external: Accept shards outside ``root`` (default ``False``; ``--allow-external-shards``).

    Returns:
        Each tensor name's shard file.

    Raises:
        CheckpointError: naming the index and the entry, for a missing or mistyped ``weight_map``, an empty shard
            name, or a shard outside the checkpoint directory.
    """
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{role}: {index} is not a valid checkpoint index: 'weight_map' must be an object mapping tensor names "
            f"to shard files, got {type(weight_map).__name__}"
        )
    files: dict[str, Path] = {}
    for name, file_name in weight_map.items():
        if not isinstance(file_name, str) or not file_name:
            raise CheckpointError(
                f"{role}: {index}: weight_map entry {name!r} must be a shard file name, got {file_name!r}"
            )
        files[name] = confine(root / file_name, root, f"{role}: {index.name} entry {name!r}", allow_external)
    return files


def read_json_object(path: Path, what: str, error: type[RamTrlError] = CheckpointError) -> dict[str, Any]:
    """A JSON file holding an object, or ``error`` naming the file.

    Args:
        path: The file.
        what: How the message names it (e.g. a checkpoint's role).
        error: The exception type raised (default :class:`CheckpointError`).

    Returns:
        The object.

    Raises:
        RamTrlError: ``error``, for an unreadable file, invalid JSON or a value that is not an object.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{what} {path}: not valid JSON ({exc}); fix or remove it") from exc
    if not isinstance(data, dict):
        raise error(f"{what} {path}: must hold a JSON object, got {type(data).__name__}")
    return data


def check_model_config(path: Path, role: str) -> dict[str, Any]:
    """A model's ``config.json``: a JSON object whose size fields, when present, are positive integers.

    Args:
        path: The ``config.json``.
        role: How messages name the model.

    Returns:
        The config.

    Raises:
        CheckpointError: naming the file and the field.
    """
    config = read_json_object(path, role)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size"):
        if key in config and not (_whole(config[key]) and config[key] > 0):
            raise CheckpointError(f"{role}: {path}: {key} must be a positive integer, got {config[key]!r}")
    for key in ("model_type", "torch_dtype", "dtype"):
        if key in config and config[key] is not None and not isinstance(config[key], str):
            raise CheckpointError(f"{role}: {path}: {key} must be a string, got {config[key]!r}")
    return config


def check_pickle_state(state: Any, file: Path, role: str) -> dict[str, torch.Tensor]:
    """A loaded pickle checkpoint: a mapping of tensor names to tensors (nothing else).

    Args:
        state: What the file unpickled to.
        file: The file, for messages.
        role: How messages name the checkpoint.

    Returns:
        The state dict, as a ``dict``.

    Raises:
        CheckpointError: for anything but a mapping of string names to tensors.
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"{role}: {file} holds a {type(state).__name__}, not a state dict of tensors; save the model's "
            "state_dict (better: with safetensors)"
        )
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{role}: {file}: entry {name!r} is a {type(value).__name__}, not a tensor; save only the "
                "state_dict's tensors (better: with safetensors)"
            )
    return dict(state)


# ---------------------------------------------------------------------------------------------------------------
# PEFT adapter configs


@dataclass(frozen=True)
class LoraSettings:
    """The numbers of an ``adapter_config.json`` a LoRA delta needs, validated."""

    rank: int
    alpha: float
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    rslora: bool
    fan_in_fan_out: bool


def _pattern(value: Any, where: str, field: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: {field} must be an object of regex -> value, got {value!r}")
    for pattern in value:
        try:
            re.compile(rf"(.*\.)?({pattern})$")
        except re.error as exc:
            raise CheckpointError(
                f"{where}: {field} key {pattern!r} is not a valid regular expression ({exc})"
            ) from exc
    return value


def check_lora_config(config: Any, path: Path, role: str) -> LoraSettings:
    """Validate the LoRA numbers of an adapter config: ranks positive integers, alphas finite, patterns valid regexes.

    Args:
        config: The adapter config as loaded from JSON (``r`` and ``lora_alpha`` default to 8, as in PEFT).
        path: The ``adapter_config.json``, for messages.
        role: How messages name the adapter.

    Returns:
        The validated numbers.

    Raises:
        CheckpointError: naming the adapter config and the field.
    """
    where = f"{role}: {path}"
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: an adapter config must be a JSON object")

    def rank(value: Any, field: str) -> int:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not float(value).is_integer()
            or value < 1
        ):
            raise CheckpointError(f"{where}: {field} must be a positive integer rank, got {value!r}")
        return int(value)

    def alpha(value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise CheckpointError(f"{where}: {field} must be a finite number, got {value!r}")
        return float(value)

    rank_pattern = _pattern(config.get("rank_pattern"), where, "rank_pattern")
    alpha_pattern = _pattern(config.get("alpha_pattern"), where, "alpha_pattern")
    return LoraSettings(
        rank=rank(config.get("r", 8), "r"),
        alpha=alpha(config.get("lora_alpha", 8), "lora_alpha"),
        rank_pattern={k: rank(v, f"rank_pattern[{k!r}]") for k, v in rank_pattern.items()},
        alpha_pattern={k: alpha(v, f"alpha_pattern[{k!r}]") for k, v in alpha_pattern.items()},
        rslora=bool(config.get("use_rslora")),
        fan_in_fan_out=bool(config.get("fan_in_fan_out")),
    )


# ---------------------------------------------------------------------------------------------------------------
# Tensors


def is_vocabulary_tensor(name: str) -> bool:
    """Whether ``name`` is a vocabulary-sized tensor (input embeddings, output head, or their LoRA factors)."""
    return bool(VOCABULARY_PATTERN.search(name))
