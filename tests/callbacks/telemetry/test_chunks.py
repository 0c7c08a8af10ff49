"""ram_trl/callbacks/telemetry/chunks.py: the pieces of a LoRA region, the flag counts and the reused buffers of a
measurement."""

from __future__ import annotations

import pytest
import torch

from ram_trl.callbacks.telemetry.chunks import Workspace, flag_count, lora_chunks, row_numel
from ram_trl.callbacks.telemetry.layout import Region
from ram_trl.callbacks.telemetry.shards import LocalShard


@pytest.mark.parametrize(("offset", "numel", "size"), [(0, 20, 8), (3, 13, 8), (6, 1, 4), (0, 20, 100)])
def test_lora_pieces_cover_the_local_range_on_whole_rows(offset, numel, size):
    shape = (5, 4)
    region = Region("w", LocalShard("w", torch.zeros(numel), shape, offset, True), "lora")
    pieces = list(lora_chunks(region, size))
    position = 0
    for start, count, row_start, row_stop in pieces:
        assert start == position and count > 0  # consecutive, nothing skipped or repeated
        first, last = offset + start, offset + start + count  # flat range in the full tensor
        assert row_start * 4 <= first and last <= row_stop * 4  # held by the rows of the delta computed
        assert (row_stop - row_start) <= max(1, size // 4)  # at most size elements of delta per piece
        position += count
    assert position == numel


def test_flag_count_counts_ones():
    flags = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    assert flag_count(flags) == 3
    assert flag_count(torch.zeros(0)) == 0


def test_row_numel():
    assert row_numel((5, 4, 3)) == 12
    assert row_numel((7,)) == 1
    assert row_numel(()) == 1


def test_a_cpu_workspace_stages_nothing_and_counts_its_buffers():
    ws = Workspace(64, torch.bfloat16, torch.device("cpu"))
    stored = torch.arange(10, dtype=torch.bfloat16)
    assert ws.stage(stored) is stored  # on the CPU the base is read where it is
    assert ws.nbytes == 7 * 64 * 4 + 64 * 2 + ws.magnitude.nbytes
    assert ws.histogram.num_agents == 1
