"""The results of a recipe run: ``results.json``, ``results.md`` (a table like the RAM paper's Table 1 with 95%
intervals, retention, the merge chosen on validation and a verdict), PNG charts and a rich table in the terminal.

``results.json`` holds ``stages`` (column order), ``rows`` (one per evaluated model: ``name``, ``kind`` of
``base``/``agent``/``merge``, ``method``, ``parameters``, test ``scores`` by stage and their per-prompt ``rewards``,
and ``val`` with the same for the validation split), optionally ``regime`` (per agent, from the sparsity analysis:
``density``, ``unique_share``, ``rho``, ``lambda``), ``eps``, ``statistics`` (how intervals are computed) and
``sweeps``. :func:`add_statistics` computes from them, here and never in the runner: averages, intervals,
retention, the ``selection`` (on validation only) and the ``verdict``. ``docs/recipes-results.md`` explains how to
read them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ram_trl import defaults
from ram_trl.output import atomic_file
from ram_trl.recipes import stats

__all__ = [
    "SELECTION_RULE",
    "add_statistics",
    "aggregate_seeds",
    "best_merged",
    "markdown",
    "plot_retention",
    "plot_scores",
    "print_table",
    "regime_from_analysis",
    "row_average",
    "select_merges",
    "verdict",
    "write_results",
]

#: How the merge to ship (and each sweep's value, and each column's bold value) is chosen.
SELECTION_RULE = (
    "the merge with the highest validation average (mean over stages of the validation score); ties go to the "
    "higher mean validation retention, then to the first row. Test scores are never read."
)


def row_average(row: dict[str, Any], stages: list[str]) -> float | None:
    """Mean of a row's scores over ``stages`` it has a score for (``None`` if none).

    Args:
        row (`dict[str, Any]`): A results row, or its ``val`` block (anything with ``scores``).
        stages (`list[str]`): The stages averaged.

    Returns:
        `float | None`: The mean of the defined scores.
    """
    values = [row["scores"][s] for s in stages if row["scores"].get(s) is not None]
    return sum(values) / len(values) if values else None


def _val(row: dict[str, Any]) -> dict[str, Any]:
    return row.get("val") or {"scores": {}}


def select_merges(results: dict[str, Any]) -> dict[str, Any]:
    """Choose on the validation split only: the merge to ship, each sweep's value and each column's best merge.

    Reads each merge row's ``val`` block (``scores``, and ``retention`` when present) and nothing else: test scores
    cannot change the choice.

    Args:
        results (`dict[str, Any]`): The results of a recipe run (``results.json``: ``stages``, ``rows``, ...).

    Returns:
        ``{"rule", "split": "val", "ship": name | None, "columns": {stage or "average": name}, "sweeps": [{"label",
        "parameters", "rows", "pick"}]}``; ``ship`` is ``None`` when no merge has validation scores.
    """
    stages = results["stages"]
    merges = [r for r in results["rows"] if r["kind"] == "merge"]
    averages = {r["name"]: row_average(_val(r), stages) for r in merges}
    retention = {r["name"]: (_val(r).get("retention") or {}).get("mean") for r in merges}

    def pick(names: list[str]) -> str | None:
        scored = {n: averages[n] for n in names if averages.get(n) is not None}
        if not scored:
            return None
        top = max(scored.values())
        tied = [n for n, v in scored.items() if v == top]
        return stats.select_best({n: retention[n] if retention[n] is not None else -math.inf for n in tied})

    columns = {}
    for stage in stages:
        best = stats.select_best({r["name"]: _val(r)["scores"].get(stage) for r in merges})
        if best is not None:
            columns[stage] = best
    ship = pick([r["name"] for r in merges])
    if ship is not None:
        columns["average"] = ship
    sweeps = [{**sweep, "pick": pick(sweep["rows"])} for sweep in results.get("sweeps") or []]
    return {"rule": SELECTION_RULE, "split": "val", "ship": ship, "columns": columns, "sweeps": sweeps}


def best_merged(results: dict[str, Any]) -> dict[str, str]:
    """Per column (each stage, and ``"average"``), the merge marked best: the one chosen on validation
    (:func:`select_merges`), never the best test score.

    Args:
        results (`dict[str, Any]`): The results of a recipe run (``results.json``: ``stages``, ``rows``, ...).

    Returns:
        `dict[str, str]`: Column -> merge name.
    """
    return select_merges(results)["columns"]


def regime_from_analysis(analysis: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per agent name, the task vector's regime from ``analysis.json``: density, unique share of its active
    elements, rho_t and RAM+'s lambda_t.

    Args:
        analysis (`dict[str, Any]`): The contents of ``analysis.json`` (:func:`ram_trl.analyze`).

    Returns:
        `dict[str, dict[str, float | None]]`: Per agent, ``density``, ``unique_share``, ``rho`` and ``lambda``.
    """
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


