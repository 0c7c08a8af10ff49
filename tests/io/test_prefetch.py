"""ram_trl.io.prefetch: the read-ahead iterator and the background writer keep order, bound their queues and
surface errors where the caller can handle them."""

from __future__ import annotations

import threading
import time

import pytest

from ram_trl.io.prefetch import BackgroundWriter, read_ahead


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_read_ahead_yields_in_order(depth):
    assert list(read_ahead(range(10), lambda i: i * i, depth=depth)) == [i * i for i in range(10)]


def test_read_ahead_of_nothing():
    assert list(read_ahead([], lambda i: i, depth=2)) == []


@pytest.mark.parametrize("depth", [1, 2])
def test_read_ahead_reads_at_most_depth_items_ahead(depth):
    started: list[int] = []

    def read(i: int) -> int:
        started.append(i)
        return i

    results = read_ahead(range(8), read, depth=depth)
    assert next(results) == 0
    time.sleep(0.05)  # give the reader time to run ahead as far as it may
    # the consumer holds item 0; items 1..depth may have been read, nothing beyond
    assert max(started) <= depth
    assert list(results) == list(range(1, 8))


@pytest.mark.parametrize("readers", [1, 3])
def test_several_readers_read_at_once_in_order_and_hold_no_more_items(readers):
    """With ``readers`` threads the first items are read concurrently (each of them waits until all are being read),
    the results still come in order, and no more items are read ahead than with one reader."""
    depth = 3
    together = threading.Barrier(readers, timeout=30)  # broken (an error) unless ``readers`` reads overlap
    lock = threading.Lock()
    started: list[int] = []
    threads: set[str] = set()

    def read(i: int) -> int:
        with lock:
            started.append(i)
            threads.add(threading.current_thread().name)
        if i < readers:
            together.wait()
        return i * i

    results = read_ahead(range(12), read, depth=depth, readers=readers)
    assert next(results) == 0
    time.sleep(0.05)
    assert max(started) <= depth  # the consumer holds item 0; items 1..depth may have been read, nothing beyond
    assert [0, *results] == [i * i for i in range(12)]
    assert len(threads) == readers


def test_read_ahead_with_depth_0_reads_on_the_calling_thread():
    threads = []
    list(read_ahead(range(3), lambda i: threads.append(threading.current_thread()), depth=0))
    assert threads == [threading.current_thread()] * 3


def test_read_ahead_raises_an_error_when_its_item_is_reached():
    def read(i: int) -> int:
        if i == 3:
            raise OSError("disk error at 3")
        return i

    got = []
    with pytest.raises(OSError, match="disk error at 3"):
        for value in read_ahead(range(6), read, depth=2):
            got.append(value)
    assert got == [0, 1, 2]


def test_background_writer_runs_calls_in_order_on_one_thread():
    calls: list[tuple[int, str]] = []
    writer = BackgroundWriter(depth=2)
    for i in range(20):
        writer.submit(lambda i: calls.append((i, threading.current_thread().name)), i)
    writer.close()
    assert [i for i, _ in calls] == list(range(20))
    names = {name for _, name in calls}
    assert len(names) == 1 and next(iter(names)).startswith("ram-trl-write")


def test_background_writer_bounds_its_queue():
    gate = threading.Event()
    writer = BackgroundWriter(depth=2)
    writer.submit(gate.wait)  # blocks the writer thread
    writer.submit(lambda: None)
    submitted = threading.Event()

    def third() -> None:
        writer.submit(lambda: None)
        submitted.set()

    thread = threading.Thread(target=third)
    thread.start()
    assert not submitted.wait(0.1), "a third call was queued while two were pending"
    gate.set()
    assert submitted.wait(5)
    thread.join()
    writer.close()


def test_background_writer_raises_the_first_error_on_submit_or_drain():
    def fail() -> None:
        raise OSError("no space left")

    writer = BackgroundWriter(depth=1)
    writer.submit(fail)
    with pytest.raises(OSError, match="no space left"):
        writer.submit(lambda: None)  # waits for the failed call first
    writer.abort()

    writer = BackgroundWriter(depth=4)
    writer.submit(fail)
    with pytest.raises(OSError, match="no space left"):
        writer.drain()
    writer.close()


def test_background_writer_abort_cancels_queued_calls():
    gate = threading.Event()
    ran: list[int] = []
    writer = BackgroundWriter(depth=3)
    writer.submit(gate.wait)
    writer.submit(ran.append, 1)
    writer.submit(ran.append, 2)
    threading.Timer(0.05, gate.set).start()
    writer.abort()
    assert ran == []
