"""What a run's results derive from the scores: intervals, retention, selection, verdict (docs/recipes-results.md)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ram_trl.recipes import stats
from ram_trl.recipes.results_format import ci, fmt3, pct_ci, value_range

__all__ = [
    "SELECTION_RULE",
    "add_statistics",
    "aggregate_seeds",
    "alike",
    "difference",
    "regime_from_analysis",
    "row_average",
    "same_rewards",
    "same_weights",
    "score_samples",
    "select_merges",
    "split_block",
    "val_block",
    "verdict",
]

#: How the merge to ship (and each sweep's value, and each column's bold value) is chosen.
SELECTION_RULE = (
    "the merge with the highest validation average (mean over stages of the validation score); ties go to the "
    "higher mean validation retention, then to the first row. Test scores are never read."
)


def row_average(row: dict[str, Any], stages: list[str]) -> float | None:
    """Mean of a row's scores over ``stages`` it has a score for (``None`` if none)."""
    values = [row["scores"][s] for s in stages if row["scores"].get(s) is not None]
    return sum(values) / len(values) if values else None


def val_block(row: dict[str, Any]) -> dict[str, Any]:
    return row.get("val") or {"scores": {}}


def select_merges(results: dict[str, Any]) -> dict[str, Any]:
    """Choose on the validation split only: the merge to ship, each sweep's value and each column's best merge."""
    stages = results["stages"]
    merges = [r for r in results["rows"] if r["kind"] == "merge"]
    averages = {r["name"]: row_average(val_block(r), stages) for r in merges}
    retention = {r["name"]: (val_block(r).get("retention") or {}).get("mean") for r in merges}

    def pick(names: list[str]) -> str | None:
        scored = {n: averages[n] for n in names if averages.get(n) is not None}
        if not scored:
            return None
        top = max(scored.values())
        tied = [n for n, v in scored.items() if v == top]
        return stats.select_best({n: retention[n] if retention[n] is not None else -math.inf for n in tied})

    columns = {}
    for stage in stages:
        best = stats.select_best({r["name"]: val_block(r)["scores"].get(stage) for r in merges})
        if best is not None:
            columns[stage] = best
    ship = pick([r["name"] for r in merges])
    if ship is not None:
        columns["average"] = ship
    sweeps = [{**sweep, "pick": pick(sweep["rows"])} for sweep in results.get("sweeps") or []]
    return {"rule": SELECTION_RULE, "split": "val", "ship": ship, "columns": columns, "sweeps": sweeps}


