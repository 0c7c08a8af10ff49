"""A recipe run's results: results.json, results.md, PNG charts, the terminal table (docs/recipes-results.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ram_trl.output import atomic_file
from ram_trl.recipes.mechanism import mechanism
from ram_trl.recipes.results_markdown import markdown
from ram_trl.recipes.results_plots import plot_preview, plot_retention, plot_scores, plot_training
from ram_trl.recipes.selection import add_statistics

__all__ = ["write_results"]


def _atomic_write(path: Path, text: str) -> None:
    with atomic_file(path, "results file") as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_results(results: dict[str, Any], out_dir: Path, figures: bool = True) -> list[Path]:
    """Add the statistics and write ``results.json``, the charts (unless ``figures`` is off) and ``results.md``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    add_statistics(results)
    results["mechanism"] = mechanism(results)
    written = []
    if figures and results["rows"]:
        results.setdefault("figures", [])
        plot_scores(results, out_dir / "scores.png")
        written.append(out_dir / "scores.png")
        names = ["scores.png"]
        if plot_retention(results, out_dir / "retention.png"):
            written.append(out_dir / "retention.png")
            names.append("retention.png")
        for name in reversed(names):
            if name not in results["figures"]:
                results["figures"].insert(0, name)
    if figures and results.get("training"):
        plot_training(results["training"], out_dir / "training.png")
        results["training_figure"] = "training.png"
        written.append(out_dir / "training.png")
    for stage, record in (results.get("previews") or {}).items() if figures else ():
        if record.get("history"):
            name = f"preview-{stage}.png"
            plot_preview(stage, record, out_dir / name)
            record["figures"] = [name]
            written.append(out_dir / name)
    from ram_trl.analysis.result import clean

    _atomic_write(out_dir / "results.json", json.dumps(clean(results), indent=2, sort_keys=False) + "\n")
    _atomic_write(out_dir / "results.md", markdown(results))
    return [out_dir / "results.json", out_dir / "results.md", *written]
