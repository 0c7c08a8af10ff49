"""The tracker is a guest in the training process: it leaves torch's thread settings and the garbage collector alone
(observed on the calling thread, on another thread during the measurement, and on threads started after it)."""

from __future__ import annotations

import gc
import threading

import torch
from safetensors.torch import save_file
from torch import nn

from ram_trl.callbacks.telemetry import TaskVectorTracker


def _settings() -> tuple[int, bool, tuple[int, ...]]:
    return torch.get_num_threads(), gc.isenabled(), gc.get_threshold()


def test_measurement_changes_no_thread_or_gc_setting(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(256, 256, bias=False)
    save_file({"weight": model.weight.detach().clone()}, str(tmp_path / "model.safetensors"))
    with torch.no_grad():
        model.weight.add_(torch.randn_like(model.weight) * 1e-3)
    before = _settings()
    tracker = TaskVectorTracker(base_model=tmp_path, threads=2, chunk_elements=1024, magnitude_sample=None)
    inside: list[tuple[int, bool, tuple[int, ...]]] = []
    in_workers: list[int] = []
    measure, measure_chunk = tracker._measure, tracker._measure_chunk

    def recording_measure(*args):
        inside.append(_settings())  # the calling thread, while it measures
        return measure(*args)

    def recording_chunk(chunk):
        in_workers.append(torch.get_num_threads())
        return measure_chunk(chunk)

    tracker._measure, tracker._measure_chunk = recording_measure, recording_chunk
    observed: list[tuple[int, bool, tuple[int, ...]]] = []
    stop = threading.Event()

    def observe() -> None:
        while True:
            observed.append(_settings())
            if stop.wait(0.001):  # sample every millisecond, leaving the GIL to the measurement
                break

    observer = threading.Thread(target=observe)
    observer.start()
    try:
        out = tracker.measure(model)
    finally:
        stop.set()
        observer.join()
    assert out["task_vector/active"] > 0
    fresh: list[tuple[int, bool, tuple[int, ...]]] = []
    later = threading.Thread(target=lambda: fresh.append(_settings()))
    later.start()
    later.join()
    assert inside == [before]
    assert len(observed) > 1 and set(observed) == {before}
    assert _settings() == before and fresh == [before]
    assert in_workers and set(in_workers) == {1}  # the workers themselves run single-threaded operations
