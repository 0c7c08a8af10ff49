"""The results of a recipe run: ``results.json``, ``results.md`` (a table like the RAM paper's Table 1), PNG charts
and a rich table in the terminal.

``results.json`` holds ``stages`` (column order), ``rows`` (one per evaluated model: ``name``, ``kind`` of
``base``/``agent``/``merge``, ``method``, ``parameters``, ``scores`` by stage) and optionally ``regime`` (per
agent, from the sparsity analysis: ``density``, ``unique_share``, ``rho``, ``lambda``) and ``eps``. Averages are
computed here, over the stages a row has a score for.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "best_merged",
    "markdown",
    "plot_scores",
    "print_table",
    "regime_from_analysis",
    "row_average",
    "write_results",
]


def row_average(row: dict[str, Any], stages: list[str]) -> float | None:
    """Mean of a row's scores over ``stages`` it has a score for (``None`` if none)."""
    values = [row["scores"][s] for s in stages if row["scores"].get(s) is not None]
    return sum(values) / len(values) if values else None


def best_merged(results: dict[str, Any]) -> dict[str, float]:
    """Per column (each stage, and ``"average"``), the best score among the merges (rounded to the 3 decimals
    shown, so equal printed values are all marked)."""
    stages = results["stages"]
    best: dict[str, float] = {}
    for row in results["rows"]:
        if row["kind"] != "merge":
            continue
        values = {s: row["scores"].get(s) for s in stages} | {"average": row_average(row, stages)}
        for column, value in values.items():
            if value is not None and round(value, 3) > best.get(column, float("-inf")):
                best[column] = round(value, 3)
    return best


