"""Does the demo's headline hold across seeds and machines? ``ram-trl demo`` for seeds 0-4, then seed 0 once with
``torch_threads: 1`` and once with ``MKL_CBWR=AVX2`` (other BLAS kernels: what another CPU does), one run after the
other, each in its own process (wall and CPU time measured), and one table over the runs: per vertical the base's and
its specialist's held-out score with 95% bootstrap intervals, the gain with its paired interval, the agent's density
and unique share; per run the merge shipped, its retention, the warm start's steps and acceptance, and the answers of
results.md's mechanism section (RAM minus RAM with the unique region at 1/N, minus task arithmetic chosen on
validation, minus magnitude-matched task arithmetic, each with its paired interval on test).

Target (issue 22): in every run every specialist gains at least +0.15 on its own vertical, interval clear of zero.

    python benchmarks/demo_seeds.py --out /tmp/demo_seeds            # the 7 runs (long: ~7 demos)
    python benchmarks/demo_seeds.py --out /tmp/demo_seeds --quick    # the pipeline at --quick sizes (minutes)
    python benchmarks/demo_seeds.py --out /tmp/demo_seeds --table    # only the table, from the runs that finished

A run whose ``results.json`` exists is not run again (delete its directory to rerun it). Writes
``OUT/demo_seeds.md`` and ``OUT/demo_seeds.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: The gain every specialist should reach on its own vertical, interval clear of zero.
TARGET_GAIN = 0.15

#: name -> (seed, torch_threads override or None, extra environment)
RUNS: dict[str, tuple[int, int | None, dict[str, str]]] = {
    **{f"seed{s}": (s, None, {}) for s in range(5)},
    "seed0-threads1": (0, 1, {}),
    "seed0-mkl-avx2": (0, None, {"MKL_CBWR": "AVX2"}),
}


def _command(out: Path, seed: int, threads: int | None, quick: bool) -> list[str]:
    if threads is None:  # the demo as a user runs it
        return [sys.executable, "-m", "ram_trl", "demo", "--seed", str(seed), "--out", str(out), "--no-progress"] + (
            ["--quick"] if quick else []
        )
    return [sys.executable, __file__, "--child", str(out), "--seed", str(seed), "--threads", str(threads)] + (
        ["--quick"] if quick else []
    )


def child(out: Path, seed: int, threads: int, quick: bool) -> None:
    """The demo with ``torch_threads`` overridden (``ram-trl demo`` has no flag for it).

    Args:
        out: The run directory.
        seed: The run's seed (``ram-trl demo --seed``).
        threads: ``torch_threads``.
        quick: ``--quick`` sizes.
    """
    from ram_trl.recipes import DEMO_RECIPE, QUICK_OVERRIDES, seed_overrides
    from ram_trl.recipes.runner import RunOptions, run_recipe
    from ram_trl.recipes.schema import apply_overrides

    overrides = apply_overrides(QUICK_OVERRIDES if quick else {}, seed_overrides(seed))
    overrides = apply_overrides(overrides, {"torch_threads": threads})
    run_recipe(DEMO_RECIPE, RunOptions(out=out, progress=False, overrides=overrides))


def run_one(name: str, out: Path, quick: bool) -> dict[str, Any]:
    """Run one demo (unless its ``results.json`` exists); its wall and CPU seconds.

    Args:
        name: A key of :data:`RUNS`.
        out: The run directory.
        quick: ``--quick`` sizes.

    Returns:
        ``{"wall_s", "cpu_s", "exit"}`` (``None`` values for a run found finished).
    """
    if (out / "results.json").is_file():
        return {"wall_s": None, "cpu_s": None, "exit": 0}
    seed, threads, env = RUNS[name]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{name}.log", "w", encoding="utf-8") as log:
        code = subprocess.call(
            _command(out, seed, threads, quick), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(cpu, 1), "exit": code}


def summarize(name: str, out: Path) -> dict[str, Any] | None:
    """One finished run's figures (``None`` when it has no ``results.json``).

    Args:
        name: The run's name.
        out: Its directory.

    Returns:
        Per vertical base / specialist / gain with intervals, density and unique share; the merge shipped and its
        retention; the warm start's steps and acceptance; the mechanism comparisons (``question``, ``second``,
        ``difference``, ``interval``) of results.md.
    """
    from ram_trl.recipes import stats
    from ram_trl.recipes.selection import score_samples

    path = out / "results.json"
    if not path.is_file():
        return None
    results = json.loads(path.read_text(encoding="utf-8"))
    kind = results["statistics"].get("intervals", "bootstrap")
    samples = score_samples(results, "test", kind)
    by_name = {row["name"]: row for row in results["rows"]}
    base = by_name["base"]
    verticals = {}
    for stage in results["stages"]:
        agent = by_name[results["specialists"][stage]]
        gain = agent["scores"][stage] - base["scores"][stage]
        interval = stats.interval_of(samples[agent["name"]][stage] - samples["base"][stage], kind)
        regime = results.get("regime", {}).get(agent["name"], {})
        verticals[stage] = {
            "base": base["scores"][stage],
            "base_interval": base["interval"][stage],
            "specialist": agent["scores"][stage],
            "specialist_interval": agent["interval"][stage],
            "gain": gain,
            "gain_interval": list(interval) if interval is not None else None,
            "density": regime.get("density"),
            "unique_share": regime.get("unique_share"),
        }
    ship = results["selection"]["ship"]
    retention = (by_name[ship].get("retention") or {}) if ship else {}
    warm = {}
    record = out / "base" / "ram_warm_start.json"
    if record.is_file():
        data = json.loads(record.read_text(encoding="utf-8"))
        warm = {"steps": data["steps"], "accepted": (data.get("acceptance") or {}).get("accepted")}
    return {
        "name": name,
        "verticals": verticals,
        "ship": ship,
        "retention": retention.get("mean"),
        "retention_interval": retention.get("interval"),
        "warm_start": warm,
        "timings": results.get("timings", {}),
        "mechanism": [
            {key: comparison.get(key) for key in ("question", "second", "difference", "interval")}
            for comparison in (results.get("mechanism") or {}).get("comparisons", [])
        ],
    }


def _ci(value: float | None, interval: Any, spec: str = ".3f") -> str:
    if value is None:
        return "n/a"
    text = f"{value:{spec}}"
    return text + (f" [{interval[0]:{spec}}, {interval[1]:{spec}}]" if interval else "")


def _share(value: float | None, spec: str) -> str:
    return "n/a" if value is None else f"{value:{spec}}"


def meets(vertical: dict[str, Any]) -> bool:
    """Whether a specialist reached the target: gain >= :data:`TARGET_GAIN`, interval clear of zero.

    Args:
        vertical: One vertical of :func:`summarize`.

    Returns:
        ``True`` when both hold.
    """
    interval = vertical["gain_interval"]
    return vertical["gain"] >= TARGET_GAIN and interval is not None and interval[0] > 0


def table(runs: dict[str, dict[str, Any] | None], times: dict[str, dict[str, Any]]) -> str:
    """The markdown report over the runs (missing runs named).

    Args:
        runs: Per run name, :func:`summarize` or ``None``.
        times: Per run name, :func:`run_one`'s times (when run by this invocation).

    Returns:
        Markdown.
    """
    done = {k: v for k, v in runs.items() if v is not None}
    lines = [
        "| run | vertical | base [95% CI] | specialist [95% CI] | gain [95% CI] | target | density | unique |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run in done.items():
        for stage, v in run["verticals"].items():
            lines.append(
                f"| {name} | {stage} | {_ci(v['base'], v['base_interval'])} | "
                f"{_ci(v['specialist'], v['specialist_interval'])} | {_ci(v['gain'], v['gain_interval'], '+.3f')} | "
                f"{'yes' if meets(v) else '**no**'} | {_share(v['density'], '.0%')} | {_share(v['unique_share'], '.1%')} |"
            )
    lines += [
        "",
        "| run | merge shipped | retention [95% CI] | warm start steps | accepted | wall s | CPU s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in done.items():
        t = times.get(name, {})
        lines.append(
            f"| {name} | {run['ship']} | {_ci(run['retention'], run['retention_interval'], '.2f')} | "
            f"{run['warm_start'].get('steps', 'n/a')} | {run['warm_start'].get('accepted')} | "
            f"{t.get('wall_s') or 'n/a'} | {t.get('cpu_s') or 'n/a'} |"
        )
    questions = list(dict.fromkeys(c["question"] for run in done.values() for c in run["mechanism"]))
    if questions:
        lines += [
            "",
            "Mechanism (results.md): RAM minus the merge named in each cell, mean test reward, paired 95% CI.",
            "",
            "| run | " + " | ".join(questions) + " |",
            "|---|" + "---|" * len(questions),
        ]
        for name, run in done.items():
            found = {c["question"]: c for c in run["mechanism"]}
            cells = [
                f"{_ci(found[q]['difference'], found[q]['interval'], '+.3f')} vs {found[q]['second']}"
                if q in found and found[q]["difference"] is not None
                else "n/a"
                for q in questions
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if done:
        lines += ["", "| vertical | gain: median | range | runs meeting the target |", "|---|---|---|---|"]
        stages = next(iter(done.values()))["verticals"]
        for stage in stages:
            gains = [run["verticals"][stage]["gain"] for run in done.values()]
            met = sum(meets(run["verticals"][stage]) for run in done.values())
            lines.append(
                f"| {stage} | {statistics.median(gains):+.3f} | {min(gains):+.3f} .. {max(gains):+.3f} | "
                f"{met} of {len(done)} |"
            )
    missing = [k for k, v in runs.items() if v is None]
    if missing:
        lines += ["", f"Runs missing (not finished): {', '.join(missing)}."]
    lines += ["", f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the demos and write the table.

    Args:
        argv: Command-line arguments.

    Returns:
        The exit code (1 when a run failed).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("demo_seeds_out"))
    parser.add_argument("--quick", action="store_true", help="the demo's --quick sizes")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="runs, in this order")
    parser.add_argument("--table", action="store_true", help="only write the table from finished runs")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child, args.seed, args.threads, args.quick)
        return 0
    times_path = args.out / "times.json"
    times = json.loads(times_path.read_text()) if times_path.is_file() else {}
    failed = []
    for name in args.runs:
        if args.table:
            break
        print(f"{name} ...", flush=True)
        measured = run_one(name, args.out / name, args.quick)
        if measured["wall_s"] is not None:
            times[name] = measured
            args.out.mkdir(parents=True, exist_ok=True)
            times_path.write_text(json.dumps(times, indent=2) + "\n")
        if measured["exit"]:
            failed.append(name)
        print(f"{name}: {measured}", flush=True)
        runs = {n: summarize(n, args.out / n) for n in args.runs}
        (args.out / "demo_seeds.json").write_text(json.dumps({"runs": runs, "times": times}, indent=2) + "\n")
        (args.out / "demo_seeds.md").write_text(table(runs, times))
    runs = {n: summarize(n, args.out / n) for n in args.runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo_seeds.json").write_text(json.dumps({"runs": runs, "times": times}, indent=2) + "\n")
    (args.out / "demo_seeds.md").write_text(table(runs, times))
    print(table(runs, times))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
