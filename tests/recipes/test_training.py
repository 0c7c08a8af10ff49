"""``ram_trl.recipes.training``: the telemetry curve of each stage, from its trainer_state.json, into results."""

from __future__ import annotations

import json
import math

from ram_trl.recipes.results import write_results
from ram_trl.recipes.training import TRAINER_STATE, read_training, training_curve
from tests.recipes.results_rows import hand_made

# as TRL logs them: the callback's entry of a step comes before the trainer's own entry (with the reward)
HISTORY = [
    {"step": 1, "task_vector/density": 0.25, "task_vector/density_saved": math.nan},
    {"step": 1, "loss": 0.1, "reward": 0.5},
    {"step": 2, "task_vector/density": 0.5, "task_vector/density_saved": 0.01},
    {"step": 2, "loss": 0.1, "reward": 0.25},
    {"step": 3, "loss": 0.2, "reward": 0.125},  # a trainer log without a measurement
    {"step": 4, "task_vector/density": 0.75, "task_vector/magnitude/gini": 0.3},
    {"step": 4, "train_runtime": 9.0},
    {"step": 0, "task_vector/density": 0.0},  # out of order, before any reward
]


def test_the_curve_keeps_measurements_in_step_order_with_missing_and_non_finite_values_as_none():
    curve = training_curve(HISTORY)
    assert [p["step"] for p in curve] == [0, 1, 2, 4]
    assert [p["density"] for p in curve] == [0.0, 0.25, 0.5, 0.75]
    assert [p["density_saved"] for p in curve] == [None, None, 0.01, None]
    assert [p["reward"] for p in curve] == [None, 0.5, 0.25, 0.125]  # the last reward at or before the step
    assert curve[3]["gini"] == 0.3 and curve[1]["gini"] is None
    assert training_curve(HISTORY, prefix="other/") == []


def test_read_training_skips_stages_without_a_readable_state(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / TRAINER_STATE).write_text(json.dumps({"log_history": HISTORY}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / TRAINER_STATE).write_text("{not json")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / TRAINER_STATE).write_text(json.dumps({"log_history": [{"step": 1, "loss": 0.0}]}))
    stages = {name: tmp_path / name for name in ("a", "b", "c", "missing")}
    assert list(read_training(stages)) == ["a"]


def test_results_show_the_training_section_and_figure(tmp_path):
    results = hand_made()
    results["training"] = {"coding": training_curve(HISTORY)}
    written = write_results(results, tmp_path)
    assert tmp_path / "training.png" in written and (tmp_path / "training.png").stat().st_size > 1000
    text = (tmp_path / "results.md").read_text()
    assert "## During training" in text and "![training](training.png)" in text
    assert "| coding | 4 | 0 | 0.0% | - | 4 | 75.0% | - | 0.125 |" in text
    plain = hand_made()
    write_results(plain, tmp_path / "plain")
    assert "During training" not in (tmp_path / "plain" / "results.md").read_text()
    assert not (tmp_path / "plain" / "training.png").exists()