def regime_from_analysis(analysis: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per agent name, the task vector's regime from ``analysis.json``: density, unique share of its active
    elements, rho_t and RAM+'s lambda_t."""
    regime = {}
    for agent in analysis.get("agents", []):
        active = agent.get("active") or 0
        rho = agent.get("rho")
        regime[agent["name"]] = {
            "density": agent.get("density"),
            "unique_share": (agent.get("unique", 0) / active) if active else None,
            "rho": float(rho) if rho is not None else None,
            "lambda": (agent.get("lambda") or {}).get("ram_plus"),
        }
    return regime


def _cell(value: float | None, bold: bool = False, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    text = format(value, spec)
    return f"**{text}**" if bold else text


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _rho(value: float | str | None) -> str:
    if value is None:
        return "-"
    value = float(value)
    return "inf" if value == float("inf") else f"{value:.3g}"


def markdown(results: dict[str, Any]) -> str:
    """``results.md``: the score table (best merged value per column in bold) and the agents' regime."""
    stages = results["stages"]
    regime = results.get("regime") or {}
    best = best_merged(results)
    title = results.get("recipe", "recipe")
    lines = [f"# Results: {title}", ""]
    if results.get("description"):
        lines += [results["description"].strip(), ""]
    lines += [
        "Held-out score per stage (mean over its prompts of the sum of that stage's rewards; "
        f"{results.get('decoding', 'greedy decoding')}). Best merged value per column in **bold**. "
        "density / unique / rho: the agent's task vector at eps = "
        f"{results.get('eps', 1e-5):g} (unique = share of its active elements no other agent changes; "
        "rho = shared / unique, RAM+'s rescaling signal).",
        "",
    ]
    header = ["model", "kind", *stages, "average", "density", "unique", "rho"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---", "---"] + ["---:"] * (len(header) - 2)) + "|")
    for row in results["rows"]:
        merge = row["kind"] == "merge"
        average = row_average(row, stages)
        cells = [
            _cell(
                row["scores"].get(s),
                merge and row["scores"].get(s) is not None and round(row["scores"][s], 3) == best.get(s),
            )
            for s in stages
        ]
        cells.append(
            _cell(average, merge and average is not None and round(average, 3) == best.get("average"))
        )
        info = regime.get(row["name"]) if row["kind"] == "agent" else None
        cells += (
            [_pct(info["density"]), _pct(info["unique_share"]), _rho(info["rho"])] if info else ["", "", ""]
        )
        lines.append("| " + " | ".join([row["name"], row["kind"], *cells]) + " |")
    lines.append("")
    if results.get("notes"):
        lines += ["Notes:", ""] + [f"- {note}" for note in results["notes"]] + [""]
    if results.get("figures"):
        lines += [f"![{Path(f).stem}]({f})" for f in results["figures"]] + [""]
    return "\n".join(lines)


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot_scores(results: dict[str, Any], path: Path) -> None:
    """Grouped bars: one group per stage (and the average), one bar per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = results["stages"]
    rows = results["rows"]
    columns = [*stages, "average"]
    width = 0.8 / max(len(rows), 1)
    fig, ax = plt.subplots(figsize=(min(13.0, 4.0 + 0.12 * len(rows) * len(columns)), 4.8))
    colors = {"base": "#7f7f7f", "agent": "#1f77b4", "merge": "#d62728"}
    cmap = plt.get_cmap("tab20")
    for i, row in enumerate(rows):
        values = [row["scores"].get(s) for s in stages] + [row_average(row, stages)]
        xs = [c + (i - (len(rows) - 1) / 2) * width for c in range(len(columns))]
        color = colors["base"] if row["kind"] == "base" else cmap(i % 20)
        hatch = "//" if row["kind"] == "merge" else None
        ax.bar(
            xs,
            [v if v is not None else 0.0 for v in values],
            width,
            label=row["name"],
            color=color,
            hatch=hatch,
            edgecolor="white",
        )
    ax.set_xticks(range(len(columns)), columns)
    ax.set_ylabel("held-out score")
    ax.set_title(f"{results.get('recipe', 'recipe')}: score per model per stage (merges hatched)")
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(results: dict[str, Any], out_dir: Path, figures: bool = True) -> list[Path]:
    """Write ``results.json``, ``scores.png`` (unless ``figures`` is off) and ``results.md`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if figures and results["rows"]:
        plot_scores(results, out_dir / "scores.png")
        results.setdefault("figures", [])
        if "scores.png" not in results["figures"]:
            results["figures"].insert(0, "scores.png")
        written.append(out_dir / "scores.png")
    for row in results["rows"]:
        row["average"] = row_average(row, results["stages"])
    from ram_trl.analysis import clean

    _atomic_write(out_dir / "results.json", json.dumps(clean(results), indent=2, sort_keys=False) + "\n")
    _atomic_write(out_dir / "results.md", markdown(results))
    return [out_dir / "results.json", out_dir / "results.md", *written]


def print_table(results: dict[str, Any]) -> None:
    """The score table in the terminal (rich)."""
    from rich.console import Console
    from rich.table import Table

    stages = results["stages"]
    best = best_merged(results)
    regime = results.get("regime") or {}
    table = Table(title=f"{results.get('recipe', 'recipe')}: held-out scores")
    for column in ("model", "kind", *stages, "average", "density", "unique", "rho"):
        table.add_column(
            column,
            justify="left" if column in ("model", "kind") else "right",
            no_wrap=column == "model",
            min_width=len(column),
        )
    for row in results["rows"]:
        merge = row["kind"] == "merge"
        average = row_average(row, stages)
        cells = []
        for key, value in [*((s, row["scores"].get(s)) for s in stages), ("average", average)]:
            text = _cell(value)
            cells.append(
                f"[bold green]{text}[/]"
                if merge and value is not None and round(value, 3) == best.get(key)
                else text
            )
        info = regime.get(row["name"]) if row["kind"] == "agent" else None
        cells += (
            [_pct(info["density"]), _pct(info["unique_share"]), _rho(info["rho"])] if info else ["", "", ""]
        )
        table.add_row(row["name"], row["kind"], *cells)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 160)
    console.print(table)
