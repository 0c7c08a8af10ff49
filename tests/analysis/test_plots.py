"""ram_trl/analysis/plots.py: the analysis figures drawn from a hand-made result into real PNG files (the figures of a real
analysis are checked in tests/test_analysis.py)."""

from __future__ import annotations

import numpy as np
from matplotlib.image import imread

from ram_trl.analysis.plots import DPI, FIGURES, write_figures


def _result(layers: bool) -> dict:
    agents = [
        {"name": "coding", "density": 0.1, "density_exact": 0.2, "density_bf16": None, "overlap_shares": [0.7, 0.3]},
        {"name": "tools", "density": 0.05, "density_exact": 0.05, "density_bf16": 0.04, "overlap_shares": [0.4, 0.6]},
    ]
    modules = [{"module": "q_proj", "density": [0.1, 0.02]}, {"module": "mlp", "density": [0.0, 0.3]}]
    layer_rows = [
        {"layer": 0, "modules": {"q_proj": [0.1, 0.0], "mlp": [0.2, 0.3]}},
        {"layer": 1, "modules": {"q_proj": [0.05, 0.01]}},  # no mlp in layer 1: a NaN cell
    ]
    return {
        "agents": agents,
        "parameters": {"eps": 1e-5},
        "anatomy": {"modules": modules, "layers": layer_rows if layers else []},
        "magnitude_histogram": {"edges": [1e-5, 1e-4, 1e-3], "counts": [[3, 1], [0, 0]]},
    }


def test_every_figure_is_a_png_of_the_planned_size(tmp_path):
    written = write_figures(_result(layers=True), tmp_path)
    assert written == list(FIGURES) == ["density.png", "overlap.png", "anatomy.png", "magnitude.png"]
    sizes = {}
    for name in written:
        image = imread(tmp_path / name)
        sizes[name] = image.shape[:2]
        assert np.ptp(image[..., :3]) > 0.5, f"{name} is blank"
    # figsize x DPI: density max(5, 1.3 * 2 + 2) x 3.8 in; overlap max(5, 1.1 * 2 + 2.5) x 3.8 in; magnitude 6.5 x 3.8
    assert sizes["density.png"] == (round(3.8 * DPI), 5 * DPI)
    assert sizes["overlap.png"] == (round(3.8 * DPI), 5 * DPI)
    assert sizes["magnitude.png"] == (round(3.8 * DPI), round(6.5 * DPI))
    # anatomy: two heatmaps side by side, each max(4.5, 0.45 * 2 + 3) wide
    assert sizes["anatomy.png"][1] == 2 * round(4.5 * DPI)


def test_anatomy_without_layers_draws_module_bars(tmp_path):
    write_figures(_result(layers=False), tmp_path)
    # max(5, 0.9 * 2 modules + 2) x 3.8 in
    assert imread(tmp_path / "anatomy.png").shape[:2] == (round(3.8 * DPI), 5 * DPI)


def test_the_magnitude_histogram_explains_its_comb_in_bf16(tmp_path, monkeypatch):
    from ram_trl.analysis import plots

    figures = []
    original = plots._figure

    def capture(*args):
        figures.append(original(*args))
        return figures[-1]

    monkeypatch.setattr(plots, "_figure", capture)
    result = _result(layers=False)
    plots.plot_magnitudes(result, tmp_path / "float32.png")
    for agent in result["agents"]:
        agent["dtypes"] = ["bfloat16"]
    plots.plot_magnitudes(result, tmp_path / "bf16.png")
    captions = [[t.get_text() for t in figure.texts] for figure in figures]
    assert captions[0] == []
    assert len(captions[1]) == 1 and captions[1][0].startswith("Comb-shaped in bf16/fp16")
