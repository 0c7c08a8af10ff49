"""Golden tests of the results table from a small hand-made results.json."""

from __future__ import annotations

import json

import pytest

from ram_trl.recipes.results import best_merged, markdown, regime_from_analysis, row_average, write_results


def hand_made() -> dict:
    return {
        "recipe": "tiny",
        "stages": ["a", "b"],
        "decoding": "greedy decoding",
        "eps": 1e-5,
        "rows": [
            {"name": "base", "kind": "base", "scores": {"a": 0.1, "b": 0.2}},
            {"name": "A", "kind": "agent", "scores": {"a": 0.9, "b": 0.1}},
            {"name": "B", "kind": "agent", "scores": {"a": 0.2, "b": 0.8}},
            {"name": "ram", "kind": "merge", "scores": {"a": 0.7, "b": 0.5}},
            {"name": "ta", "kind": "merge", "scores": {"a": 0.6, "b": 0.7}},
            {"name": "ties", "kind": "merge", "scores": {"a": 0.7, "b": None}},
        ],
        "regime": {
            "A": {"density": 0.25, "unique_share": 0.5, "rho": 1.0, "lambda": 1.1},
            "B": {"density": 0.125, "unique_share": 0.0, "rho": float("inf"), "lambda": 1.2},
        },
    }


def test_row_average_skips_missing_scores():
    rows = hand_made()["rows"]
    assert row_average(rows[3], ["a", "b"]) == pytest.approx(0.6)
    assert row_average(rows[5], ["a", "b"]) == 0.7
    assert row_average({"scores": {}}, ["a"]) is None


def test_best_merged_only_among_merges_with_ties():
    # column a: ram 0.7 = ties 0.7 (both best); b: ta 0.7; average: ram 0.6, ta 0.65, ties 0.7 (one stage only).
    assert best_merged(hand_made()) == {"a": 0.7, "b": 0.7, "average": 0.7}


def test_markdown_table_golden():
    table = markdown(hand_made()).split("| model |", 1)[1].split("\n\n", 1)[0]
    assert ("| model |" + table).splitlines() == [
        "| model | kind | a | b | average | density | unique | rho |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        "| base | base | 0.100 | 0.200 | 0.150 |  |  |  |",
        "| A | agent | 0.900 | 0.100 | 0.500 | 25.0% | 50.0% | 1 |",
        "| B | agent | 0.200 | 0.800 | 0.500 | 12.5% | 0.0% | inf |",
        "| ram | merge | **0.700** | 0.500 | 0.600 |  |  |  |",
        "| ta | merge | 0.600 | **0.700** | 0.650 |  |  |  |",
        "| ties | merge | **0.700** | - | **0.700** |  |  |  |",
    ]


def test_regime_from_analysis():
    analysis = {
        "agents": [
            {"name": "A", "active": 8, "unique": 2, "density": 0.5, "rho": 3.0, "lambda": {"ram_plus": 1.2}},
            {
                "name": "B",
                "active": 0,
                "unique": 0,
                "density": 0.0,
                "rho": "inf",
                "lambda": {"ram_plus": 1.2},
            },
        ]
    }
    assert regime_from_analysis(analysis) == {
        "A": {"density": 0.5, "unique_share": 0.25, "rho": 3.0, "lambda": 1.2},
        "B": {"density": 0.0, "unique_share": None, "rho": float("inf"), "lambda": 1.2},
    }


def test_write_results_files(tmp_path):
    data = hand_made()
    data["regime"]["B"]["rho"] = None
    written = write_results(data, tmp_path)
    assert sorted(p.name for p in written) == ["results.json", "results.md", "scores.png"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["average"] for r in saved["rows"]] == pytest.approx([0.15, 0.5, 0.5, 0.6, 0.65, 0.7])
    assert (tmp_path / "scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![scores](scores.png)" in (tmp_path / "results.md").read_text()
    assert not list(tmp_path.glob(".*"))
