"""The mechanism section of a run's results (issue 32, the RAM paper's Fig. 3): does RAM's unique region matter."""

from __future__ import annotations

import math
from typing import Any

from ram_trl.methods import resolve_method
from ram_trl.recipes import stats
from ram_trl.recipes.selection import alike, difference, row_average, same_rewards, score_samples, val_block

__all__ = [
    "MATCHED",
    "MATCH_TOLERANCE",
    "full_ram",
    "matched_lambda",
    "mechanism",
    "mechanism_rows",
    "mechanism_section",
    "task_arithmetic_lambda",
]

MATCH_TOLERANCE = 0.1  #: Task arithmetic is magnitude-matched when its delta's L2 norm is within this share of RAM's.
MATCHED = "matched"  #: ``lambda: matched``: task arithmetic at RAM's L2 norm, resolved after the other merges.


def _method(method: str | None) -> str | None:
    try:
        return resolve_method(method or "")[0].name
    except KeyError:
        return None


def full_ram(method: str | None, parameters: dict[str, Any]) -> bool:
    """Whether a merge is RAM with its unique region at full strength (``unique_scale`` 1)."""
    return _method(method) == "ram" and float(parameters.get("unique_scale", 1.0)) == 1.0


def task_arithmetic_lambda(method: str | None, parameters: dict[str, Any]) -> float | None:
    """A plain (not normalized) task-arithmetic merge's numeric lambda, else ``None``."""
    value = parameters.get("lambda", 1.0)
    if _method(method) != "task_arithmetic" or parameters.get("normalize") or isinstance(value, (str, bool)):
        return None
    return float(value)


def matched_lambda(rows: list[tuple[str | None, dict[str, Any], float | None]]) -> tuple[float, int] | None:
    """TA's lambda at RAM's delta L2 norm, from merges' ``(method, parameters, delta norm)``: scaled (the delta is
    linear in lambda) from the task-arithmetic row whose norm is nearest RAM's; returns it and that row's index."""
    ram = next((norm for method, parameters, norm in rows if full_ram(method, parameters)), None)
    tas = [(i, lam, norm) for i, (m, p, norm) in enumerate(rows) if (lam := task_arithmetic_lambda(m, p)) is not None]
    tas = [t for t in tas if t[2] and math.isfinite(t[2])]
    if not ram or not tas:
        return None
    index, lam, norm = min(tas, key=lambda t: abs(t[2] - ram))
    return lam * ram / norm, index


def _delta_norm(row: dict[str, Any]) -> float | None:
    return ((row.get("effect") or {}).get("delta_norm")) if row else None


def mechanism_rows(results: dict[str, Any]) -> dict[str, Any]:
    """Find the mechanism merges among a run's merge rows."""
    merges = [{**r, "parameters": r.get("parameters") or {}} for r in results["rows"] if r["kind"] == "merge"]
    kind = {r["name"]: _method(r.get("method")) for r in merges}
    n = max(len(results["stages"]), 1)
    found: dict[str, Any] = {"n": n, "unique": {}, "matched_lambda": None, "ta_matched": None}
    ram = [r for r in merges if full_ram(r.get("method"), r["parameters"])]
    scaled = [r for r in merges if kind[r["name"]] == "ram" and float(r["parameters"].get("unique_scale", 1)) < 1]
    tas = [r for r in merges if task_arithmetic_lambda(r.get("method"), r["parameters"]) is not None]
    found["ram"] = ram[0]["name"] if ram else None
    found["ram_1n"] = (
        min(scaled, key=lambda r: abs(float(r["parameters"]["unique_scale"]) - 1 / n))["name"] if scaled else None
    )
    stages = results["stages"]
    found["ta_val"] = stats.select_best({r["name"]: row_average(val_block(r), stages) for r in tas})
    matched = matched_lambda([(r.get("method"), r["parameters"], _delta_norm(r)) for r in merges])
    if matched is not None:
        found["matched_lambda"], index = matched
        ram_norm = _delta_norm(ram[0])
        if abs(_delta_norm(merges[index]) - ram_norm) <= MATCH_TOLERANCE * ram_norm:
            found["ta_matched"] = merges[index]["name"]
    ties = [r for r in merges if kind[r["name"]] == "ties" and float(r["parameters"].get("density", 1)) >= 1]
    found["ties_full"] = ties[0]["name"] if ties else None
    for r in merges:
        if kind[r["name"]] == "ram_unique":
            found["unique"][str(r["parameters"].get("agent"))] = r["name"]
    return found


def _comparison(results: dict[str, Any], question: str, first: str | None, second: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"question": question, "first": first, "second": second, "difference": None}
    if first is None or second is None:
        return entry
    found = difference(results, first, second)
    if found is not None:
        entry["difference"], interval = found
        entry["interval"] = None if interval is None else [float(interval[0]), float(interval[1])]
        by_name = {row["name"]: row for row in results["rows"]}
        if same_rewards(by_name[first], by_name[second]):
            entry["same"] = alike(by_name[first], by_name[second])
    return entry


