"""results.md and the terminal table (ram_trl/recipes/results_markdown.py)."""

from __future__ import annotations

from ram_trl.recipes.results_markdown import markdown, print_table
from ram_trl.recipes.selection import add_statistics
from tests.recipes.results_rows import hand_made


def test_markdown_golden_structure():
    text = markdown(add_statistics(hand_made()))
    test_table = text.split("## Test (held-out prompts; reported, never chosen on)\n\n", 1)[1].split("\n\n")[0]
    lines = test_table.splitlines()
    assert lines[0] == "| model | kind | a | b | average | retention | density | unique | rho |"
    assert lines[1] == "|---|---|---:|---:|---:|---:|---:|---:|---:|"
    assert lines[2].startswith("| base | base | 0.250 [")
    assert lines[3].endswith("| 62.0% | 8.0% | 11.1 |")
    assert lines[5].startswith("| m1 | merge (ship) | **0.500 [") and "| 58% |" in lines[5]
    assert lines[6].startswith("| m2 | merge | 0.750 [") and "**" not in lines[6]  # best on test, not chosen
    assert "## Validation (what the choices are made on)" in text
    # retention per vertical; no interval on the mean: 4 prompts do not resolve the specialists' gains
    assert "| m1 | 50% | 67% | 58% | 83% |" in text
    assert "- sweep m (r): m1 chosen on validation among m1, m2" in text
    assert text.rstrip().split("\n\n")[-1] == add_statistics(hand_made())["verdict"]
    assert text.rstrip().split("\n\n")[-2] == "## Verdict"


def test_print_table_shows_the_test_table_and_the_verdict(capsys):
    results = hand_made()
    print_table(results)  # adds the statistics itself
    out = capsys.readouterr().out
    assert "tiny: test scores, 95% intervals (bold: chosen on validation)" in out
    assert "merge (ship)" in out and "62.0%" in out and "11.1" in out
    assert " ".join(out.split()).endswith(" ".join(results["verdict"].split()))


def test_the_legend_explains_bold_and_retention_above_100_percent():
    text = " ".join(markdown(add_statistics(hand_made())).split())
    assert "**Bold**: the merge chosen on the validation split for that column (never the best test score)" in text
    assert "above 100%: the merge beats the specialist on its own vertical" in text


def test_the_training_section_says_how_many_processes_trained_each_stage():
    point = {"step": 2, "reward": 0.5, "density": 0.1, "density_saved": 0.1}
    results = {**hand_made(), "training": {"a": [point], "b": [point]}, "processes": {"a": 1, "b": 2}}
    text = markdown(add_statistics(results))
    assert "Trained: a on 1 process, b on 2 processes." in text
