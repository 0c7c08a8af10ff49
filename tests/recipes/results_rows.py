"""Hand-made results shared by the tests of the results modules (selection, results_markdown, results_plots,
results): two verticals, four prompts per split, with known averages, retention and choice."""

from __future__ import annotations


def results_row(name: str, kind: str, test: dict, val: dict) -> dict:
    """A results row with per-prompt ``rewards`` per stage on test (``test``) and validation (``val``), and the
    scores they average to."""
    return {
        "name": name,
        "kind": kind,
        "scores": {s: sum(r) / len(r) for s, r in test.items()},
        "rewards": test,
        "val": {"scores": {s: sum(r) / len(r) for s, r in val.items()}, "rewards": val},
    }


def hand_made() -> dict:
    """Two verticals, four prompts per split. m1 is best on validation, m2 on test."""
    return {
        "recipe": "tiny",
        "stages": ["a", "b"],
        "decoding": "greedy decoding",
        "eps": 1e-5,
        "statistics": {"intervals": "bootstrap", "resamples": 500, "seed": 0, "retention_min_gain": 0.02},
        "sweeps": [{"label": "m", "parameters": ["r"], "rows": ["m1", "m2"]}],
        "rows": [
            # test a 0.25, b 0.25 | val a 0.25, b 0.25
            results_row(
                "base", "base", {"a": [0, 0, 1, 0], "b": [0, 1, 0, 0]}, {"a": [0, 0, 0, 1], "b": [0, 0, 1, 0]}
            ),
            # test a 0.75, b 0.25 | val a 0.75, b 0.25
            results_row("A", "agent", {"a": [1, 1, 1, 0], "b": [0, 1, 0, 0]}, {"a": [1, 1, 0, 1], "b": [0, 0, 1, 0]}),
            # test a 0.25, b 1.0 | val a 0.25, b 1.0
            results_row("B", "agent", {"a": [0, 0, 1, 0], "b": [1, 1, 1, 1]}, {"a": [0, 0, 0, 1], "b": [1, 1, 1, 1]}),
            # test a 0.5, b 0.75 (average 0.625) | val a 0.75, b 0.75 (average 0.75)
            results_row("m1", "merge", {"a": [1, 0, 1, 0], "b": [1, 1, 1, 0]}, {"a": [1, 1, 0, 1], "b": [1, 1, 1, 0]}),
            # test a 0.75, b 1.0 (average 0.875) | val a 0.5, b 0.5 (average 0.5)
            results_row("m2", "merge", {"a": [1, 1, 1, 0], "b": [1, 1, 1, 1]}, {"a": [1, 0, 0, 1], "b": [1, 0, 1, 0]}),
        ],
        "specialists": {"a": "A", "b": "B"},
        "regime": {
            "A": {"density": 0.62, "unique_share": 0.08, "rho": 11.1, "lambda": 1.2},
            "B": {"density": 0.71, "unique_share": 0.13, "rho": 6.9, "lambda": 1.2},
        },
    }
