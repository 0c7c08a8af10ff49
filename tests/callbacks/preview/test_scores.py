"""ram_trl/callbacks/preview/scores.py: the prompts a preview scores, retention of a preview, the weights digest, and that
weights scored once are not generated again (in a real TRL GRPO run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ram_trl.callbacks.preview import MergePreviewCallback
from ram_trl.callbacks.preview.scores import preview_prompt_indices, record_retention
from ram_trl.errors import ConfigError
from ram_trl.evaluation.retention import mean_retention
from ram_trl.evaluation.scoring import EvalTask
from ram_trl.evaluation.spec import EvaluationSpec
from tests.helpers import preview_tasks

REWARD = "tests.helpers:distinct_chars"
EVALUATION = EvaluationSpec(max_new_tokens=8, batch_size=8)


def test_prompt_subset():
    assert preview_prompt_indices(6, None, 0) == preview_prompt_indices(6, 6, 0) == list(range(6))
    assert preview_prompt_indices(128, 32, 0) == preview_prompt_indices(128, 32, 0)  # deterministic
    assert preview_prompt_indices(128, 32, 0) != preview_prompt_indices(128, 32, 1)


def test_record_retention_golden():
    """(0.625 - 0.25) / (0.75 - 0.25) = 0.75 where the specialist gained; undefined where it did not (0.5 - 0.5 = 0
    < min_gain); this stage's specialist is the policy (the record's agent_score)."""
    record = {"scores": {"first": 0.625, "second": 0.875}, "agent_score": 0.5}
    base, specialists = {"first": 0.25, "second": 0.5}, {"first": 0.75}
    assert record_retention(record, base, specialists, ["first", "second"], 0.02) == {"first": 0.75, "second": None}
    record["agent_score"] = 0.75  # gain 0.25: (0.875 - 0.5) / 0.25 = 1.5
    assert record_retention(record, base, specialists, ["first", "second"], 0.02) == {"first": 0.75, "second": 1.5}
    assert record_retention(record, base, specialists, ["first", "second"], 0.3) == {"first": 0.75, "second": None}


@pytest.mark.slow
def test_retention_golden(base, first):
    """Retention of a preview record, hand-computed: (0.625 - 0.25) / (0.75 - 0.25) = 0.75 where the specialist
    gained; undefined where it did not (0.5 - 0.5 = 0 < retention_min_gain); the mean over the defined ones."""
    callback = MergePreviewCallback(
        base_model=base, prior_stages=[first], stage_name="second", tasks=preview_tasks(), evaluation=EVALUATION
    )
    callback.base_scores = {"first": 0.25, "second": 0.5}
    callback.specialist_scores = {"first": 0.75}
    record = {"scores": {"first": 0.625, "second": 0.875}, "agent_score": 0.5}
    assert callback.retention(record) == {"first": 0.75, "second": None}
    record["agent_score"] = 0.75  # gain 0.25: (0.875 - 0.5) / 0.25 = 1.5, above the specialist
    assert callback.retention(record) == {"first": 0.75, "second": 1.5}
    assert mean_retention(callback.retention(record)) == 1.125


@pytest.mark.slow
def test_missing_validation_prompts_are_refused(base, first):
    with pytest.raises(ConfigError, match="stage 'first' has no validation prompts"):
        MergePreviewCallback(
            base_model=base,
            prior_stages=[first],
            stage_name="second",
            tasks=[preview_tasks()[1]],
            evaluation=EVALUATION,
        )
    empty = [EvalTask("first", [], [REWARD]), preview_tasks()[1]]
    with pytest.raises(ConfigError, match="stage 'first' has no validation prompts"):
        MergePreviewCallback(base_model=base, prior_stages=[first], stage_name="second", tasks=empty)
    with pytest.raises(ConfigError, match="stage 'second' has no validation prompts"):
        MergePreviewCallback(base_model=base, prior_stages=[first], stage_name="second", tasks=[preview_tasks()[0]])


@pytest.mark.slow
def test_unchanged_weights_are_not_scored_again(base, first, train, tmp_path, monkeypatch):
    """With a zero learning rate every preview sees the same weights: only the first generates, the others reuse
    its scores (equal digests, seeded evaluation)."""
    import ram_trl.evaluation.scoring as evaluate

    calls = []
    real = evaluate.evaluate_model

    def counted(path, *args, **kwargs):
        calls.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(evaluate, "evaluate_model", counted)
    callback = MergePreviewCallback(
        base_model=base, prior_stages=[first], stage_name="second", tasks=preview_tasks(), evaluation=EVALUATION,
        preview_every=2,
    )  # fmt: skip
    train(base, tmp_path / "second", callback, seed=1, learning_rate=0.0)
    assert [h["step"] for h in callback.history] == [2, 4]
    first_preview, second_preview = callback.history
    assert second_preview["merged_sha256"] == first_preview["merged_sha256"]
    assert (second_preview["scores"], second_preview["agent_score"]) == (
        first_preview["scores"],
        first_preview["agent_score"],
    )
    # the references at train begin (base, prior agent), then one preview's merged model and agent
    assert calls == [base.name, "first", "merged", "step-2"]
