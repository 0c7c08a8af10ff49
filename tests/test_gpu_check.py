"""``benchmarks/gpu_check.py --smoke`` runs every row's code path on the CPU, so the GPU check cannot rot between GPU
runs: the real GRPO runs with the telemetry callback and the merge preview, the merges against the CPU merge, the read
floors and mergekit, and one ``ram-trl run`` stage; every row's check must hold."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check(out: Path, *options: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *options, "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_row(tmp_path):
    out = tmp_path / "rows.json"
    done = _gpu_check(out, "--smoke")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gpu_check on CPU only (smoke)" in done.stdout
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r.get("check") is not False for r in rows.values()), rows
    telemetry = rows["GRPO + telemetry callback"]
    assert telemetry["check"] is True and telemetry["device"] == "cpu"
    assert telemetry["density_logged"] == telemetry["density_saved_agent"]
    assert 0 < telemetry["density_logged"] <= 1
    assert telemetry["measured_steps"] == [2, 3]  # every logging_steps (2) and the last step
    assert telemetry["measure_s"] > 0 and telemetry["step_s"] > 0 and telemetry["overhead_pct"] > 0
    preview = rows["GRPO + merge preview (1 prior)"]
    assert preview["check"] is True and preview["previews"] == 2
    assert preview["preview_s"] >= preview["merge_s"] > 0
    mergekit = importlib.util.find_spec("mergekit") is not None
    for method, theirs in (("ram_plus", "ram"), ("ties", "ties")):
        merged = rows[f"merge {method} --device cpu"]
        assert merged["byte_identical_to_cpu"] is True and merged["check"] is True
        assert merged["seconds"] > 0 and merged["read_floor_s"] > 0
        if mergekit:
            assert merged[f"mergekit_{theirs}_s"] > 0
        else:
            assert "mergekit not importable" in merged["note"]
        (cpu,) = [r for name, r in rows.items() if name.startswith(f"merge {method} on the CPU (")]
        assert cpu["seconds"] > 0 and cpu["read_floor_s"] > 0
    run = rows["ram-trl run (one stage)"]
    assert run["check"] is True and run["steps"] == 3 and 0 <= run["density_saved"] <= 1


@pytest.mark.slow
@pytest.mark.cuda
def test_gpu_check_on_cuda(tmp_path):
    """The real check on a GPU machine (minutes): every row runs on CUDA and every check holds."""
    out = tmp_path / "rows.json"
    done = _gpu_check(out, "--repeats", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["GRPO + telemetry callback"]["device"] == "cuda:0"
    assert rows["merge ram_plus --device cuda"]["byte_identical_to_cpu"] is True
    assert rows["merge ram_plus --device cuda"]["input_cache"]["taken_chunks"] > 0  # one read of the inputs
    assert rows["merge ties --device cuda"]["byte_identical_to_cpu"] is True
    assert rows["ram-trl run (one stage)"]["check"] is True