def regime_from_analysis(analysis: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per agent, its regime from ``analysis.json``: density, unique share, rho_t and RAM+'s lambda_t."""
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


def split_block(row: dict[str, Any], split: str) -> dict[str, Any]:
    """The scores of ``row`` on ``split`` (its ``val`` block for ``"val"``, added when missing)."""
    return row if split == "test" else row.setdefault("val", {"scores": {}})


def score_samples(results: dict[str, Any], split: str, kind: str) -> dict[str, dict[str, np.ndarray]]:
    """Per row, stage and ``"average"``: the paired bootstrap means (or per-seed values)."""
    stages = results["stages"]
    config = results.get("statistics") or {}
    rows = results["rows"]
    if kind == "seeds":
        out: dict[str, dict[str, np.ndarray]] = {}
        for row in rows:
            per_seed = split_block(row, split).get("per_seed") or {}
            arrays = {s: np.asarray(per_seed[s], dtype=np.float64) for s in stages if per_seed.get(s)}
            if arrays:
                arrays["average"] = np.mean(np.stack(list(arrays.values())), axis=0)
            out[row["name"]] = arrays
        return out
    rewards = {row["name"]: split_block(row, split).get("rewards") or {} for row in rows}
    return stats.bootstrap_scores(
        rewards,
        stages,
        resamples=int(config.get("resamples", stats.RESAMPLES)),
        seed=int(config.get("seed", 0)) + (0 if split == "test" else 1),
    )


def add_statistics(results: dict[str, Any]) -> dict[str, Any]:
    """Add to ``results`` (in place, and return it) everything derived from the scores."""
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
        samples = score_samples(results, split, kind)
        results.setdefault("_samples", {})[split] = samples
        for row in rows:
            block = split_block(row, split)
            block["average"] = row_average(block, stages)
            block["interval"] = {
                column: stats.interval_of(values, kind) for column, values in samples[row["name"]].items()
            }
        if base is None:
            continue
        base_scores = split_block(base, split)["scores"]
        experts = {v: by_name[specialists[v]] for v in stages if specialists.get(v) in by_name}
        for row in rows:
            if row["kind"] == "merge":
                split_block(row, split)["retention"] = _retention(
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
    scores = split_block(row, split)["scores"]
    per_stage: dict[str, float | None] = {}
    for vertical, expert in experts.items():
        values = (scores.get(vertical), base_scores.get(vertical), split_block(expert, split)["scores"].get(vertical))
        per_stage[vertical] = None if None in values else stats.retention(*values, min_gain=min_gain)
    verticals = [v for v, value in per_stage.items() if value is not None]
    interval = None
    needed = [samples[row["name"]], samples[base["name"]], *(samples[experts[v]["name"]] for v in verticals)]
    if verticals and all(v in have for have in needed for v in verticals):
        draws = stats.retention_samples(
            samples[row["name"]], samples[base["name"]], {v: samples[experts[v]["name"]] for v in verticals}, verticals
        )
        interval = stats.interval_of(draws, kind)
    return {
        "per_stage": per_stage,
        "mean": stats.mean_retention(per_stage),
        "interval": interval,
        "verticals": verticals,
    }


def aggregate_seeds(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """The results of one recipe run with several seeds (``ram-trl run --seeds N``), as one results dict."""
    first = runs[0]
    stages = first["stages"]
    for run in runs[1:]:
        if [r["name"] for r in run["rows"]] != [r["name"] for r in first["rows"]] or run["stages"] != stages:
            raise ValueError("the seed runs do not have the same rows and stages")

    def split_block(rows: list[dict[str, Any]], split: str) -> dict[str, Any]:
        blocks = [r if split == "test" else r.get("val") or {"scores": {}} for r in rows]
        per_seed = {
            s: [b["scores"][s] for b in blocks] for s in stages if all(b["scores"].get(s) is not None for b in blocks)
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
        "timings": {f"seed_{s}": (run.get("timings") or {}).get("total") for s, run in zip(seeds, runs, strict=True)},
        "notes": [f"every score is the mean over seeds {', '.join(map(str, seeds))} (runs in seed_S/)"],
        "figures": [],
    }


def same_rewards(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether two results rows have the same reward on every test prompt of every stage."""
    return bool(first.get("rewards")) and first.get("rewards") == second.get("rewards")


def same_weights(first: dict[str, Any], second: dict[str, Any]) -> bool | None:
    """Whether two results rows scored the same model files (their ``model_sha256``); ``None`` when unknown."""
    a, b = first.get("model_sha256"), second.get("model_sha256")
    return None if a is None or b is None else a == b


def alike(first: dict[str, Any], second: dict[str, Any]) -> str:
    """How two rows with the same test rewards relate at the weights: equal rewards are not equal weights."""
    identical = same_weights(first, second)
    if identical is None:
        return "the same reward on every test prompt; whether the weights are the same is not recorded"
    if identical:
        return "the same reward on every test prompt, from identical weights"
    return "the same reward on every test prompt, from different weights"


def difference(results: dict[str, Any], first: str, second: str) -> tuple[float, Any] | None:
    """Test-average difference ``first - second`` with its paired interval."""
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
    found = difference(results, ship, other)
    if found is None:
        return ""
    diff, interval = found
    if interval is None:
        return f"On test it differs from {label} by {diff:+.3f} (no interval: per-prompt rewards are missing)."
    by_name = {row["name"]: row for row in results["rows"]}
    if same_rewards(by_name[ship], by_name[other]):
        return f"On test it scores the same as {label}: {alike(by_name[ship], by_name[other])}."
    if diff == 0 and interval[0] == interval[1] == 0:
        return f"On test it scores the same as {label} in every resample."
    resolved = interval[0] > 0 or interval[1] < 0
    text = f"On test it differs from {label} by {diff:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}] (paired 95%)"
    if resolved:
        return text + f", so it is resolved: {ship} is {'better' if diff > 0 else 'worse'}."
    return text + ": the difference is not resolved at this number of prompts."


REGIME_UNIQUE = 0.2  #: Every agent's unique share at least this: the sparse, heterogeneous regime RAM targets.
AVERAGING_UNIQUE = 0.05  #: Every unique share below this: RAM averages nearly all (task arithmetic at 1/N).


def verdict(results: dict[str, Any]) -> str:
    """One paragraph: the merge to ship, its test average and retention, against the runner-up and the base."""
    selection = results.get("selection") or select_merges(results)
    ship = selection["ship"]
    stages = results["stages"]
    regime = results.get("regime") or {}
    if regime:
        agents = list(regime.values())
        unique = [a.get("unique_share") for a in agents]
        defined = [u for u in unique if u is not None]
        unique_range = value_range(unique, 100, ".0f", "%")
        if defined and all(u >= REGIME_UNIQUE for u in defined):
            judged = (
                "the sparse, heterogeneous regime RAM targets (every unique share at least 20%), where its "
                "rescaling has unique elements to act on."
            )
        elif not defined or max(defined) < AVERAGING_UNIQUE:
            judged = (
                "not the regime RAM targets (unique shares of at least 20%; the paper's 7B agents: 6-48%), "
                "so RAM averages nearly everywhere and behaves like task arithmetic at 1/N."
            )
        else:
            judged = (
                "not the regime RAM targets (unique shares of at least 20%; the paper's 7B agents: 6-48%), but not "
                f"dense either: RAM keeps each agent's unique elements ({unique_range} of its changes) at full "
                "strength and averages the shared rest, between task arithmetic at 1/N and at 1."
            )
        regime_text = (
            f"The agents' task vectors have density {value_range([a.get('density') for a in agents], 100, '.0f', '%')}, "
            f"unique share {unique_range or 'undefined (no active elements)'} and rho "
            f"{value_range([a.get('rho') for a in agents], 1, '.3g') or 'inf'}: " + judged
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
    val_average = row_average(val_block(row), stages)
    text = (
        f"Ship {ship}: it has the highest validation average ({fmt3(val_average)}) of the "
        f"{sum(r['kind'] == 'merge' for r in results['rows'])} merges, and on the held-out test prompts it "
        f"scores {ci(row.get('average'), (row.get('interval') or {}).get('average'))} on average (95% interval)."
    )
    retention = row.get("retention") or {}
    if retention.get("mean") is not None:
        text += (
            f" It keeps {pct_ci(retention['mean'], retention.get('interval'))} of the specialists' gains over "
            f"the base on test (mean retention over {', '.join(retention['verticals'])}"
            + (
                ")."
                if retention.get("interval")
                else "; no interval: the specialists' gains are not resolved in enough resamples)."
            )
        )
    else:
        gain = (results.get("statistics") or {}).get("retention_min_gain", stats.MIN_GAIN)
        text += (
            f" Its retention is undefined: no specialist beat the base on its own test prompts by at least {gain:g}."
        )
    merges = [r for r in results["rows"] if r["kind"] == "merge"]
    others = {r["name"]: row_average(val_block(r), stages) for r in merges if r["name"] != ship}
    tied = [name for name, value in others.items() if value is not None and value == val_average]
    if tied:
        same = [n for n in tied if same_rewards(by_name[n], row)]
        text += (
            f" It ties on validation with {', '.join(tied)}"
            + "".join(f" ({n}: {alike(by_name[n], row)})" for n in same)
            + "; the tie is broken by retention, then row order, so it does not show one method beats the other."
        )
    runner_up = stats.select_best(others)
    if runner_up is not None:
        text += " " + _compare(results, ship, runner_up, f"the runner-up on validation ({runner_up})")
    base = next((r for r in results["rows"] if r["kind"] == "base"), None)
    if base is not None:
        text += " " + _compare(results, ship, base["name"], "the base")
    best_test = stats.select_best({r["name"]: r.get("average") for r in merges})
    if best_test is not None and best_test != ship:
        text += (
            f" {best_test} has the highest test average ({fmt3(by_name[best_test].get('average'))}), but "
            "the choice is made on validation only, so that test scores stay an unbiased estimate."
        )
    averages = {r.get("average") for r in results["rows"]}
    if len(averages) == 1:  # every model the same: nothing was learned, nothing can be chosen
        text = (
            f"Every model scores the same ({fmt3(averages.pop())} on average) on test: this run cannot show "
            "learning or tell the merges apart (a smoke run such as `ram-trl demo --quick` checks that every step "
            "runs, not that RL teaches anything). " + text
        )
    return " ".join(f"{text} {regime_text}".split())
