"""RowReader's descriptor cache under concurrency: an evicted descriptor is never closed (or reused by another open)
while a read holds it, with more files than the cache and reads on many threads."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ram_trl.io import safetensors_io
from ram_trl.io.safetensors_io import RowReader, TensorInfo, read_safetensors_header

NUM_FILES = 80  # more than RowReader's default cache of 64 descriptors


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[tuple[TensorInfo, torch.Tensor]]:
    root: Path = tmp_path_factory.mktemp("shards")
    out = []
    for i in range(NUM_FILES):
        value = torch.full((4, 3), float(i)) + torch.arange(12.0).reshape(4, 3) / 100
        path = root / f"shard-{i:03d}.safetensors"
        save_file({"w": value}, str(path))
        out.append((read_safetensors_header(path)[0]["w"], value))
    return out


def test_a_read_in_flight_keeps_its_descriptor_when_other_reads_evict_it(shards, monkeypatch):
    """Deterministic interleaving: while the first read waits inside preadv, other reads open enough files to
    evict its descriptor; the first read must still read its own file."""
    reader = RowReader(max_open_files=2, map_min_bytes=None)
    real_preadv = os.preadv
    nested = threading.local()

    def preadv(fd, buffers, offset):
        if not getattr(nested, "active", False):
            nested.active = True
            try:
                for info, _ in shards[1:6]:  # evicts shard 0's descriptor; new opens may reuse its number
                    reader.read_rows(info)
            finally:
                nested.active = False
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(safetensors_io.os, "preadv", preadv)
    info, expected = shards[0]
    assert torch.equal(reader.read_rows(info), expected)
    reader.close()


@pytest.mark.parametrize("map_min_bytes", [None, 1])  # positioned reads, memory maps
def test_concurrent_readers_over_many_tiny_shards(shards, map_min_bytes):
    reader = RowReader(max_open_files=8, map_min_bytes=map_min_bytes)
    order = [(i * 37 + k) % NUM_FILES for k in range(8) for i in range(NUM_FILES)]

    def read(index: int) -> bool:
        info, expected = shards[index]
        return all(torch.equal(reader.read_rows(info, r, r + 1), expected[r : r + 1]) for r in range(4))

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert all(pool.map(read, order))
    reader.close()


def test_close_waits_for_reads_in_flight(shards, monkeypatch):
    reader = RowReader(map_min_bytes=None)
    real_preadv = os.preadv

    def preadv(fd, buffers, offset):
        reader.close()  # e.g. the merge ends on another thread
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(safetensors_io.os, "preadv", preadv)
    info, expected = shards[3]
    assert torch.equal(reader.read_rows(info), expected)


def test_descriptors_are_closed_once_released(shards):
    reader = RowReader(max_open_files=4, map_min_bytes=None)
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for info, expected in shards[:20]:
        assert torch.equal(reader.read_rows(info), expected)
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) <= before + 4
    reader.close()
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) <= before
