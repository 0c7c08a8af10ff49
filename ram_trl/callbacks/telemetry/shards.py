"""The elements of a model's parameters that this process holds, however the model is distributed.
Details: docs/telemetry.md ("Distributed training")."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ram_trl.callbacks import deepspeed_adapter
from ram_trl.distributed import DistContext
from ram_trl.errors import RamTrlError


class ShardError(RamTrlError):
    """A parameter's local elements cannot be described as one contiguous flat range."""


@dataclass(frozen=True)
class LocalShard:
    """The locally held elements of one parameter."""

    name: str
    values: torch.Tensor
    shape: tuple[int, ...]
    offset: int
    partitioned: bool

    @property
    def numel(self) -> int:
        return self.values.numel()

    @property
    def full_numel(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP / DeepSpeed engine / ``torch.compile`` wrappers (whose parameters carry a prefix)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) or deepspeed_adapter.is_engine(model):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _is_dtensor(param: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed tensors
        return False
    return isinstance(param, DTensor)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def zero3_shard(name: str, param: torch.Tensor) -> LocalShard:
    """The local partition of a DeepSpeed ZeRO-3 parameter, without its padding."""
    partition = deepspeed_adapter.partition_of(param)
    group = partition.group
    rank = dist.get_rank(group=group)
    group_size = dist.get_world_size(group=group)
    if group_size != _world_size():
        raise ShardError(
            f"parameter {name!r}: its ZeRO-3 partition group has {group_size} of the job's {_world_size()} "
            "processes (MiCS or hierarchical partitioning); telemetry supports partitioning over the whole job"
        )
    if partition.quantized:
        raise ShardError(
            f"parameter {name!r}: its ZeRO-3 partition is quantized (zero_quantized_nontrainable_weights); "
            "telemetry needs the partition's values"
        )
    held = partition.values.numel()
    if held != partition.size:
        raise ShardError(
            f"parameter {name!r}: its ZeRO-3 partition holds {held} of {partition.size} elements in "
            "memory (offloaded to NVMe?); telemetry needs the partition in CPU or GPU memory"
        )
    offset = min(rank * partition.size, partition.numel)
    numel = max(0, min(partition.size, partition.numel - offset))
    values = partition.values.detach().reshape(-1)[:numel]
    return LocalShard(name, values, partition.shape, offset, partitioned=group_size > 1)


def dtensor_shard(name: str, param: torch.Tensor) -> LocalShard:
    """The local block of rows of a DTensor parameter (FSDP2 ``fully_shard``, HSDP)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = param.device_mesh
    placements = tuple(param.placements)
    for placement in placements:
        if type(placement) is Shard and placement.dim == 0:
            continue
        if isinstance(placement, Replicate):
            continue
        raise ShardError(
            f"parameter {name!r}: DTensor placement {placement} is not supported by telemetry (only Shard(0), as "
            "FSDP2 uses by default, and Replicate(), as HSDP adds, keep a process's elements one flat range)"
        )
    if mesh.size() != _world_size():
        raise ShardError(
            f"parameter {name!r}: its device mesh has {mesh.size()} processes, the job {_world_size()}; telemetry "
            "needs every parameter's mesh to span the whole job"
        )
    shape = tuple(param.shape)
    local = param.to_local().detach()
    coordinate = mesh.get_coordinate()
    owner = coordinate is not None and all(
        coordinate[i] == 0 for i, placement in enumerate(placements) if isinstance(placement, Replicate)
    )
    _, global_offset = compute_local_shape_and_global_offset(shape, mesh, list(placements))
    row_numel = 1
    for size in shape[1:]:
        row_numel *= size
    full_numel = row_numel * (shape[0] if shape else 1)
    offset = min(int(global_offset[0]) * row_numel if shape else 0, full_numel)
    values = local.reshape(-1)
    if not owner:
        values = values[:0]
    values = values[: full_numel - offset]
    return LocalShard(name, values, shape, offset, partitioned=mesh.size() > 1)


def iter_local_shards(model: torch.nn.Module) -> Iterator[LocalShard]:
    """Yield the locally held elements of every parameter of ``model`` (each parameter once)."""
    for name, param in unwrap_model(model).named_parameters():
        if deepspeed_adapter.is_partitioned(param):
            yield zero3_shard(name, param)
        elif _is_dtensor(param):
            yield dtensor_shard(name, param)
        else:
            values = param.detach()
            yield LocalShard(name, values.reshape(-1), tuple(values.shape), offset=0, partitioned=False)


def training_context() -> DistContext:
    """The running job's process group as a :class:`~ram_trl.distributed.DistContext` (never initialises one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistContext()
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), owns_group=False)
