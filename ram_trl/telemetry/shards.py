"""The elements of a model's parameters that this process holds, however the model is distributed.

A measurement of the task vector must not gather full parameters (a 70B ZeRO-3 run cannot afford it). Every
parameter is seen as its flattened full tensor; a process holds one contiguous flat range of it (all of it when the
parameter is replicated). :func:`iter_local_shards` yields those ranges; the caller compares them with the same flat
range of the base and, for partitioned parameters, sums its counts over the processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LocalShard:
    """The locally held elements of one parameter.

    Args:
        name: The parameter's name in ``model.named_parameters()``.
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


def iter_local_shards(model: torch.nn.Module) -> Iterator[LocalShard]:
    """Yield the locally held elements of every parameter of ``model`` (each parameter once).

    Args:
        model: The (possibly wrapped or partitioned) model.

    Yields:
        One :class:`LocalShard` per parameter.
    """
    for name, param in model.named_parameters():
        values = param.detach()
        yield LocalShard(
            name=name, values=values.reshape(-1), shape=tuple(values.shape), offset=0, partitioned=False
        )
