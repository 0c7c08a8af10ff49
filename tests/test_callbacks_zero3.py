"""TaskVectorSparsityCallback in a real TRL GRPO run under DeepSpeed ZeRO-3, 2 CPU processes (gloo).

The DeepSpeed launcher (and ``accelerate launch --use_deepspeed --zero_stage 3``) starts tests/_grpo_zero3_worker.py
on 2 ranks; every parameter is a ZeRO-3 partition, every
measurement runs with gathering collectives patched to raise, and the numbers must equal ``ram-trl analyze`` of the
agent the callback saved at the end (the trainer gathers it then) exactly. Once with the base read from disk
(beta = 0), once with GRPO's reference model (beta > 0), which TRL partitions with ZeRO-3 like the policy.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[distributed]')")

from ram_trl.stage.manifest import check_base, fingerprint_checkpoint, read_manifest  # noqa: E402
from ram_trl.synthetic import make_base_checkpoint  # noqa: E402
from tests._launch import free_port, run_job  # noqa: E402
from tests.helpers import assert_telemetry_is_the_analysis, telemetry_entries  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = Path(__file__).with_name("_grpo_zero3_worker.py")
STEPS = 3
WORLD = 2


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_base_checkpoint(
        tmp_path_factory.mktemp("base") / "base", hidden_size=32, num_layers=2, intermediate_size=64
    )


@pytest.fixture(
    scope="module",
    params=[("deepspeed", 0.0), ("deepspeed", 0.04), ("accelerate", 0.0)],
    ids=["deepspeed-base-on-disk", "deepspeed-reference-model", "accelerate-launch"],
)
def run(request, base, tmp_path_factory) -> dict:
    launcher, beta = request.param
    out = tmp_path_factory.mktemp("grpo_zero3")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    port = free_port()
    if launcher == "deepspeed":
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(WORLD)]
        command += ["--master_port", str(port)]
    else:  # what users run: accelerate's DeepSpeed plugin, ZeRO stage 3
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(WORLD)]
        command += ["--num_machines", "1", "--use_deepspeed", "--zero_stage", "3", "--mixed_precision", "no"]
        command += ["--dynamo_backend", "no", "--main_process_port", str(port)]
    command += [str(WORKER), str(base), str(out), str(beta)]
    result = run_job(command, port, cwd=WORKER.parent, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"GRPO ZeRO-3 job failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    ranks = [json.loads((out / f"grpo_rank{r}.json").read_text()) for r in range(WORLD)]
    return {"beta": beta, "out": out, "ranks": ranks}


def test_every_measurement_ran_on_zero3_partitions_without_gathering(run) -> None:
    for rank in run["ranks"]:
        assert rank["world_size"] == WORLD
        calls = rank["calls"]
        assert calls["measurements"] == 2  # the logging step and the final step
        # all 27 parameters of the tiny Qwen2 model are partitions, at both measurements
        assert calls["partitioned"] == 2 * 27
        assert calls["all_reduce"] == 2 * 7  # counts only (see test_distributed_shards.py)
        if run["beta"] > 0:
            assert rank["base_source"] == "reference model"
            assert rank["reference_partitioned"] is True
        else:
            assert rank["base_source"].startswith("base checkpoint")
            assert rank["reference_partitioned"] is None


def test_metrics_are_logged_and_equal_on_both_ranks(run) -> None:
    first, second = run["ranks"]
    entries = telemetry_entries(first["log_history"])
    assert [e["step"] for e in entries] == [2, STEPS]
    assert entries[-1] == {**entries[-1], **first["last"]}
    for key, value in first["last"].items():
        if not key.endswith(("measure_seconds", "state_mb")):
            assert second["last"][key] == value, key


def test_last_measurement_equals_ram_trl_analyze_of_the_saved_agent(run, base) -> None:
    result = assert_telemetry_is_the_analysis(run["ranks"][0]["last"], base, run["out"])
    assert 0 < result["agents"][0]["density"] < 1
    manifest = read_manifest(run["out"])
    assert manifest.trainer == "GRPOTrainer" and manifest.steps == STEPS
    assert manifest.processes == WORLD  # the manifest says how many processes trained the agent
    assert manifest.base_fingerprint == fingerprint_checkpoint(base)
    check_base(manifest, run["out"], base)
    assert "deepspeed" in manifest.versions