def _block(row: dict[str, Any], split: str) -> dict[str, Any]:
    """The scores of ``row`` on ``split``: the row itself for ``"test"``, its ``val`` block for ``"val"``."""
    return row if split == "test" else row.setdefault("val", {"scores": {}})


def _samples(results: dict[str, Any], split: str, kind: str) -> dict[str, dict[str, np.ndarray]]:
    """Per row name, per stage and ``"average"``: the bootstrap means (paired over rows) or the per-seed values."""
    stages = results["stages"]
    config = results.get("statistics") or {}
    rows = results["rows"]
    if kind == "seeds":
        out: dict[str, dict[str, np.ndarray]] = {}
        for row in rows:
            per_seed = _block(row, split).get("per_seed") or {}
            arrays = {s: np.asarray(per_seed[s], dtype=np.float64) for s in stages if per_seed.get(s)}
            if arrays:
                arrays["average"] = np.mean(np.stack(list(arrays.values())), axis=0)
            out[row["name"]] = arrays
        return out
    rewards = {row["name"]: _block(row, split).get("rewards") or {} for row in rows}
    return stats.bootstrap_scores(
        rewards,
        stages,
        resamples=int(config.get("resamples", stats.RESAMPLES)),
        seed=int(config.get("seed", 0)) + (0 if split == "test" else 1),
    )


def add_statistics(results: dict[str, Any]) -> dict[str, Any]:
    """Add to ``results`` (in place, and return it) everything derived from the scores.

    Per row and split (the row itself for test, its ``val`` block for validation): ``average``, ``interval`` (per
    stage and ``"average"``: ``[low, high]`` or ``None``), and for merges ``retention`` (``per_stage``, ``mean``,
    ``interval``, ``verticals`` it averages). Then ``selection`` (:func:`select_merges`, validation only) and
    ``verdict`` (:func:`verdict`). Intervals come from ``statistics.intervals``: ``"bootstrap"`` over each row's
    per-prompt ``rewards`` or ``"seeds"`` over its ``per_seed`` scores.

    Args:
        results (`dict[str, Any]`): The results of a recipe run (``results.json``: ``stages``, ``rows``, ...).

    Returns:
        `dict[str, Any]`: ``results`` itself.
    """
    stages = results["stages"]
    config = results.setdefault("statistics", {})
    kind = config.setdefault("intervals", "bootstrap")
    config.setdefault("level", stats.LEVEL)
    min_gain = float(config.setdefault("retention_min_gain", stats.MIN_GAIN))
    rows = results["rows"]
    by_name = {row["name"]: row for row in rows}
    specialists = results.get("specialists") or {s: s for s in stages}
    base = next((row for row in rows if row["kind"] == "base"), None)
    for split in ("test", "val"):
        samples = _samples(results, split, kind)
        results.setdefault("_samples", {})[split] = samples
        for row in rows:
            block = _block(row, split)
            block["average"] = row_average(block, stages)
            block["interval"] = {
                column: stats.interval_of(values, kind) for column, values in samples[row["name"]].items()
            }
        if base is None:
            continue
        base_scores = _block(base, split)["scores"]
        experts = {v: by_name[specialists[v]] for v in stages if specialists.get(v) in by_name}
        for row in rows:
            if row["kind"] == "merge":
                _block(row, split)["retention"] = _retention(
                    row,
                    base,
                    experts=experts,
                    split=split,
                    samples=samples,
                    kind=kind,
                    min_gain=min_gain,
                    base_scores=base_scores,
                )
    results["selection"] = select_merges(results)
    results["verdict"] = verdict(results)
    results.pop("_samples", None)
    return results


