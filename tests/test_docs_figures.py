"""The README's figures against their sources: every number it quotes for speed, telemetry cost, the demo and the
SmolLM2 run is recomputed from the table it comes from (BENCHMARKS.md's summary, docs/small-model-rl.md's seven demo
runs, docs/real-model.md's tables), so that a table and a sentence quoting it cannot drift apart. Reads text only."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERTICALS = ("coding", "tools", "memory")


def read(name: str) -> str:
    return (ROOT / name).read_text()


def table(text: str, *headers: str, where: str = "") -> list[dict[str, str]]:
    """The rows of the first Markdown table whose header row holds every one of ``headers`` (after ``where``)."""
    lines = text[text.index(where) :].splitlines() if where else text.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and all(h in cells for h in headers):
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(cells, (c.strip() for c in row.strip().strip("|").split("|")), strict=True)))
            return rows
    raise AssertionError(f"no table with columns {headers} after {where!r}")


def number(cell: str) -> float:
    """The first number of a cell (``**2.63x**`` -> 2.63, ``+0.274 [+0.220, +0.326]`` -> 0.274)."""
    match = re.search(r"[-+]?\d+(\.\d+)?", cell.replace("**", ""))
    assert match, f"no number in {cell!r}"
    return float(match.group())


def close(quoted: float, exact: float, places: int) -> bool:
    return abs(quoted - exact) <= 0.5 * 10**-places + 1e-9


def quotes(text: str, phrase: str) -> bool:
    return phrase in " ".join(text.split())  # across line breaks


# -- merge speed: BENCHMARKS.md's summary table -> README, docs/memory.md ------------------------------------------


@pytest.fixture(scope="module")
def speed() -> dict[str, list[dict[str, str]]]:
    rows = table(read("BENCHMARKS.md"), "ram_plus speedup", "TIES speedup", where="## Summary")
    runs = [r for r in rows if not r["date"].startswith("**")]
    medians = [r for r in rows if r["date"].startswith("**median")]
    assert len(medians) == 1, "the summary table ends with one median row"
    assert f"median of {len(runs)} runs" in medians[0]["date"]
    return {"runs": runs, "median": medians}


COLUMNS = {  # column -> decimals it is written with
    "ram_plus s": 2,
    "TIES s": 2,
    "ram_plus speedup": 2,
    "TIES speedup": 2,
    "peak RSS ram_plus / mergekit": 2,
    "peak RSS TIES / mergekit": 2,
}


def test_the_speed_summary_row_is_the_median_of_the_runs(speed):
    for column, places in COLUMNS.items():
        values = [number(r[column]) for r in speed["runs"]]
        assert close(number(speed["median"][0][column]), statistics.median(values), places), column
    for run in speed["runs"]:  # each speedup is mergekit's median over ram_trl's
        assert close(number(run["ram_plus speedup"]), number(run["mergekit ram s"]) / number(run["ram_plus s"]), 2)
        assert close(number(run["TIES speedup"]), number(run["mergekit TIES s"]) / number(run["TIES s"]), 2)


def test_readme_and_memory_page_quote_the_median_speed_and_its_range(speed):
    runs, median = speed["runs"], speed["median"][0]
    readme, memory = read("README.md"), read("docs/memory.md")
    for column, name in (("ram_plus speedup", "ram_plus"), ("TIES speedup", "TIES")):
        values = [number(r[column]) for r in runs]
        quoted = f"{number(median[column]):.2f}x"
        assert quotes(readme, f"**{quoted}**") and quotes(memory, quoted), f"{name}: {quoted}"
        assert quotes(readme, f"({min(values):.2f}-{max(values):.2f}x"), f"{name}: the range over the runs"
    assert quotes(readme, f"median of {len(runs)} runs") and quotes(memory, f"median of {len(runs)} runs")
    for column in ("peak RSS ram_plus / mergekit", "peak RSS TIES / mergekit"):
        assert quotes(readme, f"{number(median[column]):.2f}x"), column
    for column in ("ram_plus s", "TIES s"):
        assert quotes(memory, f"{number(median[column]):.2f} s"), column


# -- telemetry cost ------------------------------------------------------------------------------------------------


def test_readme_quotes_the_telemetry_cost_of_the_current_machine_type():
    rows = table(read("BENCHMARKS.md"), "measurements", "wall overhead (with the end save)", where="## Summary")
    current = [r for r in rows if "Intel" in r["machine"]]
    shares = [number(r["measurements"]) for r in current]
    readme = read("README.md")
    assert quotes(readme, f"**{min(shares):.1f}-{max(shares):.1f}%**") and quotes(readme, f"{len(current)} runs")
    walls = [
        r["wall overhead (with the end save)"] for r in current if r["wall overhead (with the end save)"][0] == "+"
    ]
    assert len(walls) == 1 and quotes(readme, f"rose {walls[0].lstrip('+')} (1 run)")


# -- the CPU demo: docs/small-model-rl.md's runs over seeds and machines -> README ------------------------------------


@pytest.fixture(scope="module")
def seeds() -> list[dict[str, str]]:
    return table(read("docs/small-model-rl.md"), "run", "vertical", "gain [95% CI]")


def test_readme_demo_table_is_the_seed0_run(seeds):
    readme = read("README.md")
    scores = {r["model"]: r for r in table(readme, "model", "kind", "coding", where="## Results")}
    seed0 = [r for r in seeds if r["run"] == "seed0"]
    assert [r["vertical"] for r in seed0] == list(VERTICALS)
    for row in seed0:
        vertical = row["vertical"]
        base, agent = scores["base"][vertical], scores[vertical][vertical]
        assert base == row["base [95% CI]"] and agent.strip("*") == row["specialist [95% CI]"], vertical
        gain = number(agent) - number(base)
        assert close(gain, number(row["gain [95% CI]"]), 3)
        assert quotes(readme, f"+{gain:.2f}"), f"README's {vertical} gain"


def test_readme_demo_medians_are_the_seed_runs(seeds):
    readme = read("README.md")
    doc_rows = {r["vertical"]: r for r in table(read("docs/small-model-rl.md"), "vertical", "gain: median")}
    runs = sorted({r["run"] for r in seeds})
    all_met = sum(all(r["target"] == "yes" for r in seeds if r["run"] == run) for run in runs)
    assert quotes(readme, f"in {all_met} of {len(runs)} runs")
    for vertical in VERTICALS:
        rows = [r for r in seeds if r["vertical"] == vertical]
        gains = [number(r["gain [95% CI]"]) for r in rows]
        median = f"{statistics.median(gains):+.3f}"
        span = f"{min(gains):+.3f} .. {max(gains):+.3f}"
        met = sum(r["target"] == "yes" for r in rows)
        assert doc_rows[vertical]["gain: median"] == median and doc_rows[vertical]["range"] == span, vertical
        assert doc_rows[vertical]["runs meeting the target"] == f"{met} of {len(runs)}", vertical
        assert quotes(readme, f"{vertical} {median} ({span})"), vertical


# -- the SmolLM2 run: docs/real-model.md -> README -----------------------------------------------------------------


def test_readme_smollm2_gains_are_real_model_tables():
    real, readme = read("docs/real-model.md"), read("README.md")
    # the shipped recipe's stages: revision 8's coding, revision 4's tools, revision 3's memory
    for where, stage in (
        ("## Revision 8", "coding (revision 8)"),
        ("## Revision 4", "tools"),
        ("## Revision 3", "memory"),
    ):
        row = next(r for r in table(real, "stage", "gain [95% interval]", where=where) if r["stage"] == stage)
        gain = row["gain [95% interval]"].strip("*")
        assert quotes(readme, f"{stage.split()[0]} {gain}"), stage
    prompts = re.search(r"(\d+) test prompts", real[real.index("## Revision 8") :])
    assert prompts and quotes(readme, f"{prompts.group(1)} test prompts per vertical")


def test_readme_revision8_merge_figures_are_real_model_tables():
    real, readme = read("docs/real-model.md"), read("README.md")
    where = "### Revision 8's merges"
    scores = table(real, "model", "coding", "tools", "memory", "test mean", where=where)
    ram = next(r for r in scores if r["model"] == "`ram`")
    assert quotes(readme, f"RAM keeps the specialists' scores ({ram['coding']}, {ram['tools']}, {ram['memory']})")
    one_third = next(r for r in scores if r["model"].startswith("`ram_1_over_n`"))
    assert [one_third[v] for v in VERTICALS] == [ram[v] for v in VERTICALS]  # "scores the same"
    differences = table(real, "comparison", "difference [95% interval]", where=where)
    for start in ("RAM - best single agent", "RAM - task arithmetic chosen on validation"):
        row = next(r for r in differences if r["comparison"].startswith(start))
        assert quotes(readme, row["difference [95% interval]"].strip("*")), start
    unique = [
        number(r["unique (no other agent updates it)"])
        for r in table(real, "agent", "unique (no other agent updates it)", where="## Revision 8")
    ]
    assert quotes(readme, f"{min(unique):.1f}-{max(unique):.1f}% unique")


def test_readme_bf16_agent_figures_are_real_model_tables():
    real, readme = read("docs/real-model.md"), read("README.md")
    where = "### Revision 8's agents saved in bf16"
    agents = table(real, "", "float32 agents (above)", "the same agents rounded to bf16", where=where)
    unique = next(r for r in agents if r[""].startswith("unique"))
    assert quotes(readme, f"the same agents are {unique['the same agents rounded to bf16']} unique")
    differences = table(real, "comparison", "difference [95% interval]", where=where)
    for start in ("RAM - RAM with the unique region at 1/3", "RAM - task arithmetic chosen on validation"):
        row = next(r for r in differences if r["comparison"].startswith(start))
        assert quotes(readme, row["difference [95% interval]"].strip("*")), start
