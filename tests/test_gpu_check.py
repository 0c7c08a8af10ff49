"""``benchmarks/gpu_check.py --smoke`` runs its code paths on the CPU, so the GPU check cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_row(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    telemetry = rows["telemetry (train-step proxy, bf16)"]
    assert 0 < telemetry["density"] <= 1 and telemetry["measure_s"] > 0 and telemetry["overhead_pct"] > 0
    for method in ("ram_plus", "ties"):
        assert rows[f"merge {method} --device cpu"]["byte_identical_to_cpu"] is True
    assert "gpu_check on CPU only (smoke)" in done.stdout