def _retention(
    row: dict[str, Any],
    base: dict[str, Any],
    *,
    experts: dict[str, dict[str, Any]],
    split: str,
    samples: dict[str, dict[str, np.ndarray]],
    kind: str,
    min_gain: float,
    base_scores: dict[str, float],
) -> dict[str, Any]:
    scores = _block(row, split)["scores"]
    per_stage: dict[str, float | None] = {}
    for vertical, expert in experts.items():
        values = (
            scores.get(vertical),
            base_scores.get(vertical),
            _block(expert, split)["scores"].get(vertical),
        )
        per_stage[vertical] = None if None in values else stats.retention(*values, min_gain=min_gain)
    verticals = [v for v, value in per_stage.items() if value is not None]
    interval = None
    needed = [samples[row["name"]], samples[base["name"]], *(samples[experts[v]["name"]] for v in verticals)]
    if verticals and all(v in have for have in needed for v in verticals):
        draws = stats.retention_samples(
            samples[row["name"]],
            samples[base["name"]],
            {v: samples[experts[v]["name"]] for v in verticals},
            verticals,
        )
        interval = stats.interval_of(draws, kind)
    return {
        "per_stage": per_stage,
        "mean": stats.mean_retention(per_stage),
        "interval": interval,
        "verticals": verticals,
    }


