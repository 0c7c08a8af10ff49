"""Figures of a sparsity analysis from ``analysis.json`` (PNG, matplotlib's Agg renderer; no global pyplot state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 120
ANNOTATE_CELLS = 240  #: Heatmaps with at most this many cells get their values written in.


def _figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _names(result: dict[str, Any]) -> list[str]:
    return [a["name"] for a in result["agents"]]


def plot_density(result: dict[str, Any], path: Path) -> None:
    """Per-agent density bars: at eps, at exact equality of the stored values, and in the bf16 view if measured."""
    names = _names(result)
    series = [("|tau| > eps", "density"), ("stored values differ", "density_exact")]
    if any(a["density_bf16"] is not None for a in result["agents"]):
        series.append(("bf16 view, |tau| > eps", "density_bf16"))
    figure = _figure(max(5.0, 1.3 * len(names) + 2), 3.8)
    axes = figure.subplots()
    width = 0.8 / len(series)
    for s, (label, key) in enumerate(series):
        values = [100 * (a[key] or 0.0) for a in result["agents"]]
        positions = [i + (s - (len(series) - 1) / 2) * width for i in range(len(names))]
        bars = axes.bar(positions, values, width, label=label)
        axes.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    axes.set_xticks(range(len(names)), names, rotation=20 if len(names) > 4 else 0)
    axes.set_ylabel("density (% of elements)")
    axes.set_title(f"Task-vector density (eps = {result['parameters']['eps']:g})")
    axes.legend(fontsize=8)
    figure.savefig(path)


def plot_overlap(result: dict[str, Any], path: Path) -> None:
    """Stacked bars (RAM paper, fig. 2 right): each agent's active elements by how many others also update them."""
    names = _names(result)
    n = len(names)
    figure = _figure(max(5.0, 1.1 * n + 2.5), 3.8)
    axes = figure.subplots()
    cmap = colormaps["viridis"]
    bottoms = [0.0] * n
    for k in range(n):
        shares = [100 * a["overlap_shares"][k] for a in result["agents"]]
        label = "unique (no other agent)" if k == 0 else f"shared with {k} other{'s' if k > 1 else ''}"
        axes.bar(range(n), shares, 0.6, bottom=bottoms, label=label, color=cmap(k / max(n - 1, 1)))
        bottoms = [b + s for b, s in zip(bottoms, shares, strict=True)]
    axes.set_xticks(range(n), names, rotation=20 if n > 4 else 0)
    axes.set_ylim(0, 100)
    axes.set_ylabel("share of the agent's active elements (%)")
    axes.set_title("Overlap of active elements")
    axes.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.savefig(path)


def plot_anatomy(result: dict[str, Any], path: Path) -> None:
    """Density by decoder layer and module type, one heatmap per agent (module-type bars if there are no layers)."""
    names = _names(result)
    layers = result["anatomy"]["layers"]
    if not layers:
        modules = result["anatomy"]["modules"]
        figure = _figure(max(5.0, 0.9 * len(modules) + 2), 3.8)
        axes = figure.subplots()
        width = 0.8 / len(names)
        for t, name in enumerate(names):
            positions = [i + (t - (len(names) - 1) / 2) * width for i in range(len(modules))]
            axes.bar(positions, [100 * m["density"][t] for m in modules], width, label=name)
        axes.set_xticks(range(len(modules)), [m["module"] for m in modules], rotation=30)
        axes.set_ylabel("density (%)")
        axes.set_title("Density by module type")
        axes.legend(fontsize=8)
        figure.savefig(path)
        return
    module_names = list(dict.fromkeys(k for layer in layers for k in layer["modules"]))
    columns = min(len(names), 3)
    rows = -(-len(names) // columns)
    width = max(4.5, 0.45 * len(layers) + 3.0)
    figure = _figure(width * columns, max(2.5, 0.3 * len(module_names) + 1.3) * rows)
    grid = figure.subplots(rows, columns, squeeze=False)
    annotate = len(layers) * len(module_names) <= ANNOTATE_CELLS
    for t, name in enumerate(names):
        axes = grid[t // columns][t % columns]
        data = [
            [100 * layer["modules"][m][t] if m in layer["modules"] else float("nan") for layer in layers]
            for m in module_names
        ]
        # each agent on its own scale: the figure shows where an agent's updates concentrate
        image = axes.imshow(data, aspect="auto", cmap="magma", vmin=0.0)
        figure.colorbar(image, ax=axes, label="density (%)", shrink=0.9)
        if annotate:
            high = 0.6 * (max((v for row in data for v in row if v == v), default=0.0))
            for i, row in enumerate(data):
                for j, value in enumerate(row):
                    if value == value:  # not NaN
                        color = "black" if value > high else "white"
                        axes.text(j, i, f"{value:.2g}", ha="center", va="center", fontsize=6, color=color)
        axes.set_title(name, fontsize=9)
        axes.set_xticks(range(len(layers)), [str(layer["layer"]) for layer in layers], fontsize=7)
        axes.set_yticks(range(len(module_names)), module_names, fontsize=7)
        axes.set_xlabel("layer", fontsize=8)
    for t in range(len(names), rows * columns):
        grid[t // columns][t % columns].set_axis_off()
    figure.suptitle("Density by decoder layer and module type (% of elements)")
    figure.savefig(path)


def plot_magnitudes(result: dict[str, Any], path: Path) -> None:
    """Histogram of |tau| of the active elements on a log scale (4 bins per octave), one line per agent."""
    histogram = result["magnitude_histogram"]
    edges = histogram["edges"]
    figure = _figure(6.5, 3.8)
    axes = figure.subplots()
    for a, counts in zip(result["agents"], histogram["counts"], strict=True):
        total = sum(counts)
        if not edges or total == 0:
            continue
        shares = [100 * c / total for c in counts]
        axes.stairs(shares, edges, label=a["name"], linewidth=1.5)
    axes.set_xscale("log")
    axes.axvline(result["parameters"]["eps"], color="grey", linestyle="--", linewidth=1, label="eps")
    axes.set_xlabel("|tau| (active elements)")
    axes.set_ylabel("share of active elements per bin (%)")
    axes.set_title("Magnitudes of the active deltas")
    axes.legend(fontsize=8)
    if any(d in ("bfloat16", "float16") for a in result["agents"] for d in a.get("dtypes") or []):
        figure.text(
            0.01,
            0.0,
            "Comb-shaped in bf16/fp16: a stored delta is the difference of two rounded weights, so |tau| takes few "
            "distinct values per octave\nand some bins stay empty (rounding, not training).",
            fontsize=6,
            va="bottom",
        )
    figure.savefig(path)


#: File name and drawing function of every figure, in report order.
FIGURES = {
    "density.png": plot_density,
    "overlap.png": plot_overlap,
    "anatomy.png": plot_anatomy,
    "magnitude.png": plot_magnitudes,
}


def write_figures(result: dict[str, Any], out_dir: Path) -> list[str]:
    """Draw every figure into ``out_dir``."""
    for name, draw in FIGURES.items():
        draw(result, out_dir / name)
    return list(FIGURES)
