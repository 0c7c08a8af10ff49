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

The base on the same flat range: :func:`read_flat_range` reads it from a safetensors checkpoint without reading
the rest of the tensor, and :func:`matching_values` takes it from a reference model held by the trainer (under
ZeRO-3 the reference is partitioned like the policy, so the ranges coincide).

Reducing the counts: :func:`iter_counted_shards` yields what this process must count so that a plain sum over the
processes is exact (partitioned ranges everywhere, each replicated parameter on one process, balanced by size), and
:func:`training_context` gives the :class:`~ram_trl.distributed.DistContext` of the running job to all-reduce with
(``OverlapStatistics.all_reduce`` / ``MagnitudeStatistics.all_reduce``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ram_trl.distributed import DistContext, partition_by_bytes
from ram_trl.errors import RamTrlError

if TYPE_CHECKING:
    from ram_trl.io.checkpoint import Checkpoint
    from ram_trl.io.safetensors_io import RowReader


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


def iter_counted_shards(model: torch.nn.Module) -> Iterator[LocalShard]:
    """Yield what this process counts so that summing every process's counts gives the whole model's.

    Partitioned shards are yielded as they are; every replicated parameter (DDP, ZeRO-1/2, small parameters) is
    counted by one process only, the processes sharing them balanced by element count, so a DDP job measures
    ``1 / world_size`` of the model per process. In a single process this is :func:`iter_local_shards`. The
    yielded shards all have ``partitioned=True`` in a multi-process job: sum every count over the processes.

    Args:
        model: The model (see :func:`iter_local_shards`).

    Yields:
        The shards this process counts.
    """
    shards = list(iter_local_shards(model))
    world = _world_size()
    if world == 1:
        yield from shards
        return
    replicated = [i for i, shard in enumerate(shards) if not shard.partitioned]
    owners = partition_by_bytes([shards[i].numel for i in replicated], world)
    mine = {replicated[j] for j in owners[dist.get_rank()]}
    for index, shard in enumerate(shards):
        if shard.partitioned or index in mine:
            yield replace(shard, partitioned=True)


def training_context() -> DistContext:
    """The running job's process group as a :class:`~ram_trl.distributed.DistContext` (never initialises one).

    Returns:
        The context of the initialised default group, or a single-process context.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return DistContext()
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), owns_group=False)


def matching_values(shard: LocalShard, reference: LocalShard) -> torch.Tensor:
    """The elements of a reference model's parameter on the flat range of ``shard``.

    Args:
        shard: The trained model's local shard.
        reference: The same parameter of the reference model on this process (partitioned like ``shard``, e.g.
            both ZeRO-3, or replicated).

    Returns:
        A 1-D view of ``shard.numel`` reference elements.

    Raises:
        ShardError: if the shapes differ or the reference does not hold the range locally.
    """
    if reference.shape != shard.shape:
        raise ShardError(
            f"parameter {shard.name!r}: the reference model's shape {list(reference.shape)} differs from the "
            f"trained model's {list(shard.shape)}"
        )
    start = shard.offset - reference.offset
    if start < 0 or start + shard.numel > reference.numel:
        raise ShardError(
            f"parameter {shard.name!r}: the reference model holds elements [{reference.offset}, "
            f"{reference.offset + reference.numel}) on this process, the trained model "
            f"[{shard.offset}, {shard.offset + shard.numel}): partition both models the same way"
        )
    return reference.values[start : start + shard.numel]


def read_flat_range(
    checkpoint: Checkpoint, name: str, offset: int, numel: int, reader: RowReader | None = None
) -> torch.Tensor:
    """Read elements ``[offset, offset + numel)`` of the flattened tensor ``name`` from a checkpoint on disk.

    Safetensors checkpoints are read with one positioned read of exactly those bytes (nothing else of the tensor is
    read into memory); pickle checkpoints load their file (they cannot be read partially).

    Args:
        checkpoint: The base checkpoint (:func:`ram_trl.io.checkpoint.open_checkpoint`).
        name: The tensor's name in the checkpoint.
        offset: First flat element.
        numel: Number of elements.
        reader: An open :class:`~ram_trl.io.safetensors_io.RowReader` to reuse its file handles (one is opened
            and closed per call otherwise).

    Returns:
        A new 1-D tensor of ``numel`` elements in the stored dtype.

    Raises:
        CheckpointError: if the checkpoint has no tensor ``name`` or the range exceeds it.
    """
    from ram_trl.errors import CheckpointError
    from ram_trl.io.safetensors_io import RowReader

    meta = checkpoint.tensors.get(name)
    if meta is None or not checkpoint.has_values(name):
        raise CheckpointError(f"{checkpoint.role} ({checkpoint.path}): has no tensor {name!r}")
    if offset < 0 or numel < 0 or offset + numel > meta.numel:
        raise CheckpointError(
            f"{checkpoint.role} ({checkpoint.path}): tensor {name!r} has {meta.numel} elements, cannot read "
            f"[{offset}, {offset + numel})"
        )
    info = checkpoint.location(name)
    own_reader = reader is None
    reader = RowReader() if reader is None else reader
    try:
        if info is not None and checkpoint.adapter is None:
            return reader.read_flat(info, offset, numel)
        return checkpoint.read_rows(name, reader).reshape(-1)[offset : offset + numel].clone()
    finally:
        if own_reader:
            reader.close()