def aggregate_seeds(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """The results of one recipe run with several seeds (``ram-trl run --seeds N``), as one results dict.

    Each row's ``scores`` (test) and ``val.scores`` are the means over the seeds, with the per-seed values in
    ``per_seed`` (what the Student t intervals come from); per-prompt rewards are left in the seed runs. The regime
    is the mean over the seeds of each agent's density, unique share, rho and lambda.

    Args:
        runs: The results of each seed's run (same recipe, so the same rows and stages in the same order).
        seeds: The seed of each run.

    Returns:
        `dict[str, Any]`: The combined results (``seeds`` and ``statistics.intervals = "seeds"`` recorded).

    Raises:
        ValueError: when the runs do not have the same rows and stages.
    """
    first = runs[0]
    stages = first["stages"]
    for run in runs[1:]:
        if [r["name"] for r in run["rows"]] != [r["name"] for r in first["rows"]] or run["stages"] != stages:
            raise ValueError("the seed runs do not have the same rows and stages")

    def split_block(rows: list[dict[str, Any]], split: str) -> dict[str, Any]:
        blocks = [r if split == "test" else r.get("val") or {"scores": {}} for r in rows]
        per_seed = {
            s: [b["scores"][s] for b in blocks]
            for s in stages
            if all(b["scores"].get(s) is not None for b in blocks)
        }
        return {"scores": {s: math.fsum(v) / len(v) for s, v in per_seed.items()}, "per_seed": per_seed}

    rows = []
    for i, row in enumerate(first["rows"]):
        same = [run["rows"][i] for run in runs]
        test = split_block(same, "test")
        rows.append(
            {
                "name": row["name"],
                "kind": row["kind"],
                "method": row.get("method"),
                "parameters": row.get("parameters"),
                "paths": [r.get("path") for r in same],
                "n": row.get("n"),
                **test,
                "val": split_block(same, "val"),
            }
        )
    regime: dict[str, dict[str, float | None]] = {}
    for name in first.get("regime") or {}:
        regime[name] = {}
        for key in first["regime"][name]:
            values = [run["regime"].get(name, {}).get(key) for run in runs]
            present = [float(v) for v in values if v is not None]
            regime[name][key] = math.fsum(present) / len(present) if len(present) == len(values) else None
    statistics = dict(first.get("statistics") or {})
    statistics.update(intervals="seeds", seeds=len(runs), seed_values=list(seeds))
    for key in ("resamples", "seed"):
        statistics.pop(key, None)
    return {
        "recipe": first.get("recipe"),
        "description": first.get("description"),
        "stages": stages,
        "specialists": first.get("specialists"),
        "decoding": first.get("decoding"),
        "eps": first.get("eps"),
        "statistics": statistics,
        "sweeps": first.get("sweeps"),
        "rows": rows,
        "regime": regime,
        "runs": [f"seed_{s}" for s in seeds],
        "timings": {
            f"seed_{s}": (run.get("timings") or {}).get("total") for s, run in zip(seeds, runs, strict=True)
        },
        "notes": [f"every score is the mean over seeds {', '.join(map(str, seeds))} (runs in seed_S/)"],
        "figures": [],
    }


def _fmt3(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ci(value: float | None, interval: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    text = format(value, spec)
    if interval:
        text += f" [{format(interval[0], spec)}, {format(interval[1], spec)}]"
    return text


def _pct_ci(value: float | None, interval: Any) -> str:
    if value is None:
        return "undefined"
    text = f"{100 * value:.0f}%"
    if interval:
        text += f" [{100 * interval[0]:.0f}%, {100 * interval[1]:.0f}%]"
    return text


def _range(values: list[float | None], scale: float = 1.0, spec: str = ".0f", unit: str = "") -> str | None:
    present = [scale * v for v in values if v is not None and not math.isinf(v)]
    if not present:
        return None
    low, high = min(present), max(present)
    if format(low, spec) == format(high, spec):
        return f"{format(low, spec)}{unit}"
    return f"{format(low, spec)}-{format(high, spec)}{unit}"


def _difference(results: dict[str, Any], first: str, second: str) -> tuple[float, Any] | None:
    """Test-average difference ``first - second`` and its paired interval (recomputed from the samples)."""
    by_name = {row["name"]: row for row in results["rows"]}
    a, b = by_name[first].get("average"), by_name[second].get("average")
    if a is None or b is None:
        return None
    samples = (results.get("_samples") or {}).get("test", {})
    kind = (results.get("statistics") or {}).get("intervals", "bootstrap")
    sa, sb = samples.get(first, {}).get("average"), samples.get(second, {}).get("average")
    interval = stats.interval_of(sa - sb, kind) if sa is not None and sb is not None else None
    return a - b, interval


def _compare(results: dict[str, Any], ship: str, other: str, label: str) -> str:
    found = _difference(results, ship, other)
    if found is None:
        return ""
    diff, interval = found
    if interval is None:
        return (
            f"On test it differs from {label} by {diff:+.3f} (no interval: per-prompt rewards are missing)."
        )
    if diff == 0 and interval[0] == interval[1] == 0:
        return f"On test it scores the same as {label} in every resample."
    resolved = interval[0] > 0 or interval[1] < 0
    text = f"On test it differs from {label} by {diff:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}] (paired 95%)"
    if resolved:
        return text + f", so it is resolved: {ship} is {'better' if diff > 0 else 'worse'}."
    return text + ": the difference is not resolved at this number of prompts."


def verdict(results: dict[str, Any]) -> str:
    """One plain paragraph: the merge to ship (chosen on validation), its test average with its interval, its
    retention, how it compares with the runner-up and the base on test, and the agents' regime.

    Args:
        results (`dict[str, Any]`): The results of a recipe run (``results.json``: ``stages``, ``rows``, ...).

    Returns:
        `str`: The paragraph.
    """
    selection = results.get("selection") or select_merges(results)
    ship = selection["ship"]
    stages = results["stages"]
    regime = results.get("regime") or {}
    if regime:
        agents = list(regime.values())
        unique = [a.get("unique_share") for a in agents]
        defined = [u for u in unique if u is not None]
        sparse = bool(defined) and all(u >= 0.2 for u in defined)
        regime_text = (
            f"The agents' task vectors have density {_range([a.get('density') for a in agents], 100, '.0f', '%')}, "
            f"unique share {_range(unique, 100, '.0f', '%') or 'undefined (no active elements)'} and rho "
            f"{_range([a.get('rho') for a in agents], 1, '.3g') or 'inf'}: "
            + (
                "the sparse, heterogeneous regime RAM targets (every unique share at least 20%), where its "
                "rescaling has unique elements to act on."
                if sparse
                else "not the regime RAM targets (unique shares of at least 20%; the paper's 7B agents: 6-48%), "
                "so RAM averages nearly everywhere and behaves like task arithmetic at 1/N."
            )
        )
    else:
        regime_text = "No sparsity analysis was run, so the agents' regime is not known."
    if not results["rows"]:
        return (
            "Nothing was scored (evaluation is off or no stage has held-out prompts), so no merge is chosen. "
            + regime_text
        )
    if ship is None:
        return (
            "No merge to ship: no merge has validation scores (give the stages validation prompts, "
            "prompts.val_size or val_file), and nothing is chosen on the test prompts. " + regime_text
        )
    by_name = {row["name"]: row for row in results["rows"]}
    row = by_name[ship]
    val_average = row_average(_val(row), stages)
    text = (
        f"Ship {ship}: it has the highest validation average ({_fmt3(val_average)}) of the "
        f"{sum(r['kind'] == 'merge' for r in results['rows'])} merges, and on the held-out test prompts it "
        f"scores {_ci(row.get('average'), (row.get('interval') or {}).get('average'))} on average (95% interval)."
    )
    retention = row.get("retention") or {}
    if retention.get("mean") is not None:
        text += (
            f" It keeps {_pct_ci(retention['mean'], retention.get('interval'))} of the specialists' gains over "
            f"the base on test (mean retention over {', '.join(retention['verticals'])}"
            + (
                ")."
                if retention.get("interval")
                else "; no interval: the specialists' gains are not resolved in enough resamples)."
            )
        )
    else:
        gain = (results.get("statistics") or {}).get("retention_min_gain", stats.MIN_GAIN)
        text += f" Its retention is undefined: no specialist beat the base on its own test prompts by at least {gain:g}."
    merges = [r for r in results["rows"] if r["kind"] == "merge"]
    others = {r["name"]: row_average(_val(r), stages) for r in merges if r["name"] != ship}
    runner_up = stats.select_best(others)
    if runner_up is not None:
        text += " " + _compare(results, ship, runner_up, f"the runner-up on validation ({runner_up})")
    base = next((r for r in results["rows"] if r["kind"] == "base"), None)
    if base is not None:
        text += " " + _compare(results, ship, base["name"], "the base")
    best_test = stats.select_best({r["name"]: r.get("average") for r in merges})
    if best_test is not None and best_test != ship:
        text += (
            f" {best_test} has the highest test average ({_fmt3(by_name[best_test].get('average'))}), but "
            "the choice is made on validation only, so that test scores stay an unbiased estimate."
        )
    return " ".join(f"{text} {regime_text}".split())


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _rho(value: float | str | None) -> str:
    if value is None:
        return "-"
    value = float(value)
    return "inf" if value == float("inf") else f"{value:.3g}"


def _score_table(results: dict[str, Any], split: str) -> list[str]:
    stages = results["stages"]
    regime = results.get("regime") or {}
    selection = results.get("selection") or select_merges(results)
    bold = selection["columns"]
    header = ["model", "kind", *stages, "average", "retention"]
    if split == "test":
        header += ["density", "unique", "rho"]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---", "---"] + ["---:"] * (len(header) - 2)) + "|",
    ]
    for row in results["rows"]:
        block = _block(row, split)
        intervals = block.get("interval") or {}
        cells = []
        for column in [*stages, "average"]:
            value = block["scores"].get(column) if column != "average" else block.get("average")
            text = _ci(value, intervals.get(column))
            cells.append(f"**{text}**" if value is not None and bold.get(column) == row["name"] else text)
        retention = block.get("retention")
        cells.append(_pct_ci(retention["mean"], retention.get("interval")) if retention else "")
        if split == "test":
            info = regime.get(row["name"]) if row["kind"] == "agent" else None
            cells += (
                [_pct(info["density"]), _pct(info["unique_share"]), _rho(info["rho"])]
                if info
                else ["", "", ""]
            )
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
        test, val = row["retention"], _val(row).get("retention") or {}
        cells = [_pct_ci(test["per_stage"].get(s), None) for s in stages]
        cells += [_pct_ci(test["mean"], test.get("interval")), _pct_ci(val.get("mean"), val.get("interval"))]
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    return lines


def markdown(results: dict[str, Any]) -> str:
    """``results.md``: the test table (95% intervals, mean retention, the agents' regime), the validation table,
    retention per vertical, the selection and the verdict. Bold marks the merge chosen on validation per column.

    Args:
        results (`dict[str, Any]`): The results of a recipe run (``results.json``: ``stages``, ``rows``, ...); the statistics
            are added first (:func:`add_statistics`) when missing.

    Returns:
        `str`: The Markdown text.
    """
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
        f"specialist gained at least {config.get('retention_min_gain', stats.MIN_GAIN):g} over the base. "
        "**Bold**: the merge chosen on the validation split for that column (never the best test score); "
        "(ship): the merge to ship. density / unique / rho: the agent's task vector at eps = "
        f"{results.get('eps', defaults.EPS):g} (unique = share of its active elements no other agent changes; "
        "rho = shared / unique, RAM+'s rescaling signal). How to read this file: docs/recipes-results.md.",
        "",
        "## Test (held-out prompts; reported, never chosen on)",
        "",
        *_score_table(results, "test"),
        "",
    ]
    if any(_val(r)["scores"] for r in results["rows"]):
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
    lines += _preview_section(results)
    lines += _warm_start_section(results)
    lines += ["## Verdict", "", results["verdict"], ""]
    return "\n".join(lines)


def _warm_start_section(results: dict[str, Any]) -> list[str]:
    """results.md's section on the warm start's acceptance criterion (runs whose recipe sets
    ``warm_start.accept``)."""
    from ram_trl.recipes.warm_start import acceptance_summary

    warm = results.get("warm_start")
    if not warm:
        return []
    verdict = (
        "accepted" if warm["accepted"] else "**NOT ACCEPTED: a phase hit its cap with the criterion unmet**"
    )
    lines = [
        "## Warm start",
        "",
        f"Criterion: {warm['criterion']}.",
        "",
        f"{warm['steps']} steps, {verdict}.",
        "",
    ]
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
            f"{_fmt3(kept['average'])} | {_fmt3(last['average'])} | {_pct(kept.get('retention_mean'))} | "
            f"{_fmt3(kept['agent_score'])} | {_fmt3(last['agent_score'])} |"
        )
        figures += [f for f in record.get("figures", [])]
    lines.append("")
    lines += [f"![{Path(f).stem}]({f})" for f in figures]
    return [*lines, ""] if figures else lines


