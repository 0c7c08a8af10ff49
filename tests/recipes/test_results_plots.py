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


def test_the_scores_chart_marks_the_shipped_merge_on_its_bars_and_shows_zero_scores():
    from ram_trl.recipes.results_plots import scores_figure

    results = add_statistics(hand_made())
    results["rows"][0]["scores"]["a"] = 0.0  # the base scores 0 on a: a bar of height 0
    ax = scores_figure(results).axes[0]
    assert [t.get_text() for t in ax.texts] == ["ship"]  # above the shipped merge's bars, not only in the legend
    ship = results["selection"]["ship"]
    index = [r["name"] for r in results["rows"]].index(ship)
    bars = [c for c in ax.containers if hasattr(c, "patches")]
    outlined = {i for i, c in enumerate(bars) if all(p.get_linewidth() == 1.5 for p in c.patches)}
    assert outlined == {index}
    zero_lines = [c for c in ax.collections if c.__class__.__name__ == "LineCollection" and c.get_linewidth()[0] == 3]
    assert len(zero_lines) == 1  # the one zero score is drawn


def test_the_training_chart_legend_tells_solid_from_dashed(tmp_path):
    from unittest import mock

    from matplotlib.figure import Figure

    from ram_trl.recipes.results_plots import plot_training

    curve = [{"step": s, "density": 0.5, "density_saved": 0.4, "reward": 1.0} for s in (1, 2)]
    captured = []
    original = Figure.subplots

    def subplots(*args, **kwargs):
        captured.append(original(*args, **kwargs))
        return captured[-1]

    with mock.patch.object(Figure, "subplots", autospec=True, side_effect=subplots):
        plot_training({"coding": curve}, tmp_path / "training.png")
    legend = captured[0][0].get_legend()
    assert legend.handlelength >= 3.5
    styles = {line.get_label(): (line.get_linestyle(), line.get_marker()) for line in captured[0][0].lines}
    assert styles["coding (saved dtype)"] != styles["coding (|tau| > eps)"]
    assert len({marker for _, marker in styles.values()}) == 2  # told apart by the marker too
