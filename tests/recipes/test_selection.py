"""Golden tests of the statistics and the selection (ram_trl/recipes/selection.py): averages, retention,
intervals, the choice on validation only, the verdict, the regime and the combination of seed runs."""

from __future__ import annotations

import json
import math

import pytest

from ram_trl.recipes.results_markdown import markdown
from ram_trl.recipes.selection import add_statistics, aggregate_seeds, regime_from_analysis, row_average, select_merges
from tests.recipes.results_rows import hand_made, results_row


def test_row_average_skips_missing_scores():
    assert row_average({"scores": {"a": 0.5, "b": None}}, ["a", "b"]) == 0.5
    assert row_average({"scores": {"a": 0.5, "b": 0.7}}, ["a", "b"]) == pytest.approx(0.6)
    assert row_average({"scores": {}}, ["a"]) is None


def test_retention_golden():
    results = add_statistics(hand_made())
    rows = {r["name"]: r for r in results["rows"]}
    # m1 on test: a (0.5 - 0.25) / (0.75 - 0.25) = 0.5, b (0.75 - 0.25) / (1 - 0.25) = 2/3; mean 7/12
    assert rows["m1"]["retention"]["per_stage"] == pytest.approx({"a": 0.5, "b": 2 / 3})
    assert rows["m1"]["retention"]["mean"] == pytest.approx(7 / 12)
    assert rows["m2"]["retention"]["per_stage"] == pytest.approx({"a": 1.0, "b": 1.0})
    # on validation: m1 a (0.75 - 0.25) / 0.5 = 1, b 0.5 / 0.75 = 2/3
    assert rows["m1"]["val"]["retention"]["mean"] == pytest.approx(5 / 6)
    assert "retention" not in rows["A"] and "retention" not in rows["base"]
    low, high = rows["m1"]["retention"]["interval"] or (None, None)
    assert low is None or low <= 7 / 12 <= high


def test_retention_undefined_when_the_specialist_did_not_beat_the_base():
    results = hand_made()
    results["rows"][1] = results_row(
        "A", "agent", {"a": [0, 0, 1, 0], "b": [0, 1, 0, 0]}, {"a": [0, 0, 0, 1], "b": [0, 0, 1, 0]}
    )  # A = base on a
    rows = {r["name"]: r for r in add_statistics(results)["rows"]}
    assert rows["m1"]["retention"]["per_stage"]["a"] is None
    assert rows["m1"]["retention"]["verticals"] == ["b"]
    assert rows["m1"]["retention"]["mean"] == pytest.approx(2 / 3)
    text = json.dumps(results, default=str)
    assert "Infinity" not in text and "NaN" not in text


def test_intervals_cover_the_scores_and_are_deterministic():
    first, second = add_statistics(hand_made()), add_statistics(hand_made())
    for row, again in zip(first["rows"], second["rows"], strict=True):
        assert row["interval"] == again["interval"] and row["val"]["interval"] == again["val"]["interval"]
        for column in ("a", "b", "average"):
            low, high = row["interval"][column]
            value = row["average"] if column == "average" else row["scores"][column]
            assert 0.0 <= low <= value <= high <= 1.0
    # B scores 1 on every b prompt: no spread
    assert first["rows"][2]["interval"]["b"] == (1.0, 1.0)


class Poison(float):
    """A test score that fails the test if the selection reads it."""

    def _fail(self, *args, **kwargs):
        raise AssertionError("the selection read a test score")

    __lt__ = __gt__ = __le__ = __ge__ = __eq__ = __add__ = __radd__ = __float__ = __round__ = _fail
    __hash__ = float.__hash__


def test_selection_reads_validation_only():
    results = hand_made()
    for row in results["rows"]:
        row["scores"] = {s: Poison(v) for s, v in row["scores"].items()}
        row["rewards"] = {s: [Poison(x) for x in r] for s, r in row["rewards"].items()}
        row["average"] = Poison(0.0)
    selection = select_merges(results)
    assert selection["ship"] == "m1"  # best on validation (0.75 vs 0.5), worse on test (0.625 vs 0.875)
    assert selection["columns"] == {"a": "m1", "b": "m1", "average": "m1"}
    assert selection["sweeps"][0]["pick"] == "m1"
    assert selection["split"] == "val"


