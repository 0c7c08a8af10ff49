"""The DeepSpeed adapter's contract on a real ZeRO-3 engine (2 CPU processes, gloo) of the installed DeepSpeed, and
transformers' DeepSpeed config put back as the same object after a one-process load."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path

import pytest

from ram_trl.callbacks.deepspeed_adapter import TESTED_VERSIONS, zero3_loading_off
from tests._launch import free_port, run_job

WORKER = Path(__file__).with_name("_deepspeed_adapter_job.py")


def test_the_installed_deepspeed_is_a_tested_version():
    pytest.importorskip("deepspeed")
    installed = importlib.metadata.version("deepspeed")
    assert ".".join(installed.split(".")[:2]) in TESTED_VERSIONS, f"DeepSpeed {installed}: run the tests below"


@pytest.mark.slow
@pytest.mark.distributed
def test_partitions_release_and_regather_of_a_real_zero3_engine(tmp_path):
    pytest.importorskip("deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    port = free_port()
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port)]
    command += [str(WORKER)]
    result = run_job(command, port, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    # one file per rank (two ranks printing to the launcher's one pipe can interleave within a line)
    ranks = [json.loads((tmp_path / f"result_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [out["rank"] for out in ranks] == [0, 1]
    full = {"0.weight": (15, [3, 5], 0), "0.bias": (3, [3], 100), "1.weight": (3, [1, 3], 200)}
    for out in ranks:
        assert (out["engine"], out["module"], out["plain"], out["release"]) == (True, False, False, True)
        assert out["released"] == dict.fromkeys(full, 0)  # every gathered parameter released
        # the persistent ones (at most 4 elements) are whole again, the others stay released
        assert out["regathered"] == {
            "0.weight": [],
            "0.bias": [100.0, 101.0, 102.0],
            "1.weight": [200.0, 201.0, 202.0],
        }
    for name, (numel, shape, start) in full.items():
        seen = [out["params"][name] for out in ranks]
        for part in seen:
            assert part["partitioned"] and not part["quantized"] and part["group"] == 2
            assert (part["numel"], part["shape"], part["size"]) == (numel, shape, -(-numel // 2))
            assert len(part["values"]) == part["size"]
        tiled = seen[0]["values"] + seen[1]["values"]  # rank order; the last partition is padded
        assert tiled[:numel] == [float(start + i) for i in range(numel)]


def test_transformers_deepspeed_config_is_put_back_as_the_same_object():
    pytest.importorskip("deepspeed")
    from transformers.integrations.deepspeed import (
        HfDeepSpeedConfig,
        deepspeed_config,
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    class Arguments:
        hf_deepspeed_config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_batch_size": 1})

    held = Arguments.hf_deepspeed_config
    try:
        assert deepspeed_config() is held.config and is_deepspeed_zero3_enabled()
        with zero3_loading_off([Arguments(), None]):
            assert deepspeed_config() is None and not is_deepspeed_zero3_enabled()
        assert deepspeed_config() is held.config and is_deepspeed_zero3_enabled()
        with pytest.raises(RuntimeError, match="cannot load"), zero3_loading_off([None]):
            pass
        assert deepspeed_config() is held.config  # refused before anything changed
    finally:
        unset_hf_deepspeed_config()