def _atomic_write(path: Path, text: str) -> None:
    with atomic_file(path, "results file") as tmp:
        tmp.write_text(text, encoding="utf-8")


def plot_scores(results: dict[str, Any], path: Path) -> None:
    """Grouped bars of the test scores with their 95% intervals as error bars: one group per stage (and the
    average), one bar per model.

    Args:
        results (`dict[str, Any]`): The results of a recipe run (``results.json``: ``stages``, ``rows``, ...).
        path (`Path`): The PNG file written.
    """
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
        ax.bar(
            xs,
            heights,
            width,
            yerr=errors,
            capsize=1.5,
            error_kw={"elinewidth": 0.8},
            label=row["name"] + (" (ship)" if row["name"] == ship else ""),
            color="#7f7f7f" if row["kind"] == "base" else cmap(i % 20),
            hatch="//" if row["kind"] == "merge" else None,
            edgecolor="white",
        )
    ax.set_xticks(range(len(columns)), columns)
    ax.set_ylabel("test score (95% interval)")
    ax.set_title(f"{results.get('recipe', 'recipe')}: test score per model per stage (merges hatched)")
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    _save_figure(figure, path)


def _save_figure(figure: Any, path: Path) -> None:
    """Save a matplotlib figure atomically (a temporary sibling file, then rename)."""
    with atomic_file(path, "figure") as tmp:
        figure.savefig(tmp, format=path.suffix.lstrip(".") or "png")


