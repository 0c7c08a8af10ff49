"""Blocks of work on a thread pool, one single-threaded torch worker per core (torch releases the GIL in its kernels).
``torch.set_num_threads`` is process-wide (the default for new threads, the shared pool, oneDNN's cache), so pools run
only in a process the library owns (:func:`owned_process`); elsewhere every block runs on the calling thread."""

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
    """Mark the work inside as running in a process the library owns (the command line, a recipe's stage process):
    only there may the compute pools set their workers' torch thread count, a process-wide knob."""
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
    """The cores this process's thread plan may use: :func:`available_cores` shared with the launched job's other
    processes on the node (``LOCAL_WORLD_SIZE`` / ``LOCAL_SIZE``), at most ``OMP_NUM_THREADS`` when set."""
    cores = available_cores()
    local = next((n for n in map(_positive_env, LOCAL_PROCESSES_VARIABLES) if n is not None), 1)
    cores = max(1, cores // local)
    budget = _positive_env("OMP_NUM_THREADS")
    return cores if budget is None else min(cores, budget)


def plan_threads(cores: int | None = None) -> ThreadPlan:
    """The thread plan for ``cores`` cores (docs/merging.md): compute on every core but the readers' from 4 cores on,
    one reader per 16 cores, a CPU telemetry measurement on every core. It sets how many threads run, never what they
    compute (blocks and combination order are fixed), so outputs do not depend on it."""
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
    """Single-threaded torch workers that run blocks of work in parallel on the CPU, inside :func:`owned_process` only
    (the caller's thread count and the new-thread default are put back before any work runs). Yields ``None`` (run the
    blocks in order on the calling thread) on an accelerator, with one worker, or outside it."""
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
    """``fn()`` on a single-threaded torch worker (on the calling thread outside :func:`owned_process`): beside
    training, multi-threaded ops on small tensors wait at barriers for busy cores (on 2 busy cores the telemetry's
    summary took 1.5 s multi-threaded, 0.1-0.2 s here)."""
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
    """Start ``fn`` over ``items`` on the pool now; the returned function waits for the results, in order (so the next
    chunk's blocks can be queued before this one's are awaited and the pool does not idle)."""
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
