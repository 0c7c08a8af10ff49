"""The thread pool helpers shared by the merge engine and the telemetry."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ram_trl import parallel
from ram_trl.parallel import (
    available_cores,
    compute_pool,
    imap_blocks,
    map_blocks,
    owned_process,
    plan_threads,
    process_cores,
    submit_blocks,
)


@pytest.fixture
def owned():
    """The pools of a process the library owns (the command line's): the tests below exercise the threads."""
    with owned_process():
        yield


def test_a_guest_runs_no_pool():
    with compute_pool(torch.device("cpu"), workers=2) as pool:
        assert pool is None
    assert parallel.single_threaded_worker() is None
    assert parallel.single_threaded_call(threading.current_thread) is threading.current_thread()


GUEST = """
import threading

import torch

import ram_trl
from ram_trl import parallel
from ram_trl.synthetic import make_agent_set, make_base_checkpoint
from ram_trl.callbacks.telemetry import TaskVectorTracker
from tests.callbacks.telemetry.helpers import tiny_model, train, write_base

parallel.available_cores = lambda: 4  # the thread plan of a 4-core machine: pools of several workers
torch.set_num_threads(3)
calls = []
setter = torch.set_num_threads
torch.set_num_threads = lambda n: calls.append(n) or setter(n)
base = make_base_checkpoint(ROOT + "/base", hidden_size=16, num_layers=1, intermediate_size=32)
agents = make_agent_set(base, ROOT, densities=(0.1, 0.2), seed=1)
ram_trl.merge({"merge_method": "ram", "base_model": str(base), "models": [{"model": str(a)} for a in agents]},
              ROOT + "/out", progress=False)
tracker = TaskVectorTracker(base_model=write_base(__import__("pathlib").Path(ROOT) / "tiny"))
tracker.measure(train(tiny_model()))
fresh = []
thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
thread.start()
thread.join()
print(torch.get_num_threads(), fresh[0], calls)
"""


def test_a_merge_and_a_measurement_in_a_users_process_leave_torch_threads_alone(tmp_path):
    """No ``torch.set_num_threads`` (a process-wide knob: in this torch a worker's call changes every thread's
    count) from the Python API or a tracker: the caller's count and that of threads started later stay 3."""
    script = f"ROOT = {str(tmp_path)!r}\n" + textwrap.dedent(GUEST)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-2] == "3 3 []"


@pytest.mark.usefixtures("owned")
def test_compute_pool_workers_run_single_threaded_and_the_caller_keeps_its_setting():
    before = torch.get_num_threads()
    with compute_pool(torch.device("cpu"), workers=2) as pool:
        assert pool is not None and torch.get_num_threads() == before
        assert map_blocks(pool, lambda x: x * x, range(5)) == [0, 1, 4, 9, 16]
        assert set(map_blocks(pool, lambda _: torch.get_num_threads(), range(8))) == {1}
    assert torch.get_num_threads() == before
    fresh: list[int] = []
    thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert fresh == [before]  # threads started later begin from the process default, unchanged
    with compute_pool(torch.device("cpu"), workers=1) as pool:
        assert pool is None
    with compute_pool(torch.device("meta"), workers=2) as pool:
        assert pool is None


@pytest.mark.usefixtures("owned")
@pytest.mark.parametrize("workers", [1, 3])
def test_imap_blocks_keeps_order_and_bounds_work_in_flight(workers):
    started: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            started.append(i)
        time.sleep(0.001 * (i % 3))  # finish out of order
        return i * 10

    def items():
        for i in range(40):
            with lock:
                assert len(started) <= i  # nothing runs ahead of the items consumed
            yield i

    with compute_pool(torch.device("cpu"), workers=workers) as pool:
        seen = []
        for i, result in enumerate(imap_blocks(pool, work, items(), ahead=4)):
            with lock:
                assert len(started) <= i + 4
            seen.append(result)
    assert seen == [i * 10 for i in range(40)]


