"""Running one merge over several processes and nodes (``accelerate launch``, ``torchrun``).

Tensors are partitioned across ranks, balanced by the bytes each reads; statistics are all-reduced with
``torch.distributed`` before any rank merges; every rank writes its tensors into the shared output files at offsets
fixed by the plan, so the output does not depend on the number of processes. A failure on any rank is turned into
an error on every rank at the next synchronisation point.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ram_trl.errors import RamTrlError

T = TypeVar("T")


class RankFailedError(RamTrlError):
    """Another rank of a distributed merge failed."""


@dataclass
class DistContext:
    """The process's place in a (possibly single-process) run.

    Args:
        rank: Global rank.
        world_size: Number of processes.
        local_rank: Rank on this node (selects the GPU with ``--device cuda``).
        owns_group: Whether this context initialised the process group (and destroys it).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, device: str = "cpu", timeout_minutes: float = 30.0) -> DistContext:
        """Join the process group that ``accelerate launch`` / ``torchrun`` describe in the environment, if any.

        Uses gloo for CPU arithmetic and nccl for CUDA.
        """
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return cls()
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        owns = False
        if not dist.is_initialized():
            backend = "nccl" if device.startswith("cuda") else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(local_rank)
            dist.init_process_group(
                backend=backend,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(minutes=timeout_minutes),
            )
            owns = True
        _raise_on_sigterm()
        return cls(
            rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, owns_group=owns
        )

    def device(self, device: str) -> torch.device:
        if device.startswith("cuda") and device == "cuda" and self.enabled:
            return torch.device("cuda", self.local_rank)
        return torch.device(device)

    def _tensor_device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks (in place; returned for convenience)."""
        if self.enabled:
            moved = tensor.to(self._tensor_device())
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            tensor.copy_(moved.cpu())
        return tensor

    def all_reduce_int(self, value: int, op: str = "sum") -> int:
        if not self.enabled:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self._tensor_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return int(tensor.item())

    def broadcast_object(self, value: T | None) -> T:
        """Rank 0's ``value`` on every rank."""
        if not self.enabled:
            return value  # type: ignore[return-value]
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        if not self.enabled:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def guarded(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank, then agree: if it failed anywhere, raise everywhere.

        The failing rank re-raises its own error; the others raise :class:`RankFailedError`.
        """
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below after telling the other ranks
            error = exc
        failed = self.all_reduce_int(1 if error is not None else 0, op="max")
        if error is not None:
            raise error
        if failed:
            raise RankFailedError(
                f"rank {self.rank}: another rank of the merge failed (its error is in its log)"
            )
        return result  # type: ignore[return-value]

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def partition_by_bytes(weights: list[int], world_size: int) -> list[list[int]]:
    """Assign items to ranks, heaviest first to the least-loaded rank (ties: lowest rank).

    Args:
        weights: Cost of each item (bytes read).
        world_size: Number of ranks.

    Returns:
        For each rank, the indices of its items in ascending order.
    """
    loads = [0] * world_size
    owners: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[rank].append(index)
        loads[rank] += weights[index]
    return [sorted(items) for items in owners]


def _raise_on_sigterm() -> None:
    # torchrun / accelerate terminate the other workers with SIGTERM when one fails: turn it into an exception so
    # that cleanup (removing the temporary output directory) runs.
    def handler(signum: int, frame: Any) -> None:
        raise RankFailedError(f"terminated by signal {signum} (another rank failed)")

    with contextlib.suppress(ValueError):  # not the main thread: leave the handler alone
        signal.signal(signal.SIGTERM, handler)
