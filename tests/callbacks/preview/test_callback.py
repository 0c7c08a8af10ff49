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

import pytest

from ram_trl.callbacks.preview import (
    LAST_DIR,
    PREVIEW_PREFIX,
    MergePreviewCallback,
    default_preview_every,
    preview_prompt_indices,
)
from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback
from ram_trl.cli import main as cli
from ram_trl.digest import weights_digest
from ram_trl.errors import ConfigError
from ram_trl.evaluation.retention import retention
from ram_trl.evaluation.scoring import EvalTask, evaluate_model
from ram_trl.evaluation.spec import EvaluationSpec
from ram_trl.stage.manifest import read_manifest
from ram_trl.synthetic import make_base_checkpoint
from tests.helpers import preview_tasks

pytestmark = [pytest.mark.slow]

P = PREVIEW_PREFIX
STEPS = 4
REWARD = "tests.helpers:distinct_chars"
EVALUATION = EvaluationSpec(max_new_tokens=8, batch_size=8)


def previews(trainer) -> list[dict]:
    return [e for e in trainer.state.log_history if f"{P}average" in e]


def test_preview_is_the_merge_of_the_kept_checkpoint(base, first, train, tmp_path):
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
            kept_record["scores"][name], record["base_scores"][name], specialists[name], EVALUATION.retention_min_gain
        )
        key = f"{P}retention/{name}"
        assert logged[kept - 1].get(key) == expected
    # the final ram-trl merge of the manifests is the preview at the kept step, bit for bit ...
    config = tmp_path / "merge.yaml"
    models = [{"stage": str(first)}, {"stage": str(second)}]
    config.write_text(
        json.dumps({"merge_method": "ram_plus", "base_model": str(base), "models": models, "out_dtype": "float32"})
    )
    merged = tmp_path / "merged"
    assert cli(["merge", str(config), str(merged), "--no-progress"]) == 0
    assert weights_digest(merged) == kept_record["merged_sha256"]
    assert kept_record["merge_effect"]["out_dtype"] == "float32"  # written (and scored) in float32
    # ... and its evaluation gives the logged scores to the last digit
    scored = evaluate_model(merged, preview_tasks(), EVALUATION, base=base, progress=False)
    assert scored["scores"] == kept_record["scores"]
    own = evaluate_model(second, [preview_tasks()[1]], EVALUATION, progress=False)
    assert own["scores"]["second"] == kept_record["agent_score"]
    assert weights_digest(second) == kept_record["agent_sha256"]


def test_every_logged_preview_is_the_merge_of_that_step(base, first, train, tmp_path):
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
        {"merge_method": "ram_plus", "base_model": str(base), "models": models, "out_dtype": "float32"},
        merged,
        progress=False,
    )
    assert weights_digest(merged) == callback.history[-1]["merged_sha256"]
    subset = [EvalTask(t.stage, [t.rows[i] for i in indices], t.paths) for t in preview_tasks()]
    scored = evaluate_model(merged, subset, EVALUATION, base=base, progress=False)
    assert scored["scores"] == callback.history[-1]["scores"]
    plain = tmp_path / "plain"
    train(base, plain, TaskVectorSparsityCallback(base_model=base, stage_name="second"), seed=1)
    assert (plain / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()


def test_prior_stage_of_another_base_is_refused(first, tmp_path):
    other = make_base_checkpoint(tmp_path / "other", hidden_size=32, num_layers=2, intermediate_size=64, seed=7)
    with pytest.raises(ConfigError, match="stage 'first' .* was trained from .*not from the merge's base"):
        MergePreviewCallback(base_model=other, prior_stages=[first], stage_name="second", tasks=preview_tasks())


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


def test_default_interval():
    assert [default_preview_every(n) for n in (1, 3, 4, 20, 150)] == [1, 1, 1, 5, 38]
