"""MergePreviewCallback in real TRL GRPO runs on a tiny model: the golden equalities and the refusals.

A first stage trains with the telemetry callback; a second trains with the merge preview against it, previewing at
every step. The logged preview must be what the tools say of the same checkpoints: its merged weights are ``ram-trl
merge`` of them bit for bit (SHA-256 of every tensor's bytes), its scores are the evaluation of that merge to the last
digit, the step kept is the argmax of the logged merged average, and the final ``ram-trl merge`` of the two manifests
reproduces the preview at the kept step.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from trl import GRPOConfig, GRPOTrainer

from ram_trl.callbacks import TaskVectorSparsityCallback
from ram_trl.cli import main as cli
from ram_trl.errors import ConfigError
from ram_trl.manifest import read_manifest
from ram_trl.preview import (
    CHECKPOINT_DIR,
    LAST_DIR,
    PREVIEW_PREFIX,
    MergePreviewCallback,
    default_preview_every,
    preview_prompt_indices,
    weights_digest,
)
from ram_trl.recipes.evaluate import EvalTask, evaluate_model
from ram_trl.recipes.schema import EvaluationSpec
from ram_trl.recipes.stats import retention
from ram_trl.synthetic import make_base_checkpoint
from tests.helpers import distinct_chars, preview_tasks, rl_config, rl_prompts, train_rl

pytestmark = [pytest.mark.slow]

P = PREVIEW_PREFIX
STEPS = 4
REWARD = "tests.helpers:distinct_chars"
EVALUATION = EvaluationSpec(max_new_tokens=8, batch_size=8)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_base_checkpoint(
        tmp_path_factory.mktemp("base") / "base", hidden_size=32, num_layers=2, intermediate_size=64
    )


def train(
    base: Path,
    out: Path,
    callback: TaskVectorSparsityCallback,
    seed: int = 0,
    save_steps: int | None = None,
    resume: Path | None = None,
    learning_rate: float = 3e-3,
) -> GRPOTrainer:
    saving = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}
    config = rl_config(GRPOConfig, out, max_steps=STEPS, learning_rate=learning_rate, seed=seed, **saving)
    return train_rl(
        GRPOTrainer, base, config, callback, distinct_chars, rl_prompts(8), resume_from_checkpoint=resume
    )


@pytest.fixture(scope="module")
def first(base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stages") / "first"
    train(base, out, TaskVectorSparsityCallback(base_model=base, stage_name="first"))
    return out


def previews(trainer) -> list[dict]:
    return [e for e in trainer.state.log_history if f"{P}average" in e]


def test_preview_is_the_merge_of_the_kept_checkpoint(base, first, tmp_path):
    second = tmp_path / "second"
    callback = MergePreviewCallback(
        base_model=base, prior_stages=[first], stage_name="second", tasks=preview_tasks(), evaluation=EVALUATION,
        preview_every=1,
    )  # fmt: skip
    trainer = train(base, second, callback, seed=1)
    logged = previews(trainer)
    assert [e["step"] for e in logged] == list(range(1, STEPS + 1))
    # the logged values are the records, through the trainer's metric path
    assert all(record["merge_processes"] == 1 for record in callback.history)
    for entry, record in zip(logged, callback.history, strict=True):
        assert entry[f"{P}average"] == record["average"]
        assert entry[f"{P}score/first"] == record["scores"]["first"]
        assert entry[f"{P}score/second"] == record["scores"]["second"]
        assert entry[f"{P}agent_score"] == record["agent_score"]
        assert entry[f"{P}average"] == math.fsum(record["scores"].values()) / 2
    # the step kept is the argmax of the logged merged average (the earliest of ties)
    averages = [e[f"{P}average"] for e in logged]
    kept = logged[averages.index(max(averages))]["step"]
    manifest = read_manifest(second)
    record = manifest.extra["preview"]
    assert record["kept_step"] == kept == callback.kept_step
    assert record["last_step"] == STEPS and manifest.steps == STEPS
    assert (second / LAST_DIR / "model.safetensors").is_file() == (kept != STEPS)
    assert not (second / ".ram_preview").exists()
    # retention against the base's and the specialists' validation scores, as the recipes compute it
    kept_record = callback.history[kept - 1]
    specialists = {"first": record["specialist_scores"]["first"], "second": kept_record["agent_score"]}
    for name in ("first", "second"):
        expected = retention(
            kept_record["scores"][name],
            record["base_scores"][name],
            specialists[name],
            EVALUATION.retention_min_gain,
        )
        key = f"{P}retention/{name}"
        assert logged[kept - 1].get(key) == expected
    # the final ram-trl merge of the manifests is the preview at the kept step, bit for bit ...
    config = tmp_path / "merge.yaml"
    models = [{"stage": str(first)}, {"stage": str(second)}]
    config.write_text(json.dumps({"merge_method": "ram_plus", "base_model": str(base), "models": models}))
    merged = tmp_path / "merged"
    assert cli(["merge", str(config), str(merged), "--no-progress"]) == 0
    assert weights_digest(merged) == kept_record["merged_sha256"]
    # ... and its evaluation gives the logged scores to the last digit
    scored = evaluate_model(merged, preview_tasks(), EVALUATION, base=base, progress=False)
    assert scored["scores"] == kept_record["scores"]
    own = evaluate_model(second, [preview_tasks()[1]], EVALUATION, progress=False)
    assert own["scores"]["second"] == kept_record["agent_score"]
    assert weights_digest(second) == kept_record["agent_sha256"]


def test_unchanged_weights_are_not_scored_again(base, first, tmp_path, monkeypatch):
    """With a zero learning rate every preview sees the same weights: only the first generates, the others reuse
    its scores (equal digests, seeded evaluation)."""
    import ram_trl.recipes.evaluate as evaluate

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


def test_every_logged_preview_is_the_merge_of_that_step(base, first, tmp_path):
    """keep='last' with a preview every 3 steps: the last step's checkpoint is left, the preview at the last step is
    its merge, and the previews leave the training untouched (the same agent as a run without them: generation's
    seeding does not leak into the training's random state)."""
    second = tmp_path / "second"
    callback = MergePreviewCallback(
        base_model=base, prior_stages=[first], stage_name="second", tasks=preview_tasks(), evaluation=EVALUATION,
        preview_every=3, keep="last", prompts=4,
    )  # fmt: skip
    trainer = train(base, second, callback, seed=1)
    assert [e["step"] for e in previews(trainer)] == [3, STEPS]
    record = read_manifest(second).extra["preview"]
    assert record["kept_step"] == STEPS
    # a seeded subset of 4 of the 6 validation prompts per stage, recorded
    indices = preview_prompt_indices(6, 4, 0)
    assert len(indices) == 4 and indices == sorted(set(indices))
    assert record["prompts"] == {s: {"scored": 4, "of": 6, "indices": indices} for s in ("first", "second")}
    assert not (second / LAST_DIR).exists()
    merged = tmp_path / "merged"
    models = [{"stage": str(first)}, {"stage": str(second)}]
    import ram_trl

    ram_trl.merge(
        {"merge_method": "ram_plus", "base_model": str(base), "models": models}, merged, progress=False
    )
    assert weights_digest(merged) == callback.history[-1]["merged_sha256"]
    subset = [EvalTask(t.stage, [t.rows[i] for i in indices], t.paths) for t in preview_tasks()]
    scored = evaluate_model(merged, subset, EVALUATION, base=base, progress=False)
    assert scored["scores"] == callback.history[-1]["scores"]
    plain = tmp_path / "plain"
    train(base, plain, TaskVectorSparsityCallback(base_model=base, stage_name="second"), seed=1)
    assert (plain / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()


def test_resumed_run_keeps_the_argmax_over_the_whole_run(base, first, tmp_path):
    """A run resumed from its step-2 checkpoint restores the previews of steps 1-2 (and their best checkpoint) from
    the checkpoint: the step kept is the argmax over all four previews, and the final merge of the manifests is the
    preview at that step bit for bit."""

    def callback() -> MergePreviewCallback:
        return MergePreviewCallback(
            base_model=base, prior_stages=[first], stage_name="second", tasks=preview_tasks(), evaluation=EVALUATION,
            preview_every=1,
        )  # fmt: skip

    whole = tmp_path / "whole"
    uninterrupted = callback()
    train(base, whole, uninterrupted, seed=1, save_steps=2)
    saved = json.loads((whole / "checkpoint-2" / CHECKPOINT_DIR / "state.json").read_text())
    assert [h["step"] for h in saved["history"]] == [1, 2]
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(whole / "checkpoint-2", resumed_dir / "checkpoint-2")  # the run stopped after step 2
    resumed = callback()
    trainer = train(base, resumed_dir, resumed, seed=1, save_steps=2, resume=resumed_dir / "checkpoint-2")
    assert [h["step"] for h in resumed.history] == [1, 2, 3, 4]
    assert resumed.history[:2] == uninterrupted.history[:2]  # restored, not re-run
    assert resumed.base_scores == uninterrupted.base_scores
    averages = [h["average"] for h in resumed.history]
    record = read_manifest(resumed_dir).extra["preview"]
    assert record["kept_step"] == averages.index(max(averages)) + 1 == resumed.kept_step
    assert record["resumed_from_step"] == 2 and len(record["history"]) == 4
    assert [e["step"] for e in previews(trainer)] == [1, 2, 3, 4]  # the restored log and the new previews
    kept = resumed.history[record["kept_step"] - 1]
    merged = tmp_path / "merged"
    models = [{"stage": str(first)}, {"stage": str(resumed_dir)}]
    import ram_trl

    ram_trl.merge(
        {"merge_method": "ram_plus", "base_model": str(base), "models": models}, merged, progress=False
    )
    assert weights_digest(merged) == kept["merged_sha256"]


def test_retention_golden(base, first):
    """Retention of a preview record, hand-computed: (0.625 - 0.25) / (0.75 - 0.25) = 0.75 where the specialist
    gained; undefined where it did not (0.5 - 0.5 = 0 < retention_min_gain); the mean over the defined ones."""
    callback = MergePreviewCallback(
        base_model=base,
        prior_stages=[first],
        stage_name="second",
        tasks=preview_tasks(),
        evaluation=EVALUATION,
    )
    callback.base_scores = {"first": 0.25, "second": 0.5}
    callback.specialist_scores = {"first": 0.75}
    record = {"scores": {"first": 0.625, "second": 0.875}, "agent_score": 0.5}
    assert callback.retention(record) == {"first": 0.75, "second": None}
    record["agent_score"] = 0.75  # gain 0.25: (0.875 - 0.5) / 0.25 = 1.5, above the specialist
    assert callback.retention(record) == {"first": 0.75, "second": 1.5}
    from ram_trl.recipes.stats import mean_retention

    assert mean_retention(callback.retention(record)) == 1.125


def test_default_interval_and_prompt_subset():
    assert [default_preview_every(n) for n in (1, 3, 4, 20, 150)] == [1, 1, 1, 5, 38]
    assert preview_prompt_indices(6, None, 0) == preview_prompt_indices(6, 6, 0) == list(range(6))
    assert preview_prompt_indices(128, 32, 0) == preview_prompt_indices(128, 32, 0)  # deterministic
    assert preview_prompt_indices(128, 32, 0) != preview_prompt_indices(128, 32, 1)


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
        MergePreviewCallback(
            base_model=base, prior_stages=[first], stage_name="second", tasks=[preview_tasks()[0]]
        )


def test_prior_stage_of_another_base_is_refused(first, tmp_path):
    other = make_base_checkpoint(
        tmp_path / "other", hidden_size=32, num_layers=2, intermediate_size=64, seed=7
    )
    with pytest.raises(ConfigError, match="stage 'first' .* was trained from .*not from the merge's base"):
        MergePreviewCallback(
            base_model=other, prior_stages=[first], stage_name="second", tasks=preview_tasks()
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"base_model": None}, "needs base_model"),
        ({"stage_name": None}, "needs stage_name"),
        ({"preview_every": 0}, "preview_every=0"),
        ({"prompts": 0}, "prompts=0"),
        ({"keep": "first"}, "keep='first'"),
        ({"method": "nope"}, "nope"),
        ({"parameters": {"r": "x"}}, "r"),
        ({"evaluation": {"max_new_tokens": 0}}, "max_new_tokens"),
    ],
)
def test_bad_arguments(base, first, kwargs, match):
    settings = {
        "base_model": base,
        "prior_stages": [first],
        "stage_name": "second",
        "tasks": preview_tasks(),
        **kwargs,
    }
    with pytest.raises(ConfigError, match=match):
        MergePreviewCallback(**settings)


def test_a_users_output_last_directory_is_never_taken_for_the_previews(tmp_path):
    from ram_trl.manifest import StageManifest, write_manifest
    from ram_trl.preview import check_last_dir

    out = tmp_path / "out"
    out.mkdir()
    assert check_last_dir(out) is False
    (out / "last").mkdir()
    (out / "last" / "notes.txt").write_text("mine\n")
    with pytest.raises(ConfigError, match=rf"{out / 'last'} exists and is not an earlier merge preview's"):
        check_last_dir(out)
    manifest = StageManifest(
        stage="s", base_model="b", checkpoint=".", extra={"preview": {"last_checkpoint": "."}}
    )
    write_manifest(manifest, out)
    with pytest.raises(ConfigError, match="not an earlier merge preview's"):
        check_last_dir(out)  # a preview that kept its last step wrote no last/
    manifest.extra["preview"]["last_checkpoint"] = "last"
    write_manifest(manifest, out)
    assert check_last_dir(out) is True
    assert (out / "last" / "notes.txt").read_text() == "mine\n"
