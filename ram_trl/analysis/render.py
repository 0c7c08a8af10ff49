"""The analysis as files and tables: ``analysis.json``, ``analysis.md``, the figures, and the terminal summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

JSON_FILE = "analysis.json"
MARKDOWN_FILE = "analysis.md"


def write_outputs(result: dict[str, Any], out_dir: Path, figures: bool = True) -> None:
    """Write ``analysis.json``, ``analysis.md`` and the PNG figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result["figures"] = []
    if figures:
        from ram_trl.analysis.plots import write_figures

        result["figures"] = write_figures(result, out_dir)
    (out_dir / JSON_FILE).write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / MARKDOWN_FILE).write_text(markdown(result))


_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _pct(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}%}"


def _num(value: float | str | None, spec: str = ".4g") -> str:
    """A number for a table; ``None`` (undefined) as ``-`` and ``"inf"`` as is."""
    if value is None:
        return "-"
    return value if isinstance(value, str) else format(value, spec)


def _count(value: int, compact: bool) -> str:
    """An element count with thousands separators, or (``compact``) in three significant digits with k/M/G/T."""
    if not compact or value < 100_000:
        return f"{value:,}"
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:,}"


def sparsity_rows(result: dict[str, Any], compact: bool = False) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-agent sparsity and overlap table (``compact``: counts shortened for a terminal)."""
    header = ["agent", "dtype", "density", "exact", "bf16", "unique", "shared", "rho", "lam RAM+", "lam RAM+s"]
    rows = []
    for a in result["agents"]:
        rows.append(
            [
                a["name"],
                "LoRA" if a["kind"] == "lora" else "/".join(_SHORT_DTYPES.get(d, d) for d in a["dtypes"]),
                _pct(a["density"]),
                _pct(a["density_exact"]),
                _pct(a["density_bf16"]),
                _count(a["unique"], compact),
                _count(a["shared"], compact),
                _num(a["rho"], ".3f"),
                _num(a["lambda"]["ram_plus"], ".4f"),
                _num(a["lambda"]["ram_plus_soft"], ".4f"),
            ]
        )
    return header, rows


def magnitude_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-agent magnitude table."""
    header = ["agent", "active", "mean abs(tau)", "Gini", "ex. kurtosis", "top 1% mass", "top 5% mass"]
    rows = []
    for a in result["agents"]:
        m = a["magnitude"]
        rows.append(
            [
                a["name"],
                f"{m['count']:,}",
                _num(m["mean_abs"], ".3g"),
                _num(m["gini"], ".4f"),
                _num(m["excess_kurtosis"], ".4g"),
                _pct(m["top_1pct_mass"], 1),
                _pct(m["top_5pct_mass"], 1),
            ]
        )
    return header, rows


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def markdown(result: dict[str, Any]) -> str:
    """The analysis as Markdown tables (``analysis.md``)."""
    names = [a["name"] for a in result["agents"]]
    p = result["parameters"]
    lines = [
        "# Task-vector sparsity analysis",
        "",
        f"Base model `{result['base_model']}` ({', '.join(result['base_dtypes'])}); {result['num_agents']} agents; "
        f"{result['total_elements']:,} elements in {result['tensors']} floating tensors. An element is active when "
        f"|tau| > eps = {p['eps']:g} (strict), tau = float32(agent) - float32(base) of the stored values; *exact*: "
        "the stored values differ; *bf16*: both sides rounded to bfloat16 first (only for inputs stored wider). "
        f"lambda_t: RAM+ with r = {p['r']:g}, alpha = {p['alpha']:g}; RAM+s with r = {p['r']:g}.",
        "",
        "## Sparsity and overlap",
        "",
        *_table(*sparsity_rows(result)),
        "### Share of each agent's active elements also updated by k other agents",
        "",
        *_table(
            ["agent", *(f"k = {k}" for k in range(len(names)))],
            [[a["name"], *(_pct(s, 1) for s in a["overlap_shares"])] for a in result["agents"]],
        ),
        f"Elements updated by any agent: {result['overall']['union']:,} "
        f"({_pct(result['overall']['density_any'])}); by exactly 0..N agents: "
        f"{', '.join(f'{c:,}' for c in result['overall']['element_counts'])}.",
        "",
        "### Pairwise Jaccard index of the active sets",
        "",
        *_table(["", *names], [[names[s], *(_num(v, ".3f") for v in row)] for s, row in enumerate(result["jaccard"])]),
        "## Magnitudes of the active deltas",
        "",
        *_table(*magnitude_rows(result)),
        f"Gini and top-k mass come from a |tau| histogram with "
        f"{result['magnitude_estimates']['histogram_bins_per_octave']} bins per octave: Gini is at most "
        f"{result['magnitude_estimates']['gini_max_error']:.2g} below the exact value, top-k mass within a relative "
        f"{result['magnitude_estimates']['top_mass_max_relative_error']:.2g}. The kurtosis takes sum tau^4 at each "
        f"bin's mean (at most a relative "
        f"{result['magnitude_estimates']['fourth_power_sum_max_relative_error']:.2g} below exact); the mean and "
        "standard deviation are exact.",
        "",
        "## Anatomy",
        "",
        "### Density by module type",
        "",
        *_table(
            ["module", "tensors", "elements", *names],
            [
                [m["module"], str(m["tensors"]), f"{m['numel']:,}", *(_pct(d) for d in m["density"])]
                for m in result["anatomy"]["modules"]
            ],
        ),
        "### Density by family",
        "",
        *_table(
            ["family", "tensors", "elements", *names],
            [
                [f["family"], str(f["tensors"]), f"{f['numel']:,}", *(_pct(d) for d in f["density"])]
                for f in result["anatomy"]["families"]
            ],
        ),
    ]
    if result["anatomy"]["layers"]:
        lines += [
            "### Density by decoder layer",
            "",
            *_table(
                ["layer", "elements", *names],
                [
                    [str(layer["layer"]), f"{layer['numel']:,}", *(_pct(d) for d in layer["density"])]
                    for layer in result["anatomy"]["layers"]
                ],
            ),
        ]
    if result.get("figures"):
        lines += ["## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in result["figures"]] + [""]
    if result["warnings"]:
        lines += ["## Warnings", ""] + [f"- {w}" for w in result["warnings"]] + [""]
    return "\n".join(lines)


def print_tables(result: dict[str, Any]) -> None:
    """Print the per-agent tables to the terminal."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"{result['num_agents']} agents, {result['total_elements']:,} elements, {result['tensors']} tensors")
    for title, (header, rows) in [
        (f"Task-vector sparsity at eps = {result['parameters']['eps']:g}", sparsity_rows(result, compact=True)),
        ("Magnitudes of the active deltas", magnitude_rows(result)),
    ]:
        table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=0)
        # 80 columns: no column without a value, names whole, headers wrapped before any cell is cut
        keep = [i for i, column in enumerate(header) if i == 0 or any(row[i] != "-" for row in rows)]
        for i in keep:
            cells = [header[i], *(row[i] for row in rows)] if i == 0 else [header[i]]
            table.add_column(
                header[i],
                justify="left" if header[i] in ("agent", "dtype") else "right",
                min_width=max(map(len, cells)) if i == 0 else None,
                no_wrap=i == 0,
            )
        for row in rows:
            table.add_row(*(row[i] for i in keep))
        console.print(table)
    for warning in result["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")


__all__ = [
    "JSON_FILE",
    "MARKDOWN_FILE",
    "magnitude_rows",
    "markdown",
    "print_tables",
    "sparsity_rows",
    "write_outputs",
]
