"""Writing a run's results (ram_trl/recipes/results.py): results.json, results.md and the charts, committed
atomically; and every public name of the results modules still importable from ram_trl.recipes.results."""

from __future__ import annotations

import copy
import json
import math

import pytest

from ram_trl.recipes.results import write_results
from tests.recipes.results_rows import hand_made


def test_write_results_files(tmp_path):
    data = hand_made()
    data["regime"]["B"]["rho"] = None
    written = write_results(copy.deepcopy(data), tmp_path)
    assert sorted(p.name for p in written) == ["results.json", "results.md", "retention.png", "scores.png"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["average"] for r in saved["rows"]] == pytest.approx([0.25, 0.5, 0.625, 0.625, 0.875])
    assert [r["val"]["average"] for r in saved["rows"]] == pytest.approx([0.25, 0.5, 0.625, 0.75, 0.5])
    assert saved["selection"]["ship"] == "m1" and saved["verdict"].startswith("Ship m1")
    assert saved["rows"][3]["retention"]["mean"] == pytest.approx(7 / 12)
    assert all(len(r["interval"]["average"]) == 2 for r in saved["rows"])
    for figure in ("scores.png", "retention.png"):
        assert (tmp_path / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "results.md").read_text()
    assert "![scores](scores.png)" in md and "![retention](retention.png)" in md
    assert not list(tmp_path.glob(".*"))
    assert not math.isnan(saved["rows"][0]["interval"]["a"][0])


def test_nothing_scored_still_states_the_regime(tmp_path):
    results = {"recipe": "merge-only", "stages": [], "rows": [], "regime": hand_made()["regime"]}
    write_results(results, tmp_path)
    assert results["selection"]["ship"] is None
    assert results["verdict"].startswith("Nothing was scored (evaluation is off")
    assert "density 62-71%" in (tmp_path / "results.md").read_text()