def test_selection_ignores_test_scores_and_follows_validation():
    results = add_statistics(hand_made())
    swapped = hand_made()
    for row in swapped["rows"]:  # any test scores whatever: the choice stays
        row["scores"] = {s: 1.0 - v for s, v in row["scores"].items()}
        row["rewards"] = {s: [1 - x for x in r] for s, r in row["rewards"].items()}
    assert add_statistics(swapped)["selection"] == results["selection"]
    flipped = hand_made()
    flipped["rows"][3]["val"], flipped["rows"][4]["val"] = (flipped["rows"][4]["val"], flipped["rows"][3]["val"])
    assert add_statistics(flipped)["selection"]["ship"] == "m2"
    assert select_merges(hand_made())["columns"] == {"a": "m1", "b": "m1", "average": "m1"}


def test_no_validation_scores_chooses_nothing():
    results = hand_made()
    for row in results["rows"]:
        row["val"] = {"scores": {}}
    results = add_statistics(results)
    assert results["selection"]["ship"] is None and results["selection"]["columns"] == {}
    assert results["verdict"].startswith("No merge to ship: no merge has validation scores")
    assert "**" not in markdown(results).split("## Test", 1)[1].split("## Selection", 1)[0]


def test_verdict_key_facts():
    results = add_statistics(hand_made())
    text = results["verdict"]
    row = results["rows"][3]
    low, high = row["interval"]["average"]
    assert text.startswith("Ship m1: it has the highest validation average (0.750) of the 2 merges")
    assert f"scores 0.625 [{low:.3f}, {high:.3f}] on average (95% interval)" in text
    assert (
        "It keeps 58% of the specialists' gains over the base on test (mean retention over a, b; no interval" in text
    )
    assert "the runner-up on validation (m2) by -0.250 [" in text and "-0.250" in text
    assert "not resolved" in text  # 4 prompts per stage resolve nothing
    assert "m2 has the highest test average (0.875)" in text
    assert "task vectors have density 62-71%, unique share 8-13% and rho 6.9-11.1: not the regime RAM targets" in text
    assert "\n" not in text


@pytest.mark.parametrize(
    ("shares", "expected"),
    [
        ((0.25, 0.48), "the sparse, heterogeneous regime RAM targets (every unique share at least 20%)"),
        ((0.02, 0.03), "so RAM averages nearly everywhere and behaves like task arithmetic at 1/N."),
        (
            (0.17, 0.34),
            "but not dense either: RAM keeps each agent's unique elements (17-34% of its changes) at full strength "
            "and averages the shared rest, between task arithmetic at 1/N and at 1.",
        ),
        ((None, None), "unique share undefined (no active elements)"),
    ],
)
def test_the_verdict_reads_the_regime_from_the_unique_shares(shares, expected):
    """At least 20% for every agent: RAM's regime; below 5% for every agent: averaging; in between it says what RAM
    keeps and what it averages (a 17%-share agent is not averaged "nearly everywhere")."""
    results = hand_made()
    for agent, share in zip(results["regime"].values(), shares, strict=True):
        agent["unique_share"] = share
    text = add_statistics(results)["verdict"]
    assert expected in text
    averaging = shares[0] is None or max(shares) < 0.05
    assert ("nearly everywhere" in text) == averaging


def test_regime_from_analysis():
    analysis = {
        "agents": [
            {"name": "A", "active": 8, "unique": 2, "density": 0.5, "rho": 3.0, "lambda": {"ram_plus": 1.2}},
            {"name": "B", "active": 0, "unique": 0, "density": 0.0, "rho": "inf", "lambda": {"ram_plus": 1.2}},
        ]
    }
    assert regime_from_analysis(analysis) == {
        "A": {"density": 0.5, "unique_share": 0.25, "rho": 3.0, "lambda": 1.2},
        "B": {"density": 0.0, "unique_share": None, "rho": float("inf"), "lambda": 1.2},
    }


