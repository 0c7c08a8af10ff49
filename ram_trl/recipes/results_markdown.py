"""``results.md`` and the terminal table of a recipe run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ram_trl import defaults
from ram_trl.messages import processes_phrase
from ram_trl.recipes import stats
from ram_trl.recipes.mechanism import mechanism_section
from ram_trl.recipes.results_format import ci, fmt3, fmt_rho, pct, pct_ci
from ram_trl.recipes.selection import add_statistics, select_merges, split_block, val_block

__all__ = ["markdown", "print_table"]


def _score_table(results: dict[str, Any], split: str) -> list[str]:
    stages = results["stages"]
    regime = results.get("regime") or {}
    selection = results.get("selection") or select_merges(results)
    bold = selection["columns"]
    header = ["model", "kind", *stages, "average", "retention"]
    if split == "test":
        header += ["density", "unique", "rho"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(header) - 2)) + "|"]
    for row in results["rows"]:
        block = split_block(row, split)
        intervals = block.get("interval") or {}
        cells = []
        for column in [*stages, "average"]:
            value = block["scores"].get(column) if column != "average" else block.get("average")
            text = ci(value, intervals.get(column))
            cells.append(f"**{text}**" if value is not None and bold.get(column) == row["name"] else text)
        retention = block.get("retention")
        cells.append(pct_ci(retention["mean"], retention.get("interval")) if retention else "")
        if split == "test":
            info = regime.get(row["name"]) if row["kind"] == "agent" else None
            cells += [pct(info["density"]), pct(info["unique_share"]), fmt_rho(info["rho"])] if info else ["", "", ""]
        kind = row["kind"] + (" (ship)" if row["name"] == selection["ship"] else "")
        lines.append("| " + " | ".join([row["name"], kind, *cells]) + " |")
    return lines


def _retention_table(results: dict[str, Any]) -> list[str]:
    stages = results["stages"]
    merges = [r for r in results["rows"] if r["kind"] == "merge" and r.get("retention")]
    if not merges:
        return []
    lines = [
        "| merge | " + " | ".join(stages) + " | mean (test) | mean (validation) |",
        "|---|" + "---:|" * (len(stages) + 2),
    ]
    for row in merges:
        test, val = row["retention"], val_block(row).get("retention") or {}
        cells = [pct_ci(test["per_stage"].get(s), None) for s in stages]
        cells += [pct_ci(test["mean"], test.get("interval")), pct_ci(val.get("mean"), val.get("interval"))]
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    return lines


def markdown(results: dict[str, Any]) -> str:
    """``results.md``; bold marks the merge chosen on validation per column."""
    if "selection" not in results:
        add_statistics(results)
    config = results.get("statistics") or {}
    selection = results["selection"]
    title = results.get("recipe", "recipe")
    lines = [f"# Results: {title}", ""]
    if results.get("description"):
        lines += [results["description"].strip(), ""]
    if config.get("intervals") == "seeds":
        how = (
            f"over {config.get('seeds', '?')} seeds (mean and Student t interval of the per-seed scores; the prompts "
            "are the same in every seed)"
        )
    else:
        how = (
            f"percentile bootstrap over prompts ({config.get('resamples', stats.RESAMPLES)} resamples, seed "
            f"{config.get('seed', 0)}; each stage's prompts resampled on their own, the same resamples for every "
            "model)"
        )
    lines += [
        "Score per stage: mean over its prompts of the sum of that stage's rewards "
        f"({results.get('decoding', 'greedy decoding')}); average: mean over the stages. Brackets: 95% interval, "
        f"{how}. Retention: (merge - base) / (specialist - base) per vertical, mean over the verticals where the "
        f"specialist gained at least {config.get('retention_min_gain', stats.MIN_GAIN):g} over the base; above 100%: "
        "the merge beats the specialist on its own vertical (the other agents' changes help there, or noise: read "
        "the interval). **Bold**: the merge chosen on the validation split for that column (never the best test score); "
        "(ship): the merge to ship. density / unique / rho: the agent's task vector at eps = "
        f"{results.get('eps', defaults.EPS):g} (unique = share of its active elements no other agent changes; "
        "rho = shared / unique, RAM+'s rescaling signal). How to read this file: docs/recipes-results.md.",
        "",
        "## Test (held-out prompts; reported, never chosen on)",
        "",
        *_score_table(results, "test"),
        "",
    ]
    if any(val_block(r)["scores"] for r in results["rows"]):
        lines += ["## Validation (what the choices are made on)", "", *_score_table(results, "val"), ""]
    retention = _retention_table(results)
    if retention:
        lines += ["## Retention per vertical (test)", "", *retention, ""]
    lines += ["## Selection", "", f"Rule: {selection['rule']}", ""]
    for sweep in selection.get("sweeps") or []:
        lines.append(
            f"- sweep {sweep['label']} ({', '.join(sweep['parameters'])}): {sweep['pick'] or 'none'} chosen on "
            f"validation among {', '.join(sweep['rows'])}"
        )
    if selection.get("sweeps"):
        lines.append("")
    if results.get("notes"):
        lines += ["Notes:", ""] + [f"- {note}" for note in results["notes"]] + [""]
    if results.get("figures"):
        lines += [f"![{Path(f).stem}]({f})" for f in results["figures"]] + [""]
    lines += _training_section(results)
    lines += _preview_section(results)
    lines += _warm_start_section(results)
    lines += mechanism_section(results)
    lines += ["## Verdict", "", results["verdict"], ""]
    return "\n".join(lines)


def _training_section(results: dict[str, Any]) -> list[str]:
    """results.md's section on the telemetry during training: per stage its first and last measurement."""
    training = results.get("training") or {}
    if not training:
        return []
    lines = [
        "## During training",
        "",
        "The telemetry callback's measurements of each stage's task vector (density: share of elements with "
        "|tau| > eps; saved: in the dtype the agent is saved in; each stage's `trainer_state.json` has them all).",
        "",
        "| stage | measurements | first step | density (first) | saved (first) | last step | density (last) "
        "| saved (last) | reward (last) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stage, curve in training.items():
        first, last = curve[0], curve[-1]
        lines.append(
            f"| {stage} | {len(curve)} | {first['step']} | {pct(first['density'])} | {pct(first['density_saved'])} "
            f"| {last['step']} | {pct(last['density'])} | {pct(last['density_saved'])} | {fmt3(last['reward'])} |"
        )
    lines.append("")
    if results.get("processes"):
        trained = ", ".join(f"{stage} on {processes_phrase(n)}" for stage, n in results["processes"].items())
        lines += [f"Trained: {trained}.", ""]
    if results.get("training_figure"):
        lines += [f"![training]({results['training_figure']})", ""]
    return lines


def _warm_start_section(results: dict[str, Any]) -> list[str]:
    """results.md's section on the warm start's acceptance (``warm_start.accept``)."""
    from ram_trl.recipes.warm_start import acceptance_summary

    warm = results.get("warm_start")
    if not warm:
        return []
    verdict = "accepted" if warm["accepted"] else "**NOT ACCEPTED: a phase hit its cap with the criterion unmet**"
    lines = ["## Warm start", "", f"Criterion: {warm['criterion']}.", "", f"{warm['steps']} steps, {verdict}.", ""]
    return lines + [f"- {line}" for line in acceptance_summary(warm)] + [""]


def _preview_section(results: dict[str, Any]) -> list[str]:
    """The merge previews of the stages trained with ``preview:``: the step kept per stage and its figure."""
    previews = results.get("previews") or {}
    if not previews:
        return []
    lines = [
        "## Merge preview while training",
        "",
        "Each stage trained with `preview:` was merged with the earlier stages during training (the engine's own "
        "merge of the saved-dtype policy), the merge scored on every merged stage's validation prompts. Kept: the "
        "step whose checkpoint is the stage's agent (`keep: best`: the highest merged validation average). How to "
        "read it: docs/merge-preview.md.",
        "",
        "| stage | method | previews | step kept | merged val average (kept) | (last step) | retention mean (kept) "
        "| agent's own val score (kept) | (last step) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    figures = []
    for stage, record in previews.items():
        history = record.get("history") or []
        if not history:
            continue
        kept = next((h for h in history if h["step"] == record["kept_step"]), history[-1])
        last = history[-1]
        lines.append(
            f"| {stage} | {record.get('method', '')} | {len(history)} | {record['kept_step']} of {last['step']} | "
            f"{fmt3(kept['average'])} | {fmt3(last['average'])} | {pct(kept.get('retention_mean'))} | "
            f"{fmt3(kept['agent_score'])} | {fmt3(last['agent_score'])} |"
        )
        figures += [f for f in record.get("figures", [])]
    lines.append("")
    lines += [f"![{Path(f).stem}]({f})" for f in figures]
    return [*lines, ""] if figures else lines


def print_table(results: dict[str, Any]) -> None:
    """The test table in the terminal (rich; bold green: chosen on validation), then the verdict."""
    from rich.console import Console
    from rich.table import Table

    if "selection" not in results:
        add_statistics(results)
    stages = results["stages"]
    selection = results["selection"]
    regime = results.get("regime") or {}
    table = Table(title=f"{results.get('recipe', 'recipe')}: test scores, 95% intervals (bold: chosen on validation)")
    for column in ("model", "kind", *stages, "average", "retention", "density", "unique", "rho"):
        table.add_column(
            column,
            justify="left" if column in ("model", "kind") else "right",
            no_wrap=column == "model",
            min_width=len(column),
        )
    for row in results["rows"]:
        intervals = row.get("interval") or {}
        cells = []
        for key, value in [*((s, row["scores"].get(s)) for s in stages), ("average", row.get("average"))]:
            text = ci(value, intervals.get(key))
            cells.append(f"[bold green]{text}[/]" if selection["columns"].get(key) == row["name"] else text)
        retention = row.get("retention")
        cells.append(pct_ci(retention["mean"], retention.get("interval")) if retention else "")
        info = regime.get(row["name"]) if row["kind"] == "agent" else None
        cells += [pct(info["density"]), pct(info["unique_share"]), fmt_rho(info["rho"])] if info else ["", "", ""]
        kind = row["kind"] + (" (ship)" if row["name"] == selection["ship"] else "")
        table.add_row(row["name"], kind, *cells)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 200)
    console.print(table)
    console.print(results["verdict"])
