"""The elements of a model's parameters that this process holds, however the model is distributed.

A measurement of the task vector must not gather full parameters (a 70B ZeRO-3 run cannot afford it). Every
parameter is seen as its flattened full tensor; a process holds one contiguous flat range of it (all of it when the
parameter is replicated). :func:`iter_local_shards` yields those ranges; the caller compares them with the same flat
range of the base and, for partitioned parameters, sums its counts over the processes.

Where the local range comes from:

- plain modules, DDP (``module.`` wrappers are unwrapped) and DeepSpeed ZeRO-1/2: every process holds the whole
  parameter (``partitioned=False``);
- DeepSpeed ZeRO-3: ``param.ds_tensor`` is the local flat partition of ``ds_tensor.ds_numel`` elements starting at
  ``rank * ds_tensor.ds_numel``; the last partitions are padded past ``param.ds_numel``, the padding is cut off;
- FSDP2 (``fully_shard``): parameters are DTensors; with ``Shard(0)`` placements a process holds a block of rows,
  a contiguous flat range, found from the device mesh coordinate (uneven and empty last shards included). Mesh
  dimensions that replicate (HSDP) are counted by their first replica only, so a sum over all processes is exact.

The base on the same flat range comes from :mod:`ram_trl.callbacks.telemetry.base_weights` (the checkpoint on disk through
memory maps, or a reference model, which ZeRO-3 and FSDP2 partition like the policy, so the ranges coincide). The counts
are summed over the processes with the :class:`~ram_trl.distributed.DistContext` of :func:`training_context`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ram_trl.distributed import DistContext
from ram_trl.errors import RamTrlError


class ShardError(RamTrlError):
    """A parameter's local elements cannot be described as one contiguous flat range."""


@dataclass(frozen=True)
class LocalShard:
    """The locally held elements of one parameter.

    Args:
        name: The parameter's name in ``model.named_parameters()`` (of the unwrapped model).
        values: 1-D tensor of the local elements (the parameter's dtype and device; a view where possible).
        shape: The full parameter's shape.
        offset: Flat index of ``values[0]`` in the full flattened parameter.
        partitioned: ``True`` when other processes hold other elements of this parameter, so per-process counts
            must be summed over the processes; ``False`` when every process holds the whole parameter.
    """

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
    """The module inside DDP / DeepSpeed engine / ``torch.compile`` wrappers (whose parameters carry a prefix).

    Args:
        model: A module, possibly wrapped (several times).

    Returns:
        The innermost module.
    """
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) or _is_deepspeed_engine(model):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _is_deepspeed_engine(model: torch.nn.Module) -> bool:
    return type(model).__name__ == "DeepSpeedEngine" and isinstance(
        getattr(model, "module", None), torch.nn.Module
    )


def _is_zero3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_tensor") and hasattr(param, "ds_numel")


def _is_dtensor(param: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed tensors
        return False
    return isinstance(param, DTensor)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def zero3_shard(name: str, param: torch.Tensor) -> LocalShard:
    """The local partition of a DeepSpeed ZeRO-3 parameter, without its padding.

    Args:
        name: The parameter's name.
        param: A parameter converted by ``deepspeed.zero.Init`` (has ``ds_tensor``, ``ds_numel``, ``ds_shape``).

    Returns:
        The shard: ``ds_tensor[: ds_numel - offset]`` at ``offset = rank * partition_size``.

    Raises:
        ShardError: if the partition is offloaded to NVMe (not in memory) or the partition group is not the whole
            job (MiCS / hierarchical partitioning, where a sum over all processes would count elements twice).
    """
    partition = param.ds_tensor
    group = getattr(param, "ds_process_group", None)
    rank = dist.get_rank(group=group)
    group_size = dist.get_world_size(group=group)
    if group_size != _world_size():
        raise ShardError(
            f"parameter {name!r}: its ZeRO-3 partition group has {group_size} of the job's {_world_size()} "
            "processes (MiCS or hierarchical partitioning); telemetry supports partitioning over the whole job"
        )
    if hasattr(partition, "ds_quant_scale"):
        raise ShardError(
            f"parameter {name!r}: its ZeRO-3 partition is quantized (zero_quantized_nontrainable_weights); "
            "telemetry needs the partition's values"
        )
    partition_size = int(getattr(partition, "ds_numel", partition.numel()))
    if partition.numel() != partition_size:
        raise ShardError(
            f"parameter {name!r}: its ZeRO-3 partition holds {partition.numel()} of {partition_size} elements in "
            "memory (offloaded to NVMe?); telemetry needs the partition in CPU or GPU memory"
        )
    full_numel = int(param.ds_numel)
    offset = min(rank * partition_size, full_numel)
    numel = max(0, min(partition_size, full_numel - offset))
    values = partition.detach().reshape(-1)[:numel]
    return LocalShard(name, values, tuple(param.ds_shape), offset, partitioned=group_size > 1)


def dtensor_shard(name: str, param: torch.Tensor) -> LocalShard:
    """The local block of rows of a DTensor parameter (FSDP2 ``fully_shard``, HSDP).

    Mesh dimensions placed ``Shard(0)`` split the rows (``torch.chunk`` sizes: uneven and empty last shards are
    possible, padding is not part of the local tensor); on mesh dimensions placed ``Replicate()`` only the first
    replica reports the rows, the others yield an empty shard, so that a sum over all processes counts every element
    once.

    Args:
        name: The parameter's name.
        param: A ``torch.distributed.tensor.DTensor``.

    Returns:
        The shard (``partitioned`` when the mesh has more than one process).

    Raises:
        ShardError: for placements whose local elements are not one flat range (``Shard(d)`` with ``d > 0``,
            strided shards of tensor parallelism), for ``Partial`` placements, and for meshes smaller than the job.
    """
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
    """Yield the locally held elements of every parameter of ``model`` (each parameter once).

    Args:
        model: The model, plain or wrapped (DDP, DeepSpeed engine) or partitioned (ZeRO-3, FSDP2).

    Yields:
        One :class:`LocalShard` per parameter, named as in the unwrapped model.

    Raises:
        ShardError: for a distribution whose local elements are not one flat range (see :func:`zero3_shard` and
            :func:`dtensor_shard`).
    """
    for name, param in unwrap_model(model).named_parameters():
        if _is_zero3(param):
            yield zero3_shard(name, param)
        elif _is_dtensor(param):
            yield dtensor_shard(name, param)
        else:
            values = param.detach()
            yield LocalShard(name, values.reshape(-1), tuple(values.shape), offset=0, partitioned=False)


def training_context() -> DistContext:
    """The running job's process group as a :class:`~ram_trl.distributed.DistContext` (never initialises one).

    Returns:
        The context of the initialised default group, or a single-process context.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return DistContext()
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), owns_group=False)
