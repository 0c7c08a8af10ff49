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
from pathlib import Path

import pytest
from trl import GRPOConfig, GRPOTrainer

from ram_trl.callbacks import TaskVectorSparsityCallback
from ram_trl.cli import main as cli
from ram_trl.errors import ConfigError
from ram_trl.manifest import read_manifest
from ram_trl.preview import LAST_DIR, PREVIEW_PREFIX, MergePreviewCallback, weights_digest
from ram_trl.recipes.evaluate import EvalTask, evaluate_model
from ram_trl.recipes.schema import EvaluationSpec
from ram_trl.recipes.stats import retention
from ram_trl.synthetic import make_base_checkpoint
from tests.helpers import distinct_chars, rl_config, rl_prompts, train_rl

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


def val_rows(tag: str) -> list[dict[str, str]]:
    return [{"prompt": f"{tag}{i}"} for i in range(6)]


def tasks() -> list[EvalTask]:
    return [EvalTask("first", val_rows("a"), [REWARD]), EvalTask("second", val_rows("b"), [REWARD])]


def train(base: Path, out: Path, callback: TaskVectorSparsityCallback, seed: int = 0) -> GRPOTrainer:
    config = rl_config(GRPOConfig, out, max_steps=STEPS, learning_rate=3e-3, seed=seed)
    return train_rl(GRPOTrainer, base, config, callback, distinct_chars, rl_prompts(8))


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
        base_model=base, prior_stages=[first], stage_name="second", tasks=tasks(), evaluation=EVALUATION,
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
    scored = evaluate_model(merged, tasks(), EVALUATION, base=base, progress=False)
    assert scored["scores"] == kept_record["scores"]
    own = evaluate_model(second, [tasks()[1]], EVALUATION, progress=False)
    assert own["scores"]["second"] == kept_record["agent_score"]


def test_every_logged_preview_is_the_merge_of_that_step(base, first, tmp_path):
    """keep='last' with a preview every 3 steps: the last step's checkpoint is left, the preview at the last step is
    its merge, and the previews leave the training untouched (the same agent as a run without them: generation's
    seeding does not leak into the training's random state)."""
    second = tmp_path / "second"
    callback = MergePreviewCallback(
        base_model=base, prior_stages=[first], stage_name="second", tasks=tasks(), evaluation=EVALUATION,
        preview_every=3, keep="last",
    )  # fmt: skip
    trainer = train(base, second, callback, seed=1)
    assert [e["step"] for e in previews(trainer)] == [3, STEPS]
    assert read_manifest(second).extra["preview"]["kept_step"] == STEPS
    assert not (second / LAST_DIR).exists()
    merged = tmp_path / "merged"
    models = [{"stage": str(first)}, {"stage": str(second)}]
    import ram_trl

    ram_trl.merge(
        {"merge_method": "ram_plus", "base_model": str(base), "models": models}, merged, progress=False
    )
    assert weights_digest(merged) == callback.history[-1]["merged_sha256"]
    plain = tmp_path / "plain"
    train(base, plain, TaskVectorSparsityCallback(base_model=base, stage_name="second"), seed=1)
    assert (plain / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()


def test_missing_validation_prompts_are_refused(base, first):
    with pytest.raises(ConfigError, match="stage 'first' has no validation prompts"):
        MergePreviewCallback(
            base_model=base,
            prior_stages=[first],
            stage_name="second",
            tasks=[tasks()[1]],
            evaluation=EVALUATION,
        )
    empty = [EvalTask("first", [], [REWARD]), tasks()[1]]
    with pytest.raises(ConfigError, match="stage 'first' has no validation prompts"):
        MergePreviewCallback(base_model=base, prior_stages=[first], stage_name="second", tasks=empty)
    with pytest.raises(ConfigError, match="stage 'second' has no validation prompts"):
        MergePreviewCallback(base_model=base, prior_stages=[first], stage_name="second", tasks=[tasks()[0]])


def test_prior_stage_of_another_base_is_refused(first, tmp_path):
    other = make_base_checkpoint(
        tmp_path / "other", hidden_size=32, num_layers=2, intermediate_size=64, seed=7
    )
    with pytest.raises(ConfigError, match="stage 'first' .* was trained from .*not from the merge's base"):
        MergePreviewCallback(base_model=other, prior_stages=[first], stage_name="second", tasks=tasks())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"base_model": None}, "needs base_model"),
        ({"stage_name": None}, "needs stage_name"),
        ({"preview_every": 0}, "preview_every=0"),
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
        "tasks": tasks(),
        **kwargs,
    }
    with pytest.raises(ConfigError, match=match):
        MergePreviewCallback(**settings)
