"""Where the telemetry reads the base weights from, and how training parameter names map to checkpoint names.
Details: docs/telemetry.md and docs/memory.md."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ram_trl.callbacks.telemetry.shards import LocalShard, iter_local_shards, training_context
from ram_trl.errors import CheckpointError
from ram_trl.io.checkpoint import open_checkpoint
from ram_trl.io.safetensors_io import TensorInfo, dtype_itemsize
from ram_trl.stage.manifest import FINGERPRINT_ELEMENTS, BaseFingerprint, fingerprint_heads, fingerprint_names

# wrapper parts stripped from parameter names: DDP / DeepSpeed (leading ``module``), torch.compile, FSDP1 and
# activation checkpointing wrappers (anywhere), PEFT's ``base_model.model`` (in base_name)
_LEADING = {"module"}
_ANYWHERE = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
_PEFT_COMPONENTS = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


def base_name(name: str) -> str:
    """The base checkpoint's name of a training parameter."""
    parts = name.split(".")
    kept: list[str] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        if part == "base_model" and i + 1 < len(parts) and parts[i + 1] == "model":
            i += 2
            continue
        if part in _ANYWHERE or (part in _LEADING and not kept):
            i += 1
            continue
        kept.append(part)
        i += 1
    return _PEFT_COMPONENTS.sub("", ".".join(kept))


class BaseSource(Protocol):
    """A source of base weights, addressed by base tensor name and flat element range."""

    #: How reports name the source, e.g. ``"reference model"``.
    description: str

    def read(self, name: str, offset: int, numel: int) -> torch.Tensor:
        """Elements ``[offset, offset + numel)`` of the flattened base tensor ``name`` (1-D, stored dtype)."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of base tensor ``name``."""
        ...

    def names(self) -> list[str]:
        """Every floating tensor the source holds."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes this source holds in process memory (0 for memory maps and models that exist anyway)."""
        ...


def source_fingerprint(source: BaseSource, names: Iterable[str] | None = None) -> BaseFingerprint:
    """Fingerprint the base a source serves (equal to :func:`ram_trl.stage.manifest.fingerprint_checkpoint` of the same
    weights saved to disk)."""
    chosen = fingerprint_names(source.names()) if names is None else list(names)

    def head(name: str) -> tuple[tuple[int, ...], torch.Tensor]:
        shape = source.shape(name)
        numel = min(math.prod(shape), FINGERPRINT_ELEMENTS)
        if isinstance(source, ModelBase):
            return shape, source.head(name, numel)
        return shape, source.read(name, 0, numel)

    return fingerprint_heads(head, chosen)


def _slice(shard: LocalShard, name: str, offset: int, numel: int, role: str) -> torch.Tensor:
    start = offset - shard.offset
    if start < 0 or start + numel > shard.numel:
        raise CheckpointError(
            f"{role}: holds elements [{shard.offset}, {shard.offset + shard.numel}) of {name!r} in this process, "
            f"the trained model's range [{offset}, {offset + numel}) is not inside it (the two models are "
            "partitioned differently)"
        )
    return shard.values[start : start + numel]


