"""Local shards in real 2-process jobs on CPU (gloo): DeepSpeed ZeRO-3 and ZeRO-2, FSDP2 (``fully_shard``) and DDP.

Each job trains a tiny model 3 steps, then every rank counts its task vector on its own shards against the same
flat range of the base read from disk, and measures it with TaskVectorTracker, with every gathering collective
patched to raise (tests/callbacks/telemetry/_dist_worker.py). Here, in one process, the same counts and the tracker's metrics
are computed on the full trained weights (gathered by the job after the measurement) and must be equal.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ram_trl.callbacks.telemetry.tracker import TaskVectorTracker
from ram_trl.stage.manifest import fingerprint_checkpoint
from tests._launch import free_port, run_job
from tests.callbacks.telemetry._counting import Counts
from tests.callbacks.telemetry._dist_worker import SAMPLED, USED_TOKENS, OddNet

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = Path(__file__).with_name("_dist_worker.py")
WORLD = 2
FULL_NUMEL = {
    "gain": 1,
    "embed.weight": 101 * 12,
    "hidden.weight": 7 * 12,
    "hidden.bias": 7,
    "out.weight": 3 * 7,
    "out.bias": 3,
}


def launch(mode: str, base: Path, out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    port = free_port()
    if mode.startswith("zero"):
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[distributed]')")
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(WORLD)]
        command += ["--master_port", str(port)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD)]
        command += ["--master_port", str(port)]
    command += [str(WORKER), mode, str(base), str(out)]
    result = run_job(command, port, cwd=WORKER.parent, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise AssertionError(
            f"{mode} job failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
        )


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        save_file(OddNet().state_dict(), str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module", params=["zero3", "zero2", "fsdp2", "ddp"])
def job(request, base_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp(request.param)
    launch(request.param, base_dir, out)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    trained = load_file(str(out / "trained.safetensors"))
    base = load_file(str(base_dir / "model.safetensors"))
    single = Counts().add_all((name, trained[name], base[name]) for name in base)
    model = OddNet()
    model.load_state_dict(trained)
    single_metrics = {
        "disk": TaskVectorTracker(base_model=base_dir, save_dtype="bfloat16").measure(model, step=3),
        "sampled": TaskVectorTracker(base_model=base_dir, **SAMPLED).measure(model, step=3),
    }
    return {
        "mode": request.param,
        "ranks": ranks,
        "single": single.as_json(),
        "single_metrics": single_metrics,
        "trained": trained,
        "base": base,
        "base_dir": base_dir,
    }


def test_shards_of_all_ranks_tile_every_parameter(job) -> None:
    shards = [{s["name"]: s for s in rank["shards"]} for rank in job["ranks"]]
    for name, numel in FULL_NUMEL.items():
        pieces = [rank_shards[name] for rank_shards in shards]
        assert all(p["shape"] == list(job["base"][name].shape) for p in pieces)
        if job["mode"] in ("ddp", "zero2"):  # full replicas on every rank
            assert [(p["offset"], p["numel"], p["partitioned"]) for p in pieces] == [(0, numel, False)] * WORLD
            continue
        assert all(p["partitioned"] for p in pieces), name
        ranges = sorted((p["offset"], p["offset"] + p["numel"]) for p in pieces if p["numel"])
        assert ranges[0][0] == 0 and ranges[-1][1] == numel, (name, ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges[:-1], ranges[1:], strict=True)), (name, ranges)


def test_partition_layouts_are_the_frameworks(job) -> None:
    layout = {s["name"]: (s["offset"], s["numel"]) for s in job["ranks"][1]["shards"]}
    if job["mode"] == "zero3":
        # flat partitions of ceil(numel / 2) elements, the padding cut off; the 1-element parameter is all on rank 0
        assert layout == {
            "gain": (1, 0),
            "embed.weight": (606, 606),
            "hidden.weight": (42, 42),
            "hidden.bias": (4, 3),
            "out.weight": (11, 10),
            "out.bias": (2, 1),
        }
    elif job["mode"] == "fsdp2":
        # blocks of ceil(rows / 2) rows: 51 + 50 embedding rows, 4 + 3 hidden rows, 2 + 1 output rows
        assert layout == {
            "gain": (1, 0),
            "embed.weight": (51 * 12, 50 * 12),
            "hidden.weight": (4 * 12, 3 * 12),
            "hidden.bias": (4, 3),
            "out.weight": (2 * 7, 1 * 7),
            "out.bias": (2, 1),
        }


def test_partial_counts_sum_to_the_single_process_counts_per_parameter(job) -> None:
    single = job["single"]["per_parameter"]
    partials = [rank["partial"]["per_parameter"] for rank in job["ranks"]]
    for name in FULL_NUMEL:
        if job["mode"] in ("ddp", "zero2"):
            assert [p[name] for p in partials] == [single[name]] * WORLD
        else:
            assert sum(p[name] for p in partials) == single[name], name
    # the measurement is not vacuous: trained rows changed, rows of unused tokens did not
    assert single["hidden.weight"] == FULL_NUMEL["hidden.weight"]
    tau = job["trained"]["embed.weight"] - job["base"]["embed.weight"]
    assert torch.count_nonzero(tau[USED_TOKENS:]) == 0
    assert 0 < single["embed.weight"] <= USED_TOKENS * 12


def test_tracker_on_every_rank_equals_the_tracker_in_one_process(job) -> None:
    single = job["single_metrics"]["disk"]
    assert 0 < single["task_vector/density"] < 1
    assert single["task_vector/numel"] == sum(FULL_NUMEL.values())
    assert single["task_vector/active"] == sum(job["single"]["per_parameter"].values())
    sampled = job["single_metrics"]["sampled"]
    assert sampled["task_vector/magnitude/sample_fraction"] == 1 / 20
    assert sampled["task_vector/magnitude/mean_abs"] != single["task_vector/magnitude/mean_abs"]
    for rank in job["ranks"]:
        for key, metrics in rank["metrics"].items():
            # the disk base and the reference model give the same numbers; the sample covers the same elements
            single = job["single_metrics"]["sampled" if key == "sampled" else "disk"]
            assert set(metrics) == set(single), key
            for name, value in single.items():
                if name.endswith(("measure_seconds", "state_mb", "work_mb")):  # per process: buffers per worker
                    continue
                if "/magnitude/" in name:  # float64 sums added in another order
                    assert metrics[name] == pytest.approx(value, rel=1e-12, abs=1e-15), (key, name)
                else:
                    assert metrics[name] == value, (key, name)


def test_no_gather_during_the_measurement_and_only_count_all_reduces(job) -> None:
    bins = 2 ** (9 + 7)  # by sign and |tau|
    per_tensor_counts = len(FULL_NUMEL) * 4 * 8  # active, changed, active_saved, numel per base tensor
    magnitudes = bins * 8 * 2 + 8  # int64 counts and remainder sums per bin, sum tau**2
    overlap = 8 * 2 + 8 + 8  # histogram (1 x 2), pairwise (1 x 1), element count
    for rank in job["ranks"]:
        # the guard was live (a deliberate gather inside it raised), yet the measurements completed
        assert rank["gather_blocked"] is True
        # one measurement: 7 all-reduces of counts (never of weights): 1 + 3 magnitude + 2 overlap + 1 count
        assert rank["calls"]["disk_measure_all_reduces"] == 7
        assert rank["calls"]["disk_measure_bytes"] == per_tensor_counts + magnitudes + overlap


def test_zero3_reference_model_is_partitioned_like_the_policy(job) -> None:
    # under ZeRO-3 the trainer's reference model (deepspeed.initialize without optimizer) holds the same flat ranges
    # as the policy, equal to the base on disk, and fingerprints as the checkpoint does (heads all-reduced across
    # partitions); the other jobs hold no reference model
    expected = True if job["mode"] == "zero3" else None
    assert [rank["reference_equal"] for rank in job["ranks"]] == [expected] * WORLD
    disk = fingerprint_checkpoint(job["base_dir"]).sha256
    for rank in job["ranks"]:
        assert rank["fingerprints"]["disk"] == disk
        if job["mode"] == "zero3":
            assert rank["fingerprints"]["reference"] == disk
            assert rank["calls"]["reference_measure_all_reduces"] == 7
