"""The mechanism section of results (ram_trl.recipes.mechanism): which rows answer the questions, the paired
differences and their intervals, and the YAML entries a recipe lacks."""

from __future__ import annotations

import numpy as np
import pytest

from ram_trl.recipes import stats
from ram_trl.recipes.mechanism import matched_lambda, mechanism, mechanism_rows
from ram_trl.recipes.results_markdown import markdown
from ram_trl.recipes.selection import add_statistics
from tests.recipes.results_rows import hand_made, results_row


def _merge(name, method, parameters, test, val, norm=None):
    row = results_row(name, "merge", test, val)
    row.update(method=method, parameters=parameters)
    if norm is not None:
        row["effect"] = {"delta_norm": norm}
    return row


def _with_mechanism_rows() -> dict:
    results = hand_made()
    results["rows"] = [r for r in results["rows"] if r["kind"] != "merge"]
    same = {"a": [1, 0, 1, 0], "b": [1, 1, 1, 0]}
    results["rows"] += [
        # RAM: test a 0.75, b 1.0; its delta norm 2.0
        _merge("ram", "ram", {}, {"a": [1, 1, 1, 0], "b": [1, 1, 1, 1]}, same, 2.0),
        # RAM with the unique region at 1/2 (N = 2): test a 0.5, b 0.75
        _merge("ram_half", "ram", {"unique_scale": 0.5}, same, same, 1.5),
        # TA at lambda 0.5 and 1 (norms 1 and 2): 1.0 is best on validation and matches RAM's norm
        _merge(
            "ta(lambda=0.5)", "task_arithmetic", {"lambda": 0.5}, same, {"a": [0, 0, 0, 0], "b": [0, 0, 0, 0]}, 1.0
        ),
        _merge("ta(lambda=1)", "ta", {"lambda": 1.0}, {"a": [1, 1, 1, 0], "b": [1, 1, 1, 1]}, same, 2.1),
        _merge("ties_d1", "ties", {"density": 1.0}, same, same),
        _merge("unique_a", "ram_unique", {"agent": "a"}, same, same),
    ]
    return results


def test_rows_are_found_by_method_and_parameters():
    found = mechanism_rows(_with_mechanism_rows())
    assert (found["ram"], found["ram_1n"], found["ta_val"]) == ("ram", "ram_half", "ta(lambda=1)")
    # nearest norm to RAM's 2.0 is lambda 1's 2.1 (within 10%); the matched lambda is 1 * 2.0 / 2.1
    assert found["ta_matched"] == "ta(lambda=1)"
    assert found["matched_lambda"] == pytest.approx(2.0 / 2.1)
    assert found["ties_full"] == "ties_d1" and found["unique"] == {"a": "unique_a"}


def test_paired_differences_use_the_bootstrap_resamples_of_the_prompts():
    results = add_statistics(_with_mechanism_rows())
    results["mechanism"] = mechanism(results)
    first = results["mechanism"]["comparisons"][0]
    assert (first["first"], first["second"]) == ("ram", "ram_half")
    # test averages 0.875 and 0.625; the paired interval from the same resamples of each stage's four prompts
    assert first["difference"] == pytest.approx(0.25)
    samples = stats.bootstrap_scores(
        {r["name"]: r["rewards"] for r in results["rows"]}, ["a", "b"], resamples=500, seed=0
    )
    expected = stats.interval_of(samples["ram"]["average"] - samples["ram_half"]["average"], "bootstrap")
    assert first["interval"] == pytest.approx(list(expected))
    assert np.isfinite(first["interval"]).all()
    # RAM vs the TA chosen on validation: the same test rewards, a zero difference in every resample
    second = results["mechanism"]["comparisons"][1]
    assert second["difference"] == 0 and second["interval"] == [0, 0]
    assert not results["mechanism"]["missing"]
    text = markdown(results)
    assert "## Mechanism: does the unique region at full strength matter?" in text
    assert "ram - ram_half = +0.250" in text
    assert "ram - ta(lambda=1) = +0.000 [+0.000, +0.000] on test (paired 95%): no difference, the same reward" in text


