"""A union vocabulary's rows, built before merging as mergekit builds them (``tokenizer_source: union``; the rule:
docs/methods.md). :func:`pad_vocabularies` wraps the opened checkpoints so that every reader sees the union's rows,
a model's missing rows built on read."""

from __future__ import annotations

import dataclasses
import re
import threading
from dataclasses import dataclass, field

import torch

from ram_trl.errors import CheckpointError
from ram_trl.io.checkpoint import Checkpoint
from ram_trl.io.safetensors_io import RowReader, TensorInfo, TensorMeta


@dataclass(frozen=True)
class UnionRows:
    """The rows of a union vocabulary that some model lacks."""

    rows: int
    holders: dict[int, tuple[int, ...]]
    load_dtype: torch.dtype | None = None
    sources: dict[int, tuple] = field(default_factory=dict)
    forced: frozenset[int] = frozenset()
    padded_rows: int | None = None

    @property
    def total(self) -> int:
        """Every model's vocabulary row count: :attr:`padded_rows`, else :attr:`rows`."""
        return self.padded_rows or self.rows

    def rebuilt(self, position: int) -> list[int]:
        """The token ids whose row a model takes from the default or a rule, not from its own rows."""
        lacking = {token for token, holders in self.holders.items() if position not in holders}
        return sorted(lacking | self.forced)


@dataclass
class _DefaultRows:
    """Default rows shared by every wrapped model, built once per tensor and row."""

    union: UnionRows
    models: list[Checkpoint]
    dtype: dict[str, torch.dtype]
    cache: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    padding: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def padding_row(self, name: str, model: PaddedCheckpoint, reader: RowReader) -> torch.Tensor:
        """A model's padding row: the mean of its union rows (the whole tensor is built once for it)."""
        key = (name, model.position)
        with self.lock:
            if key not in self.padding:
                load = self.union.load_dtype or self.dtype[name]
                rows = model.read_rows(name, reader, 0, self.union.rows).to(load)
                self.padding[key] = torch.mean(rows, dim=0)
            return self.padding[key]

    def row(self, name: str, token: int, reader: RowReader) -> torch.Tensor:
        key = (name, token)
        with self.lock:
            if key not in self.cache:
                self.cache[key] = self._build(name, token, reader)
            return self.cache[key]

    def _build(self, name: str, token: int, reader: RowReader) -> torch.Tensor:
        load = self.union.load_dtype or self.dtype[name]

        def own(k: int, row: int = token) -> torch.Tensor:
            return self.models[k].read_rows(name, reader, row, row + 1)[0].to(load)

        source = self.union.sources.get(token)
        if source is not None:
            if source[0] == "zero":
                return torch.zeros_like(own(0, 0))
            return own(source[1], source[2]).clone()
        holders = self.union.holders[token]
        if len(holders) == 1 or 0 in holders:
            # the only model that has it, or the base when it has it (mergekit's default sources)
            return own(0 if 0 in holders else holders[0]).clone()
        total = torch.zeros_like(own(holders[0]))
        for k in holders:
            total = total + own(k)
        total /= len(holders)
        return total


@dataclass
class PaddedCheckpoint(Checkpoint):
    """A checkpoint whose vocabulary tensors have a union's rows: its own where it has the token, a default row
    (:class:`UnionRows`) where it lacks it; other tensors as stored."""

    inner: Checkpoint | None = None
    position: int = 0
    defaults: _DefaultRows | None = None

    def has_values(self, name: str) -> bool:
        """Whether the checkpoint stores values of ``name`` (see :meth:`Checkpoint.has_values`)."""
        assert self.inner is not None
        return self.inner.has_values(name)

    def location(self, name: str) -> TensorInfo | None:
        """The stored location of ``name``; ``None`` for a padded vocabulary tensor (see :meth:`read_rows`)."""
        assert self.inner is not None and self.defaults is not None
        return None if name in self.defaults.dtype else self.inner.location(name)

    def read_rows(self, name: str, reader: RowReader, start: int | None = None, stop: int | None = None):
        """Rows ``start:stop`` of ``name``; for a vocabulary tensor, in the union's numbering."""
        assert self.inner is not None and self.defaults is not None
        if name not in self.defaults.dtype:
            return self.inner.read_rows(name, reader, start, stop)
        start = 0 if start is None else start
        stop = self.defaults.union.total if stop is None else stop
        meta = self.tensors[name]
        out = torch.empty((stop - start, *meta.shape[1:]), dtype=meta.dtype)
        if stop > self.defaults.union.rows:
            out[max(start, self.defaults.union.rows) - start :] = self.defaults.padding_row(name, self, reader)
            stop_own = max(start, self.defaults.union.rows)
            if stop_own > start:
                out[: stop_own - start] = self.read_rows(name, reader, start, stop_own)
            return out
        have = min(stop, self.inner.tensors[name].shape[0])
        if have > start:
            out[: have - start] = self.inner.read_rows(name, reader, start, have)
        for token in self.defaults.union.rebuilt(self.position):
            if start <= token < stop:
                out[token - start] = self.defaults.row(name, token, reader)
        return out


def pad_vocabularies(base: Checkpoint, agents: list[Checkpoint], union: UnionRows) -> list[Checkpoint]:
    """The base and the agents with every vocabulary tensor in the union's rows (:class:`PaddedCheckpoint`)."""
    models = [base, *agents]
    for model in agents:
        if model.kind == "lora":
            raise CheckpointError(
                f"{model.role}: tokenizer source 'union' re-builds vocabulary rows, which needs full checkpoints, "
                "not a LoRA adapter"
            )
    names = [name for name in base.tensors if is_vocabulary_tensor(name) and base.tensors[name].shape]
    dtypes: dict[str, torch.dtype] = {}
    for name in names:
        stored = {model.tensors[name].dtype for model in models if name in model.tensors}
        if len(stored) != 1 or any(name not in model.tensors for model in models):
            raise CheckpointError(
                f"tensor {name!r}: tokenizer source 'union' builds its rows from every model's, which needs it in "
                f"every model in one dtype (found {sorted(str(d) for d in stored)})"
            )
        (dtypes[name],) = stored
    defaults = _DefaultRows(union, models, dtypes)
    wrapped: list[Checkpoint] = []
    for position, model in enumerate(models):
        tensors = dict(model.tensors)
        for name, dtype in dtypes.items():
            shape = (union.total, *model.tensors[name].shape[1:])
            load = union.load_dtype or dtype
            tensors[name] = TensorMeta(name, torch.promote_types(dtype, load), shape)
        wrapped.append(
            PaddedCheckpoint(
                **{f.name: getattr(model, f.name) for f in dataclasses.fields(Checkpoint)} | {"tensors": tensors},
                inner=model,
                position=position,
                defaults=defaults,
            )
        )
    return wrapped


__all__ = ["PaddedCheckpoint", "UnionRows", "VOCABULARY_PATTERN", "is_vocabulary_tensor", "pad_vocabularies"]


#: Tensor names of vocabulary-sized tensors (rows = tokens): the only tensors ``merge_common_rows`` may resize.
VOCABULARY_PATTERN = re.compile(r"^(?!.*pos)(.*\.)?([^.]*embed[^.]*|wte|lm_head)(\.|$)|^(output|shared)\.")


def is_vocabulary_tensor(name: str) -> bool:
    """Whether ``name`` is a vocabulary-sized tensor (input embeddings, output head, or their LoRA factors)."""
    return bool(VOCABULARY_PATTERN.search(name))
