"""Diagonal Fisher files as merge inputs: where they are, header checks against the plan, checked row reads (the
file format: docs/fisher.md)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ram_trl.errors import CheckpointError, NonFiniteError
from ram_trl.io.checkpoint import FISHER_FILE, Checkpoint, open_checkpoint
from ram_trl.io.safetensors_io import RowReader, dtype_itemsize

__all__ = [
    "check_fisher_headers",
    "default_fisher_path",
    "fill_fisher",
    "fisher_itemsize",
    "fisher_nbytes",
    "open_fisher",
    "read_fisher_rows",
]


def default_fisher_path(agent_path: str | Path) -> Path:
    """Where an agent's Fisher lives by default: ``FISHER_FILE`` in its directory (or beside a single file)."""
    agent_path = Path(agent_path)
    return (agent_path if agent_path.is_dir() else agent_path.parent) / FISHER_FILE


def open_fisher(path: str | Path, agent_role: str, agent_path: str | Path) -> Checkpoint:
    """Open one agent's Fisher file (headers only)."""
    path = Path(path)
    if path.is_dir():
        path = path / FISHER_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{agent_role}: Fisher file {path} does not exist; estimate it with `ram-trl fisher {agent_path} "
            "--prompts PROMPTS` or point models[].parameters.fisher at it"
        )
    return open_checkpoint(path, f"{agent_role}: Fisher file {path}")


def check_fisher_headers(fisher: Checkpoint, agent: Checkpoint, base: Checkpoint, names: list[str]) -> None:
    """Check that a Fisher file has a floating tensor of the right shape for each of ``names``."""
    for name in names:
        meta = fisher.tensors.get(name)
        if meta is None:
            raise CheckpointError(
                f"{fisher.role}: no Fisher for tensor {name!r} of the base model ({base.path}); was it estimated "
                "on a model of this architecture?"
            )
        if not meta.dtype.is_floating_point:
            raise CheckpointError(f"{fisher.role}: tensor {name!r} has dtype {meta.dtype}; a Fisher is floating")
        base_shape = base.tensors[name].shape
        own = agent.tensors.get(name)
        if meta.shape != base_shape and (own is None or meta.shape != own.shape):
            raise CheckpointError(
                f"{fisher.role}: tensor {name!r} has shape {list(meta.shape)}, the base {base.path} has "
                f"{list(base_shape)}"
            )


def fisher_itemsize(fisher: Checkpoint) -> int:
    """Largest bytes per element among a Fisher file's tensors (what the planner budgets for its reads)."""
    return max((dtype_itemsize(m.dtype) for m in fisher.tensors.values()), default=4)


def fisher_nbytes(fisher: Checkpoint, names: list[str]) -> int:
    """Bytes of ``names`` in a Fisher file (what one pass reads)."""
    return sum(fisher.tensors[n].nbytes for n in names)


def read_fisher_rows(fisher: Checkpoint, name: str, reader: RowReader, start: int, stop: int) -> torch.Tensor | None:
    """Rows ``start:stop`` of one Fisher tensor in its stored dtype (fewer where it has fewer rows; ``None``: none)."""
    shape = fisher.tensors[name].shape
    have = min(stop, shape[0] if shape else 1)
    if have <= start:
        return None
    return fisher.read_rows(name, reader, start, have)


def fill_fisher(out: torch.Tensor, raw: torch.Tensor | None, fisher: Checkpoint, name: str, start: int) -> None:
    """Write one agent's float32 Fisher of a chunk into ``out`` (flat, the chunk's length); zero on rows it lacks."""
    n = 0 if raw is None else raw.numel()
    if raw is not None:
        out[:n].copy_(raw.reshape(-1))
    if n < out.numel():
        out[n:].zero_()
    # NaN fails both tests; +Inf passes the second but makes the sum infinite
    if not math.isfinite(float(out.sum())) or not bool((out >= 0).all()):
        bad = int((~torch.isfinite(out)).sum())
        negative = int((out < 0).sum())
        if bad or negative:
            what = f"{bad} NaN/Inf" if bad else f"{negative} negative"
            raise NonFiniteError(
                f"{fisher.role}: tensor {name!r} holds {what} values (rows from {start}); a diagonal Fisher is "
                "finite and non-negative: re-estimate it"
            )