class ModelBase:
    """Base weights held by a model in memory (a reference model, or a PEFT model's frozen weights)."""

    def __init__(self, shards: dict[str, LocalShard], description: str) -> None:
        self._shards = shards
        self.description = description

    @classmethod
    def from_model(cls, model: torch.nn.Module, description: str = "reference model") -> ModelBase:
        """All floating parameters of ``model``, through :func:`~ram_trl.callbacks.telemetry.shards.iter_local_shards`."""
        shards = {base_name(s.name): s for s in iter_local_shards(model) if torch.is_floating_point(s.values)}
        return cls(shards, description)

    def read(self, name: str, offset: int, numel: int) -> torch.Tensor:
        shard = self._shards.get(name)
        if shard is None:
            raise CheckpointError(f"{self.description}: has no parameter {name!r}")
        return _slice(shard, name, offset, numel, self.description)

    def head(self, name: str, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of base tensor ``name``, wherever they are held."""
        shard = self._shards.get(name)
        if shard is None:
            raise CheckpointError(f"{self.description}: has no parameter {name!r}")
        ctx = training_context()
        if not (shard.partitioned and ctx.enabled):
            return _slice(shard, name, 0, numel, self.description)
        buffer = torch.zeros(numel, dtype=torch.float64)  # host
        stop = min(shard.offset + shard.numel, numel)
        if stop > shard.offset:
            buffer[shard.offset : stop] = shard.values[: stop - shard.offset].to("cpu", torch.float64)
        return ctx.all_reduce_sum(buffer)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shards[name].shape

    def names(self) -> list[str]:
        return list(self._shards)

    @property
    def nbytes(self) -> int:
        return 0


class SnapshotBase(ModelBase):
    """A copy of a model's local parameters (on the CPU), taken when no other base exists (e.g. at train begin)."""

    def __init__(self, shards: dict[str, LocalShard]) -> None:
        copies = {
            name: LocalShard(s.name, s.values.detach().to("cpu", copy=True), s.shape, s.offset, s.partitioned)
            for name, s in shards.items()
        }
        super().__init__(copies, "in-memory snapshot taken at train begin")

    @property
    def nbytes(self) -> int:
        return sum(s.values.numel() * s.values.element_size() for s in self._shards.values())


class DeviceBase(ModelBase):
    """The base ranges a model measures, copied once onto its accelerator (in the stored dtype, e.g. bf16)."""

    def __init__(self, source: BaseSource, ranges: dict[str, tuple[int, int]], device: torch.device) -> None:
        shards = {
            name: LocalShard(
                name, source.read(name, offset, numel).to(device, copy=True), source.shape(name), offset, False
            )
            for name, (offset, numel) in ranges.items()
        }
        super().__init__(shards, f"{source.description}, resident on {device}")

    @property
    def nbytes(self) -> int:
        return sum(s.values.numel() * s.values.element_size() for s in self._shards.values())


def resident_bytes(source: BaseSource, ranges: dict[str, tuple[int, int]]) -> int:
    """Bytes a :class:`DeviceBase` of these ranges would hold (stored dtypes)."""
    return sum(source.read(name, offset, 1).element_size() * numel for name, (offset, numel) in ranges.items())


class MappedCheckpointBase:
    """A base checkpoint on disk (safetensors, single file or sharded), read through read-only memory maps."""

    def __init__(self, path: str | os.PathLike) -> None:
        checkpoint = open_checkpoint(path, "base model", allow_pickle=True)
        if checkpoint.format != "safetensors" or checkpoint.kind != "full":
            what = "a PEFT adapter" if checkpoint.kind == "lora" else "a pickle checkpoint"
            raise CheckpointError(
                f"base model: {path} is {what}; the telemetry reads the base from a full safetensors checkpoint "
                "(save it with save_pretrained(..., safe_serialization=True))"
            )
        self.path = Path(path)
        self.description = f"base checkpoint {path} (memory-mapped)"
        self._infos: dict[str, TensorInfo] = {
            n: checkpoint.location(n) for n in checkpoint.tensors if checkpoint.location(n) is not None
        }
        self._maps: dict[Path, np.memmap] = {}

    def _map(self, file: Path) -> np.memmap:
        mapped = self._maps.get(file)
        if mapped is None:
            # copy-on-write mapping: writable as far as numpy and torch know, never written, never copied
            mapped = np.memmap(file, dtype=np.uint8, mode="c")
            self._maps[file] = mapped
        return mapped

    def info(self, name: str) -> TensorInfo:
        info = self._infos.get(name)
        if info is None:
            raise CheckpointError(f"{self.description}: has no tensor {name!r}")
        return info

    def read(self, name: str, offset: int, numel: int) -> torch.Tensor:
        info = self.info(name)
        if offset < 0 or offset + numel > info.numel:
            raise CheckpointError(
                f"{self.description}: tensor {name!r} has {info.numel} elements, elements "
                f"[{offset}, {offset + numel}) were asked for"
            )
        size = dtype_itemsize(info.dtype)
        begin = info.begin + offset * size
        raw = self._map(info.file)[begin : begin + numel * size]
        return torch.from_numpy(raw).view(info.dtype)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def names(self) -> list[str]:
        return [n for n, i in self._infos.items() if i.dtype.is_floating_point]

    @property
    def nbytes(self) -> int:
        return 0

    def close(self) -> None:
        self._maps.clear()
