"""Two real processes (gloo): partitioned and replicated parameters give the single-process numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ram_trl.callbacks.telemetry import layout as layout_module
from ram_trl.callbacks.telemetry import tracker as tracker_module
from ram_trl.callbacks.telemetry.shards import LocalShard
from ram_trl.distributed import exit_distributed, shutdown_distributed
from tests.callbacks.telemetry.helpers import (
    tiny_model,
    train,
    write_base,
    write_full_prior,
    write_lora_prior,
    write_stage,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

#: Parameters split between the two processes (the others are replicated on both).
PARTITIONED = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}


def halves(model: torch.nn.Module):
    """Like ZeRO-3: each partitioned parameter's flat range is split between the ranks (rank 0 gets the ceiling)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        if name in PARTITIONED:
            size = math.ceil(flat.numel() / world)
            start = min(rank * size, flat.numel())
            stop = min(start + size, flat.numel())
            yield LocalShard(name, flat[start:stop], tuple(param.shape), start, True)
        else:
            yield LocalShard(name, flat, tuple(param.shape), 0, False)


def worker(rank: int, root: str, stages: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2)
    try:
        layout_module.iter_local_shards = halves  # where the layout finds the local shards
        tracker = tracker_module.TaskVectorTracker(base_model=f"{root}/base", prior_stages=stages)
        out = tracker.measure(train(tiny_model()))
        Path(root, f"rank{rank}.json").write_text(json.dumps(out))
    except BaseException:
        shutdown_distributed(barrier=False)
        raise  # reported by mp.spawn
    # the group's threads can outlive destroy_process_group here too: exit without finalizing then (docs/ci.md)
    exit_distributed()


def test_two_processes_equal_one(tmp_path):
    base = write_base(tmp_path / "base")
    stages = [
        str(write_stage(tmp_path, "full", write_full_prior(tmp_path / "agent_full"), base)),
        str(write_stage(tmp_path, "lora", write_lora_prior(tmp_path / "agent_lora"), base)),
    ]
    single = tracker_module.TaskVectorTracker(base_model=base, prior_stages=stages).measure(train(tiny_model()))
    mp.spawn(worker, args=(str(tmp_path), stages), nprocs=2, join=True)
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(out) == set(single)
        for key, value in single.items():
            if key.endswith(("measure_seconds", "state_mb", "work_mb")):  # work_mb: buffers per worker thread
                continue
            assert out[key] == value, key