def plot_retention(results: dict[str, Any], path: Path) -> bool:
    """Heat map of retention on test: one row per merge, one column per vertical and the mean; undefined cells
    grey and marked ``n/a``.

    Args:
        results (`dict[str, Any]`): The results of a recipe run (``results.json``: ``stages``, ``rows``, ...).
        path (`Path`): The PNG file written.

    Returns:
        `bool`: Whether there was anything to draw (no file is written otherwise).
    """
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
                if (v := (r["retention"]["per_stage"].get(c) if c != "mean" else r["retention"]["mean"]))
                is None
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
    """One stage's merge preview over training: the merged validation average and the agent's own validation score
    per previewed step, beside the agent's training reward (right axis), the kept step marked.

    Args:
        stage (`str`): The stage's name.
        record (`dict[str, Any]`): The stage's preview record (its ``history`` of previewed steps).
        path (`Path`): The PNG file written.
    """
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
        twin.plot(
            *zip(*rewards, strict=True), "^:", color="#7f7f7f", label="agent: training reward (last logged)"
        )
        twin.set_ylabel("training reward")
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize=7, loc="best")
    ax.set_title(f"{stage}: merge preview ({record.get('method', '')}) vs step", fontsize=9)
    figure.tight_layout()
    figure.savefig(path)