@pytest.mark.parametrize(
    ("digests", "said"),
    [
        (("w1", "w2"), "no difference, the same reward on every test prompt, from different weights"),
        (("w1", "w1"), "no difference, the same reward on every test prompt, from identical weights"),
        ((None, "w1"), "no difference, the same reward on every test prompt; whether the weights are the same is not"),
    ],
)
def test_equal_rewards_are_told_apart_from_equal_weights(digests, said):
    results = _with_mechanism_rows()
    by_name = {r["name"]: r for r in results["rows"]}
    by_name["ram"]["model_sha256"], by_name["ta(lambda=1)"]["model_sha256"] = digests
    results = add_statistics(results)
    results["mechanism"] = mechanism(results)
    assert f"ram - ta(lambda=1) = +0.000 [+0.000, +0.000] on test (paired 95%): {said}" in markdown(results)
    # rewards that differ on some prompts but average the same are not "the same reward"
    by_name = {r["name"]: r for r in results["rows"]}
    by_name["ta(lambda=1)"]["rewards"] = {"a": [1, 1, 0, 1], "b": [1, 1, 1, 1]}
    results.pop("mechanism")
    results["mechanism"] = mechanism(results)
    assert "no difference" not in markdown(results)


def test_missing_rows_are_named_as_yaml_entries():
    results = add_statistics(hand_made())  # merges m1, m2 only: no mechanism rows
    results["mechanism"] = mechanism(results)
    missing = results["mechanism"]["missing"]
    assert "- ram" in missing
    assert "- {method: ram, name: ram_1_over_n, parameters: {unique_scale: 0.5}}" in missing
    assert "- {method: task_arithmetic, parameters: {lambda: [0.5, 0.75, 1.0, 1.25, 1.5]}}" in missing
    assert "- {method: ram_unique, name: unique_b, parameters: {agent: b}}" in missing
    assert "- {method: task_arithmetic, name: ta_matched, parameters: {lambda: matched}}" in missing
    assert all(c["difference"] is None for c in results["mechanism"]["comparisons"])
    assert "add to the recipe's `merges:`" in markdown(results)


def test_matched_lambda_scales_the_nearest_norm_linearly():
    # RAM's norm 2.0; TA rows (lambda, norm): 0.5 -> 1.0 and 1.0 -> 2.1 (nearest); the delta is linear in lambda
    ram, half, full = ("ram", {}, 2.0), ("ta", {"lambda": 0.5}, 1.0), ("task_arithmetic", {"lambda": 1.0}, 2.1)
    assert matched_lambda([ram, half, full]) == (pytest.approx(2.0 / 2.1), 2)
    # a RAM at 1/N, a normalized TA, a zero or missing norm and lambda: matched itself are not used
    others = [("ram", {"unique_scale": 0.5}, 2.0), ("ta", {"lambda": 1.0, "normalize": True}, 2.0)]
    others += [("ta", {"lambda": 2.0}, 0.0), ("ta", {"lambda": 3.0}, None), ("ta", {"lambda": "matched"}, 2.0)]
    assert matched_lambda([*others, ram, half]) == (pytest.approx(1.0), 6)
    assert matched_lambda([half, full]) is None and matched_lambda([ram, *others]) is None


def test_rows_without_parameters_are_read_as_defaults():
    results = _with_mechanism_rows()
    for row in results["rows"]:
        if row["kind"] == "merge" and not row["parameters"]:
            row["parameters"] = None  # as a hand-written or older results.json may hold them
    found = mechanism_rows(results)
    assert (found["ram"], found["ram_1n"], found["ties_full"]) == ("ram", "ram_half", "ties_d1")


def test_a_run_without_merges_or_stages_has_no_mechanism_section():
    results = add_statistics({"recipe": "t", "stages": [], "rows": []})
    results["mechanism"] = mechanism(results)
    assert results["mechanism"]["comparisons"] == [] and results["mechanism"]["missing"] == []
    assert "Mechanism" not in markdown(results)