@pytest.mark.usefixtures("owned")
def test_imap_blocks_raises_errors_in_order_and_cancels_the_rest():
    ran: list[int] = []

    def work(i: int) -> int:
        ran.append(i)
        if i == 2:
            raise ValueError("item 2")
        time.sleep(0.01)
        return i

    with compute_pool(torch.device("cpu"), workers=2) as pool:
        results = imap_blocks(pool, work, range(100), ahead=4)
        assert [next(results), next(results)] == [0, 1]
        with pytest.raises(ValueError, match="item 2"):
            next(results)
    assert len(ran) < 10


@pytest.mark.usefixtures("owned")
@pytest.mark.parametrize("workers", [1, 2])
def test_submit_blocks_runs_ahead_and_returns_results_in_order(workers):
    gate = threading.Event()
    started: list[int] = []

    def work(i: int) -> int:
        started.append(i)
        if i == 0 and workers > 1:
            gate.wait(5)  # the first unit's first block is slow
        return i * i

    with compute_pool(torch.device("cpu"), workers=workers) as pool:
        first = submit_blocks(pool, work, [0, 1])
        second = submit_blocks(pool, work, [2, 3])  # queued before the first unit is awaited
        if workers > 1:
            deadline = time.monotonic() + 5
            while 3 not in started and time.monotonic() < deadline:
                time.sleep(0.001)
            assert 3 in started  # the second unit ran while the first was still busy
            gate.set()
        assert first() == [0, 1]
        assert second() == [4, 9]


@pytest.mark.usefixtures("owned")
def test_submit_blocks_raises_the_first_error_in_order():
    def work(i: int) -> int:
        if i in (1, 2):
            raise ValueError(f"item {i}")
        return i

    with compute_pool(torch.device("cpu"), workers=2) as pool:
        wait = submit_blocks(pool, work, range(4))
        with pytest.raises(ValueError, match="item 1"):
            wait()
    with pytest.raises(ValueError, match="item 1"):
        submit_blocks(None, work, range(4))  # no pool: runs at once


@pytest.mark.parametrize(
    "cores, compute, readers, telemetry", [(1, 1, 1, 1), (2, 2, 1, 2), (4, 3, 1, 4), (16, 15, 1, 16), (64, 60, 4, 64)]
)
def test_thread_plan_follows_the_cores(cores, compute, readers, telemetry):
    plan = plan_threads(cores)
    assert (plan.cores, plan.compute, plan.readers, plan.telemetry) == (cores, compute, readers, telemetry)
    assert plan.compute + (plan.readers if cores >= 4 else 0) == cores  # every core used, none oversubscribed


def test_thread_plan_defaults_to_this_process_and_refuses_zero_cores():
    assert plan_threads().cores == process_cores() >= 1
    assert process_cores() <= available_cores()
    with pytest.raises(ValueError, match="cores=0"):
        plan_threads(0)


@pytest.fixture
def cores(monkeypatch):
    """Simulate a machine: ``cores(n)`` makes this process see ``n`` cores, with no launcher or OpenMP variables."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)

    def simulate(n: int) -> None:
        monkeypatch.setattr(parallel, "available_cores", lambda: n)

    return simulate


def test_process_cores_are_shared_by_a_nodes_processes_and_capped_by_openmp(cores, monkeypatch):
    cores(16)
    assert process_cores() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun / accelerate: 4 processes on this node
    assert process_cores() == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "3")  # the DeepSpeed launcher
    assert process_cores() == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a per-process budget set by the user or a launcher
    assert process_cores() == 2
    monkeypatch.setenv("LOCAL_SIZE", "32")  # more processes than cores: one each
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")  # ignored
    assert process_cores() == 1
    assert plan_threads().cores == 1


@pytest.mark.usefixtures("owned")
@pytest.mark.parametrize(("simulated", "workers"), [(1, None), (2, 2), (3, 3), (8, 7)])
def test_the_compute_pool_follows_the_thread_plan(cores, simulated, workers):
    cores(simulated)
    before = torch.get_num_threads()
    with compute_pool(torch.device("cpu")) as pool:
        assert (
            (None if pool is None else pool._max_workers) == workers == (plan_threads().compute if workers else None)
        )
        if pool is not None:
            names = set(map_blocks(pool, lambda _: threading.current_thread().name, range(4 * simulated)))
            assert len(names) <= workers
    assert torch.get_num_threads() == before  # no global thread state changed by a pool of any size
