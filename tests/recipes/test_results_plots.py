"""The charts of a run's results (ram_trl/recipes/results_plots.py): written as PNG files, and no retention chart
(no file) when no merge has a retention."""

from __future__ import annotations

from ram_trl.recipes.results_plots import plot_preview, plot_retention, plot_scores
from ram_trl.recipes.selection import add_statistics
from tests.recipes.results_rows import hand_made

PNG = b"\x89PNG\r\n\x1a\n"


def test_scores_and_retention_charts(tmp_path):
    results = add_statistics(hand_made())
    plot_scores(results, tmp_path / "scores.png")
    assert plot_retention(results, tmp_path / "retention.png") is True
    for name in ("scores.png", "retention.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    assert sorted(p.name for p in tmp_path.iterdir()) == ["retention.png", "scores.png"]  # no temporary left


def test_no_retention_chart_without_retention(tmp_path):
    results = hand_made()
    results["rows"] = [r for r in results["rows"] if r["kind"] != "merge"]
    add_statistics(results)
    assert plot_retention(results, tmp_path / "retention.png") is False
    assert not (tmp_path / "retention.png").exists()


def test_preview_chart(tmp_path):
    record = {
        "method": "ram_plus",
        "kept_step": 2,
        "history": [
            {"step": 1, "average": 0.2, "agent_score": 0.3, "reward": 0.1},
            {"step": 2, "average": 0.4, "agent_score": 0.35, "reward": 0.2},
        ],
    }
    plot_preview("tools", record, tmp_path / "preview-tools.png")
    assert (tmp_path / "preview-tools.png").read_bytes()[:8] == PNG
