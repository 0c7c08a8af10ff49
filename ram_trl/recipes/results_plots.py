"""The charts of a recipe run's results (PNG, matplotlib's Agg renderer; no global pyplot state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ram_trl.output import atomic_file
from ram_trl.recipes.selection import row_average

__all__ = ["plot_preview", "plot_retention", "plot_scores", "plot_training", "scores_figure"]


def plot_scores(results: dict[str, Any], path: Path) -> None:
    """Grouped bars of the test scores with 95% intervals: one group per stage and the average."""
    _save_figure(scores_figure(results), path)


def scores_figure(results: dict[str, Any]) -> Any:
    """The figure of :func:`plot_scores`: the shipped merge outlined; a zero score drawn as a short line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    stages = results["stages"]
    rows = results["rows"]
    columns = [*stages, "average"]
    width = 0.8 / max(len(rows), 1)
    figure = Figure(figsize=(min(13.0, 4.0 + 0.12 * len(rows) * len(columns)), 4.8), dpi=110)
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    ship = (results.get("selection") or {}).get("ship")
    for i, row in enumerate(rows):
        values = [row["scores"].get(s) for s in stages] + [row.get("average", row_average(row, stages))]
        intervals = [(row.get("interval") or {}).get(c) for c in columns]
        heights = [v if v is not None else 0.0 for v in values]
        errors = [
            [max(0.0, h - iv[0]) if iv else 0.0 for h, iv in zip(heights, intervals, strict=True)],
            [max(0.0, iv[1] - h) if iv else 0.0 for h, iv in zip(heights, intervals, strict=True)],
        ]
        xs = [c + (i - (len(rows) - 1) / 2) * width for c in range(len(columns))]
        color = "#7f7f7f" if row["kind"] == "base" else cmap(i % 20)
        shipped = row["name"] == ship
        ax.bar(
            xs,
            heights,
            width,
            yerr=errors,
            capsize=1.5,
            error_kw={"elinewidth": 0.8},
            label=row["name"] + (" (ship)" if row["name"] == ship else ""),
            color=color,
            hatch="//" if row["kind"] == "merge" else None,
            edgecolor="black" if shipped else "white",
            linewidth=1.5 if shipped else 0.5,
        )
        for x, value in zip(xs, values, strict=True):
            if value is not None and value == 0:  # visible: a short thick line on the axis
                ax.hlines(0, x - width / 2, x + width / 2, colors=[color], linewidth=3, zorder=3)
        if shipped:
            top = heights[-1] + errors[1][-1]
            ax.text(xs[-1], top + 0.02, "ship", ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xticks(range(len(columns)), columns)
    ax.set_ylabel("test score (95% interval)")
    ax.set_title(f"{results.get('recipe', 'recipe')}: test score per model per stage (merges hatched)")
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    return figure


def _save_figure(figure: Any, path: Path) -> None:
    """Save a matplotlib figure atomically (a temporary sibling file, then rename)."""
    with atomic_file(path, "figure") as tmp:
        figure.savefig(tmp, format=path.suffix.lstrip(".") or "png")


def plot_retention(results: dict[str, Any], path: Path) -> bool:
    """Heat map of test retention: a row per merge, a column per vertical and the mean; undefined cells grey."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    stages = results["stages"]
    merges = [r for r in results["rows"] if r["kind"] == "merge" and r.get("retention")]
    if not merges:
        return False
    columns = [*stages, "mean"]
    data = np.array(
        [
            [
                np.nan
                if (v := (r["retention"]["per_stage"].get(c) if c != "mean" else r["retention"]["mean"])) is None
                else v
                for c in columns
            ]
            for r in merges
        ],
        dtype=np.float64,
    )
    figure = Figure(figsize=(max(4.5, 1.1 * len(columns) + 3), max(2.5, 0.35 * len(merges) + 1.5)), dpi=110)
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    image = ax.imshow(np.ma.masked_invalid(data), cmap="RdYlGn", vmin=-0.5, vmax=1.5, aspect="auto")
    ax.set_facecolor("#d9d9d9")
    figure.colorbar(image, ax=ax, label="retention (1 = the specialist's gain)")
    ship = (results.get("selection") or {}).get("ship")
    for i, row in enumerate(data):
        for j, value in enumerate(row):
            ax.text(j, i, "n/a" if np.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(merges)), [r["name"] + (" (ship)" if r["name"] == ship else "") for r in merges])
    ax.set_title("Retention on test: (merge - base) / (specialist - base)", fontsize=9)
    figure.tight_layout()
    _save_figure(figure, path)
    return True


def plot_preview(stage: str, record: dict[str, Any], path: Path) -> None:
    """One stage's merge preview over training (merged and own validation, training reward), kept step marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    history = record["history"]
    steps = [h["step"] for h in history]
    figure = Figure(figsize=(6.4, 3.8), dpi=110)
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    ax.plot(steps, [h["average"] for h in history], "o-", label="merge: val average over the merged stages")
    ax.plot(steps, [h["agent_score"] for h in history], "s--", label=f"agent alone: val score on {stage}")
    ax.axvline(record["kept_step"], color="#2ca02c", linestyle=":", label=f"kept: step {record['kept_step']}")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation score")
    handles, labels = ax.get_legend_handles_labels()
    rewards = [(h["step"], h["reward"]) for h in history if h.get("reward") is not None]
    if rewards:
        twin = ax.twinx()
        twin.plot(*zip(*rewards, strict=True), "^:", color="#7f7f7f", label="agent: training reward (last logged)")
        twin.set_ylabel("training reward")
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize=7, loc="best")
    ax.set_title(f"{stage}: merge preview ({record.get('method', '')}) vs step", fontsize=9)
    figure.tight_layout()
    figure.savefig(path)


def plot_training(training: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Each stage's task-vector density per telemetry measurement (left) and the batch reward (right)."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10.0, 3.8), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    density_axes, reward_axes = figure.subplots(1, 2)
    cmap = colormaps["tab10"]
    for index, (stage, curve) in enumerate(training.items()):
        color = cmap(index % 10)
        for key, style, label in (("density_saved", "-o", "saved dtype"), ("density", "--x", "|tau| > eps")):
            points = [(p["step"], 100 * p[key]) for p in curve if p.get(key) is not None]
            if points:
                steps, values = zip(*points, strict=True)
                density_axes.plot(steps, values, style, color=color, markersize=3, label=f"{stage} ({label})")
        points = [(p["step"], p["reward"]) for p in curve if p.get("reward") is not None]
        if points:
            steps, values = zip(*points, strict=True)
            reward_axes.plot(steps, values, "-", color=color, marker=".", label=stage)
    density_axes.set_xlabel("training step")
    density_axes.set_ylabel("density (% of elements)")
    density_axes.set_title("Task-vector density during training")
    density_axes.legend(fontsize=7, handlelength=4)  # long enough to tell solid from dashed
    reward_axes.set_xlabel("training step")
    reward_axes.set_ylabel("batch reward (logged)")
    reward_axes.set_title("Reward at the measurements")
    if reward_axes.lines:
        reward_axes.legend(fontsize=7)
    _save_figure(figure, path)