def test_seeds_aggregate_means_and_t_intervals_golden():
    runs = []
    for shift in (0.0, 0.25, 0.5):  # three seeds: each score moved by 0, 0.25, 0.5 on test only
        run = hand_made()
        for row in run["rows"]:
            row["scores"] = {s: v + shift if row["kind"] == "merge" else v for s, v in row["scores"].items()}
        runs.append(run)
    results = aggregate_seeds(runs, [0, 1, 2])
    assert results["statistics"]["intervals"] == "seeds" and results["statistics"]["seeds"] == 3
    results = add_statistics(results)
    m1 = results["rows"][3]
    assert m1["per_seed"]["a"] == [0.5, 0.75, 1.0]
    assert m1["scores"]["a"] == pytest.approx(0.75)
    # sd 0.25 over 3 seeds: 0.75 +/- 4.302653 * 0.25 / sqrt(3)
    half = 4.302653 * 0.25 / math.sqrt(3)
    assert m1["interval"]["a"] == pytest.approx((0.75 - half, 0.75 + half))
    assert results["rows"][0]["interval"]["a"] == pytest.approx((0.25, 0.25))  # the same in every seed
    # retention of m1 on a per seed: 0.5, 1.0, 1.5 -> on b: 2/3, 1, 4/3; mean per seed 7/12, 1, 17/12
    assert m1["retention"]["mean"] == pytest.approx(1.0)
    low, high = m1["retention"]["interval"]
    half = 4.302653 * (5 / 12) / math.sqrt(3)
    assert (low, high) == pytest.approx((1.0 - half, 1.0 + half))
    assert results["selection"]["ship"] == "m1"  # validation is unchanged across seeds
    assert "over 3 seeds" in markdown(results)


def test_the_verdict_names_a_tie_on_validation():
    results = hand_made()
    m1 = next(r for r in results["rows"] if r["name"] == "m1")
    results["rows"].append({**m1, "name": "m3"})  # the same rewards (RAM and RAM+ at r=0 on dense agents)
    text = add_statistics(results)["verdict"]
    assert text.startswith("Ship m1:")
    assert (
        "It ties on validation with m3 (m3: the same reward on every test prompt; whether the weights are the same "
        "is not recorded); the tie is broken by retention, then row order, so it does not show one method beats "
        "the other." in text
    )
    assert "ties on validation" not in add_statistics(hand_made())["verdict"]


@pytest.mark.parametrize(("digest", "said"), [("w1", "from identical weights"), ("w2", "from different weights")])
def test_a_tie_with_the_same_rewards_says_whether_the_weights_are_the_same(digest, said):
    results = hand_made()
    m1 = next(r for r in results["rows"] if r["name"] == "m1")
    m1["model_sha256"] = "w1"
    results["rows"].append({**m1, "name": "m3", "model_sha256": digest})
    text = add_statistics(results)["verdict"]
    assert f"(m3: the same reward on every test prompt, {said})" in text
    assert (
        f"On test it scores the same as the runner-up on validation (m3): the same reward on every test prompt, {said}."
        in text
    )
    # a tie on validation whose test rewards differ prompt by prompt says nothing of the weights
    results = hand_made()
    m1 = next(r for r in results["rows"] if r["name"] == "m1")
    results["rows"].append({**m1, "name": "m3", "rewards": {"a": [0, 1, 0, 1], "b": [1, 1, 1, 0]}})
    text = add_statistics(results)["verdict"]
    assert "It ties on validation with m3;" in text


def test_a_run_where_every_model_scores_the_same_says_it_cannot_show_learning():
    results = hand_made()
    for row in results["rows"]:
        for block in (row["rewards"], row["val"]["rewards"]):
            for stage in block:
                block[stage] = [0, 0, 0, 0]
        row["scores"] = {s: 0.0 for s in row["scores"]}
        row["val"]["scores"] = {s: 0.0 for s in row["val"]["scores"]}
    text = add_statistics(results)["verdict"]
    assert text.startswith(
        "Every model scores the same (0.000 on average) on test: this run cannot show learning or tell the merges "
        "apart (a smoke run such as `ram-trl demo --quick`"
    )
    assert not add_statistics(hand_made())["verdict"].startswith("Every model")
