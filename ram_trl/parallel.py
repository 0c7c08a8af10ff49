"""Blocks of work on a small thread pool, one thread per core (the merge's compute blocks, the telemetry's chunks).

torch releases the GIL inside its kernels, so Python threads that each run single-threaded torch operations on
their own block use every core without the barrier of a multi-threaded operation after each step.

Making a thread single-threaded (``torch.set_num_threads``) is a process-wide knob: it also writes the default that
new threads start from, resizes torch's shared thread pool and clears oneDNN's cache. So the pools run only in a
process the library owns (the ``ram-trl`` command line, a recipe's stage process: :func:`owned_process`); called
from a user's process (the Python API, a callback in a trainer) every block runs on the calling thread, with
torch's threads as the caller set them.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

import torch

Item = TypeVar("Item")
Result = TypeVar("Result")

_OWNED: ContextVar[bool] = ContextVar("ram_trl_owned_process", default=False)


@contextmanager
def owned_process() -> Iterator[None]:
    """Mark the work inside as running in a process the library owns (the ``ram-trl`` command line, a recipe's stage
    process): its compute pools may then set the torch thread count of their worker threads, a process-wide knob.
    Outside (the default) they run nothing on threads of their own."""
    token = _OWNED.set(True)
    try:
        yield
    finally:
        _OWNED.reset(token)


@dataclass(frozen=True)
class ThreadPlan:
    """How many threads each part of the work gets on a machine (see :func:`plan_threads`)."""

    cores: int
    compute: int
    readers: int
    telemetry: int


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it, else the CPU count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


#: Environment variables in which launchers (torchrun and accelerate: ``LOCAL_WORLD_SIZE``; the DeepSpeed launcher:
#: ``LOCAL_SIZE``) tell each process how many processes of the job share its node.
LOCAL_PROCESSES_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def _positive_env(name: str) -> int | None:
    """A positive integer environment variable, ``None`` when unset or not a positive integer."""
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def process_cores() -> int:
    """The cores this process's thread plan may use: :func:`available_cores`, shared with the other processes of a
    launched job on the same node (``LOCAL_WORLD_SIZE`` / ``LOCAL_SIZE``), and no more than ``OMP_NUM_THREADS``
    when that is set (the per-process budget a user, a launcher such as torchrun, or a recipe's ``torch_threads``
    gives)."""
    cores = available_cores()
    local = next((n for n in map(_positive_env, LOCAL_PROCESSES_VARIABLES) if n is not None), 1)
    cores = max(1, cores // local)
    budget = _positive_env("OMP_NUM_THREADS")
    return cores if budget is None else min(cores, budget)


def plan_threads(cores: int | None = None) -> ThreadPlan:
    """The thread plan for ``cores`` cores: the merge computes on every core but the one its readers use (from 4 cores
    on; below that the readers mostly wait on the disk and take no core of their own), reads with one thread per
    16 cores (at least one), and a telemetry measurement on the CPU uses every core (the training step it runs in
    waits for it).

    The plan decides how many threads run, never what they compute: the merge's blocks and the telemetry's chunks are
    the same for every plan, and their results are combined in a fixed order, so outputs and metrics do not depend
    on it."""
    cores = process_cores() if cores is None else cores
    if cores < 1:
        raise ValueError(f"cores={cores}: plan for at least one core")
    readers = max(1, cores // 16)
    compute = cores if cores < 4 else cores - readers
    return ThreadPlan(cores, compute, readers, cores)


def _single_threaded_worker() -> None:
    """Pool initializer: this worker thread runs single-threaded torch operations. torch's thread count is per
    thread (OpenMP, MKL); the first call initializes this thread from the process default, the second sets it."""
    torch.get_num_threads()
    torch.set_num_threads(1)


@contextmanager
def compute_pool(device: torch.device, workers: int | None = None) -> Iterator[ThreadPoolExecutor | None]:
    """Threads that run blocks of work (e.g. :func:`~ram_trl.merging.streaming.compute_blocks`) in parallel on the CPU.

    Each worker runs single-threaded torch operations, so each block stays on one core and no operation waits for a
    barrier of all cores. Only inside :func:`owned_process` (setting a worker's thread count is process-wide); the
    calling thread's count and the default that new threads start from are put back before any work runs. Yields
    ``None`` (run blocks in order on the calling thread) on an accelerator, with one worker, or outside it."""
    previous = torch.get_num_threads()
    workers = plan_threads().compute if workers is None else workers
    if device.type != "cpu" or workers <= 1 or not _OWNED.get():
        yield None
        return
    with _started_pool(workers, previous) as pool:
        yield pool


def _start_pool(workers: int, default: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` single-threaded worker threads, all started, with the process default that new threads
    start from put back to ``default`` (a worker's setting writes it too) before any work runs."""
    pool = ThreadPoolExecutor(
        max_workers=workers, thread_name_prefix="ram-trl-compute", initializer=_single_threaded_worker
    )
    started = threading.Barrier(workers + 1)
    for _ in range(workers):  # start every worker now (the executor starts them lazily, one per waiting task)
        pool.submit(started.wait)
    started.wait()
    torch.set_num_threads(default)
    return pool


@contextmanager
def _started_pool(workers: int, default: int) -> Iterator[ThreadPoolExecutor]:
    with _start_pool(workers, default) as pool:
        yield pool


def single_threaded_worker() -> ThreadPoolExecutor | None:
    """One started worker thread that runs single-threaded torch operations, for :func:`single_threaded_call` (keep it
    to reuse the thread; it ends when the executor is shut down or collected); ``None`` outside :func:`owned_process`."""
    return _start_pool(1, torch.get_num_threads()) if _OWNED.get() else None


def single_threaded_call(fn: Callable[[], Result], worker: ThreadPoolExecutor | None = None) -> Result:
    """``fn()`` on a worker thread that runs single-threaded torch operations; on the calling thread outside
    :func:`owned_process`.

    For host work done beside a training loop (e.g. the telemetry's summary of its histograms): on a CPU shared with
    training, torch's multi-threaded operations on small tensors wait at barriers for busy cores (measured on 2 busy
    cores: the telemetry's summary took 1.5 s multi-threaded on the calling thread, 0.1-0.2 s here); on the calling
    thread outside :func:`owned_process`."""
    if not _OWNED.get():
        return fn()
    if worker is not None:
        return worker.submit(fn).result()
    with _started_pool(1, torch.get_num_threads()) as pool:
        return pool.submit(fn).result()


def map_blocks(pool: ThreadPoolExecutor | None, fn: Callable[[Item], Result], items: Iterable[Item]) -> list[Result]:
    """``[fn(item) for item in items]``, on the pool's threads when there is one; errors are raised in order."""
    if pool is None:
        return [fn(item) for item in items]
    return list(pool.map(fn, items))


def submit_blocks(
    pool: ThreadPoolExecutor | None, fn: Callable[[Item], Result], items: Iterable[Item]
) -> Callable[[], list[Result]]:
    """Start ``fn`` over ``items`` on the pool now; the returned function waits for the results, in order.

    Lets a caller submit the blocks of its next unit of work (e.g. the next chunk) before waiting for this one's, so
    that the pool does not idle while the last blocks of a unit finish and the next unit is prepared."""
    if pool is None:
        results = [fn(item) for item in items]
        return lambda: results
    futures = [pool.submit(fn, item) for item in items]

    def wait() -> list[Result]:
        try:
            return [future.result() for future in futures]
        finally:
            for future in futures:
                future.cancel()

    return wait


def imap_blocks(
    pool: ThreadPoolExecutor | None, fn: Callable[[Item], Result], items: Iterable[Item], ahead: int = 8
) -> Iterator[Result]:
    """Lazy :func:`map_blocks` for long streams of items: results in order, at most ``ahead`` items in flight."""
    if pool is None:
        yield from map(fn, items)
        return
    pending: deque[Future[Result]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