def mechanism(results: dict[str, Any]) -> dict[str, Any]:
    """The mechanism comparisons of one run, with paired intervals (the verdict's paired samples of the test split)."""
    found = mechanism_rows(results)
    if not any(r["kind"] == "merge" for r in results["rows"]):
        return {**found, "comparisons": [], "missing": []}
    n = found["n"]
    kind = (results.get("statistics") or {}).get("intervals", "bootstrap")
    # the same paired samples as the verdict's (same resamples and seed), present while comparing
    results["_samples"] = {"test": score_samples(results, "test", kind)}
    try:
        comparisons = [
            _comparison(results, "unique region at full strength vs at 1/N", found["ram"], found["ram_1n"]),
            _comparison(results, "RAM vs task arithmetic chosen on validation", found["ram"], found["ta_val"]),
            _comparison(results, "RAM vs magnitude-matched task arithmetic", found["ram"], found["ta_matched"]),
        ]
    finally:
        results.pop("_samples", None)
    missing = []
    if found["ram"] is None:
        missing.append("- ram")
    if found["ram_1n"] is None:
        missing.append(f"- {{method: ram, name: ram_1_over_n, parameters: {{unique_scale: {1 / n:.6g}}}}}")
    if found["ta_val"] is None:
        grid = sorted({round(1 / n, 3), 0.5, 0.75, 1.0, 1.25, 1.5})
        missing.append(f"- {{method: task_arithmetic, parameters: {{lambda: {grid}}}}}")
    if found["ta_matched"] is None:  # lambda: matched resolves after ram and a numeric task-arithmetic row
        missing.append("- {method: task_arithmetic, name: ta_matched, parameters: {lambda: matched}}")
    if found["ties_full"] is None:
        missing.append("- {method: ties, name: ties_density_1, parameters: {density: 1.0}}")
    if not found["unique"]:
        missing += [
            f"- {{method: ram_unique, name: unique_{s}, parameters: {{agent: {s}}}}}" for s in results["stages"]
        ]
    return {**found, "comparisons": comparisons, "missing": missing}


def _answer(entry: dict[str, Any]) -> str:
    first, second, diff = entry["first"], entry["second"], entry["difference"]
    if first is None or second is None:
        return "not measured: the recipe lacks a row (see the entries below)"
    if diff is None:
        return f"{first} vs {second}: not scored"
    interval = entry.get("interval")
    if interval is None:
        return f"{first} - {second} = {diff:+.3f} on test (no interval: per-prompt rewards are missing)"
    text = f"{first} - {second} = {diff:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}] on test (paired 95%)"
    if entry.get("same"):
        return text + f": no difference, {entry['same']}"
    if interval[0] > 0 or interval[1] < 0:
        return text + f": resolved, {first if diff > 0 else second} is better"
    return text + ": not resolved at this number of prompts"


def mechanism_section(results: dict[str, Any]) -> list[str]:
    """``results.md``'s section on RAM's mechanism (empty when the run has no merges)."""
    if "mechanism" not in results:
        results["mechanism"] = mechanism(results)
    found = results["mechanism"]
    if not found or not any(r["kind"] == "merge" for r in results["rows"]):
        return []
    lines = [
        "## Mechanism: does the unique region at full strength matter?",
        "",
        "Test averages, paired over the same resamples of the prompts (the verdict's intervals). 1/N: RAM with each "
        f"agent's unique elements scaled 1/N (N = {found['n']}), the shared mean unchanged. Task arithmetic chosen on "
        "validation: the task-arithmetic row with the highest validation average. Magnitude-matched: the "
        "task-arithmetic row whose merged delta (float32 merge minus base, its L2 norm in the merge report) is within "
        f"{MATCH_TOLERANCE:.0%} of RAM's. How to read it: docs/recipes-results.md.",
        "",
    ]
    for entry in found["comparisons"]:
        lines.append(f"- {entry['question']}: {_answer(entry)}")
    if found.get("ties_full"):
        lines.append(f"- TIES at density 1 (sign election, no trim): row {found['ties_full']}")
    if found.get("unique"):
        lines.append(
            "- each agent's unique region alone: " + ", ".join(f"{a}: {n}" for a, n in found["unique"].items())
        )
    if found.get("matched_lambda"):
        lines.append(
            f"- the task-arithmetic lambda whose merged delta has RAM's L2 norm: {found['matched_lambda']:.4g}"
        )
    lines.append("")
    if found["missing"]:
        lines += [
            "To measure what is missing, add to the recipe's `merges:`",
            "",
            "```yaml",
            *found["missing"],
            "```",
            "",
        ]
    return lines
