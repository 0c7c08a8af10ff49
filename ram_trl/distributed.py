"""Running one merge over several processes and nodes (``accelerate launch``, ``torchrun``): ranks, the byte-balanced
split, all-reduces, and a failure on any rank turned into an error on every rank at the next synchronisation point
(docs/distributed.md)."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from ram_trl.errors import RamTrlError
from ram_trl.signals import raising_signals

T = TypeVar("T")


class RankFailedError(RamTrlError):
    """Another rank of a distributed merge failed."""


@dataclass
class DistContext:
    """The process's place in a (possibly single-process) run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False
    _signals: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, device: str = "cpu", timeout_minutes: float = 30.0) -> DistContext:
        """Join the process group that ``accelerate launch`` / ``torchrun`` describe in the environment, if any."""
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
                backend=backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=timeout_minutes)
            )
            owns = True
        ctx = cls(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, owns_group=owns)
        ctx._signals.enter_context(raising_signals((signal.SIGTERM,), _terminated))  # until close()
        return ctx

    def device(self, device: str) -> torch.device:
        if device.startswith("cuda") and device == "cuda" and self.enabled:
            return torch.device("cuda", self.local_rank)
        return torch.device(device)

    def _tensor_device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks (in place; returned for convenience)."""
        if self.enabled:
            moved = tensor.to(self._tensor_device())
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            tensor.copy_(moved.cpu())
        return tensor

    def all_reduce_int(self, value: int, op: str = "sum") -> int:
        """An integer reduced over the ranks."""
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
        """Run ``fn`` on every rank, then agree: if it failed anywhere, raise everywhere."""
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
            raise RankFailedError(f"rank {self.rank}: another rank of the merge failed (its error is in its log)")
        return result  # type: ignore[return-value]

    def close(self) -> None:
        """Leave the process group if this context initialised it; put back the caller's SIGTERM handler."""
        try:
            if self.owns_group:
                shutdown_distributed(barrier=False)
        finally:
            self._signals.close()


#: Name prefixes of torch.distributed's native threads (Linux thread names) that run collectives and release their
#: tensors: gloo's work loops (``pt_gloo_runloop``) and transport (``gloo_tcp_loop``), NCCL's watchdog threads.
COMMUNICATION_THREADS = ("pt_gloo", "gloo", "pt_nccl")


def communication_threads() -> list[str] | None:
    """The names of this process's live torch.distributed communication threads (see ``COMMUNICATION_THREADS``)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    names = []
    for task in tasks:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
            if name.startswith(COMMUNICATION_THREADS):
                names.append(name)
    return sorted(names)


def shutdown_distributed(barrier: bool = True) -> list[str] | None:
    """Leave torch.distributed: wait for the other ranks, destroy every process group, collect garbage."""
    if dist.is_available() and dist.is_initialized():
        if barrier:
            with contextlib.suppress(Exception):  # a rank that already left: nothing left to wait for
                dist.barrier()
        dist.destroy_process_group()
    gc.collect()
    return communication_threads()


def exit_process(code: int = 0) -> NoReturn:
    """Exit now without finalizing the interpreter: Python's own exit steps, then ``os._exit(code)``."""
    try:
        if threading.current_thread() is threading.main_thread():
            # what the interpreter does first at exit: stop concurrent.futures workers, join non-daemon threads
            shutdown = getattr(threading, "_shutdown", None)
            if shutdown is not None:
                shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.flush()
        os._exit(code)


def exit_distributed(code: int = 0) -> NoReturn:
    """End a rank of a ``torch.distributed`` job (DeepSpeed, torchrun, accelerate): the last call of its script."""
    alive = shutdown_distributed(barrier=code == 0)
    if alive is None or alive:
        exit_process(code)
    raise SystemExit(code)


def partition_by_bytes(weights: list[int], world_size: int) -> list[list[int]]:
    """Assign items to ranks, heaviest first to the least-loaded rank (ties: lowest rank)."""
    loads = [0] * world_size
    owners: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[rank].append(index)
        loads[rank] += weights[index]
    return [sorted(items) for items in owners]


def _terminated(signum: int) -> RankFailedError:
    # torchrun / accelerate terminate the other workers with SIGTERM when one fails: an exception lets the cleanup
    # (removing the temporary output directory) run
    return RankFailedError(f"terminated by signal {signum} (another rank failed)")