def write_results(results: dict[str, Any], out_dir: Path, figures: bool = True) -> list[Path]:
    """Add the statistics (:func:`add_statistics`) and write ``results.json``, ``scores.png`` and
    ``retention.png`` (unless ``figures`` is off) and ``results.md`` into ``out_dir``.

    Args:
        results (`dict[str, Any]`): The results of a recipe run (``results.json``: ``stages``, ``rows``, ...).
        out_dir (`Path`): The directory written to (created if needed).
        figures (`bool`, *optional*, defaults to `True`): Also draw the figures.

    Returns:
        `list[Path]`: The files written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    add_statistics(results)
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
    for stage, record in (results.get("previews") or {}).items() if figures else ():
        if record.get("history"):
            name = f"preview-{stage}.png"
            plot_preview(stage, record, out_dir / name)
            record["figures"] = [name]
            written.append(out_dir / name)
    from ram_trl.analysis import clean

    _atomic_write(out_dir / "results.json", json.dumps(clean(results), indent=2, sort_keys=False) + "\n")
    _atomic_write(out_dir / "results.md", markdown(results))
    return [out_dir / "results.json", out_dir / "results.md", *written]


def print_table(results: dict[str, Any]) -> None:
    """The test table in the terminal (rich; bold green: chosen on validation), then the verdict.

    Args:
        results (`dict[str, Any]`): The results of a recipe run (``results.json``: ``stages``, ``rows``, ...).
    """
    from rich.console import Console
    from rich.table import Table

    if "selection" not in results:
        add_statistics(results)
    stages = results["stages"]
    selection = results["selection"]
    regime = results.get("regime") or {}
    table = Table(
        title=f"{results.get('recipe', 'recipe')}: test scores, 95% intervals (bold: chosen on validation)"
    )
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
            text = _ci(value, intervals.get(key))
            cells.append(f"[bold green]{text}[/]" if selection["columns"].get(key) == row["name"] else text)
        retention = row.get("retention")
        cells.append(_pct_ci(retention["mean"], retention.get("interval")) if retention else "")
        info = regime.get(row["name"]) if row["kind"] == "agent" else None
        cells += (
            [_pct(info["density"]), _pct(info["unique_share"]), _rho(info["rho"])] if info else ["", "", ""]
        )
        kind = row["kind"] + (" (ship)" if row["name"] == selection["ship"] else "")
        table.add_row(row["name"], kind, *cells)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 200)
    console.print(table)
    console.print(results["verdict"])
