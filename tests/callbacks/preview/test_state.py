"""ram_trl/callbacks/preview/state.py: the scratch directory (only the preview's is removed; a user's is refused), the user's
``OUTPUT/last``, keep-best and the preview state a resumed run restores (by hand, and in real TRL GRPO runs)."""

from __future__ import annotations

import json
import shutil

import pytest

from ram_trl.callbacks.preview import MergePreviewCallback
from ram_trl.callbacks.preview.state import (
    CHECKPOINT_DIR,
    STATE_FILE,
    WORK_DIR,
    WORK_MARKER,
    KeptCheckpoints,
    check_last_dir,
    check_work_dir,
    kept_step,
    open_work_dir,
    read_state,
    remove_work_dir,
    restore_state,
    save_state,
)
from ram_trl.digest import weights_digest
from ram_trl.errors import ConfigError
from ram_trl.evaluation.spec import EvaluationSpec
from ram_trl.stage.manifest import StageManifest, read_manifest, write_manifest
from tests.helpers import preview_tasks

EVALUATION = EvaluationSpec(max_new_tokens=8, batch_size=8)


def test_the_scratch_directory_is_marked_and_only_a_marked_one_is_removed(tmp_path):
    work = tmp_path / WORK_DIR
    check_work_dir(work)  # none yet
    assert open_work_dir(work) == work and sorted(p.name for p in work.iterdir()) == [WORK_MARKER]
    (work / "step-1").mkdir()
    (work / "step-1" / "model.safetensors").write_bytes(b"x")
    check_work_dir(work)  # an earlier preview's: taken over
    open_work_dir(work)
    assert sorted(p.name for p in work.iterdir()) == [WORK_MARKER]  # emptied, marked again
    remove_work_dir(work)
    assert not work.exists()
    work.mkdir()  # an empty directory is adopted ...
    open_work_dir(work)
    assert (work / WORK_MARKER).is_file()


def test_a_users_scratch_directory_is_refused_and_never_removed(tmp_path):
    work = tmp_path / WORK_DIR
    work.mkdir()
    (work / "notes.txt").write_text("mine\n")
    with pytest.raises(ConfigError, match=rf"^{work} exists and is not a merge preview's scratch directory"):
        check_work_dir(work)
    with pytest.raises(ConfigError, match="not a merge preview's scratch directory"):
        open_work_dir(work)
    remove_work_dir(work)  # not the preview's: left as it is
    assert (work / "notes.txt").read_text() == "mine\n"
    shutil.rmtree(work)
    work.write_text("a file\n")
    with pytest.raises(ConfigError, match="not a merge preview's scratch directory"):
        check_work_dir(work)
    remove_work_dir(work)
    assert work.read_text() == "a file\n"


@pytest.mark.slow
def test_a_users_scratch_directory_survives_a_preview_run(base, first, train, tmp_path):
    """A run whose output directory holds a ``.ram_preview`` the preview did not create stops at train begin with
    one line naming it, and the user's file is untouched."""
    out = tmp_path / "second"
    (out / WORK_DIR).mkdir(parents=True)
    (out / WORK_DIR / "notes.txt").write_text("mine\n")
    callback = MergePreviewCallback(
        base_model=base, prior_stages=[first], stage_name="second", tasks=preview_tasks(), evaluation=EVALUATION
    )
    with pytest.raises(ConfigError, match=rf"^{out / WORK_DIR} exists and is not a merge preview's scratch") as err:
        train(base, out, callback)
    assert "\n" not in str(err.value)
    assert (out / WORK_DIR / "notes.txt").read_text() == "mine\n"


def test_keep_best_keeps_the_best_and_the_last_and_deletes_the_others(tmp_path):
    steps = {}
    for step in (1, 2, 3, 4):
        steps[step] = tmp_path / f"step-{step}"
        steps[step].mkdir()
    kept = KeptCheckpoints()
    kept.add(steps[1], 0.5)
    assert (kept.best, kept.last, kept.best_average) == (steps[1], steps[1], 0.5)
    kept.add(steps[2], 0.25)  # worse: kept as the last only
    assert (kept.best, kept.last) == (steps[1], steps[2])
    kept.add(steps[3], 0.5)  # equal to the best: the earliest stays the best; step 2 is neither now
    assert (kept.best, kept.last) == (steps[1], steps[3])
    assert not steps[2].exists() and steps[1].exists() and steps[3].exists()
    kept.add(steps[4], 0.75)  # better: steps 1 and 3 go
    assert (kept.best, kept.last, kept.directories()) == (steps[4], steps[4], {steps[4]})
    assert [p.name for p in tmp_path.iterdir()] == ["step-4"]


def test_kept_step_is_the_earliest_best_or_the_last():
    history = [{"step": 2, "average": 0.5}, {"step": 4, "average": 0.75}, {"step": 6, "average": 0.75}]
    assert kept_step(history, "best") == 4
    assert kept_step(history, "last") == 6


def test_saved_state_round_trip_and_other_settings_refused(tmp_path, caplog):
    work = open_work_dir(tmp_path / WORK_DIR)
    kept = KeptCheckpoints()
    for step, average in ((1, 0.75), (2, 0.25)):
        (work / f"step-{step}").mkdir()
        (work / f"step-{step}" / "model.safetensors").write_bytes(bytes([step]))
        kept.add(work / f"step-{step}", average)
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    history = [{"step": 1, "average": 0.75}, {"step": 2, "average": 0.25}]
    settings = {"method": "ram_plus", "seed": 0}
    saved = {"settings": settings, "history": history, "base_scores": {"a": 0.1}, "reference_seconds": 1.5}
    save_state(checkpoint, kept, saved)
    written = json.loads((checkpoint / CHECKPOINT_DIR / STATE_FILE).read_text())
    assert list(written) == ["settings", "history", "best", "last", "base_scores", "reference_seconds"]
    assert (written["best"], written["last"]) == ("step-1", "step-2")
    assert (checkpoint / CHECKPOINT_DIR / "step-1" / "model.safetensors").read_bytes() == bytes([1])
    state = read_state(checkpoint, 2, settings)
    assert state["history"] == history and state["folder"] == str(checkpoint / CHECKPOINT_DIR)
    restored_dir = open_work_dir(tmp_path / "resumed" / WORK_DIR)
    restored = restore_state(state, restored_dir, link=True)
    assert (restored.best, restored.last, restored.best_average) == (
        restored_dir / "step-1",
        restored_dir / "step-2",
        0.75,
    )
    assert (restored_dir / "step-2" / "model.safetensors").read_bytes() == bytes([2])
    with pytest.raises(ConfigError, match=rf"the checkpoint {checkpoint} was previewed with other settings"):
        read_state(checkpoint, 2, {**settings, "seed": 1})
    assert read_state(tmp_path / "checkpoint-9", 9, settings) is None
    assert "without a preview state" in caplog.text


def test_a_users_output_last_directory_is_never_taken_for_the_previews(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert check_last_dir(out) is False
    (out / "last").mkdir()
    (out / "last" / "notes.txt").write_text("mine\n")
    with pytest.raises(ConfigError, match=rf"{out / 'last'} exists and is not an earlier merge preview's"):
        check_last_dir(out)
    manifest = StageManifest(stage="s", base_model="b", checkpoint=".", extra={"preview": {"last_checkpoint": "."}})
    write_manifest(manifest, out)
    with pytest.raises(ConfigError, match="not an earlier merge preview's"):
        check_last_dir(out)  # a preview that kept its last step wrote no last/
    manifest.extra["preview"]["last_checkpoint"] = "last"
    write_manifest(manifest, out)
    assert check_last_dir(out) is True
    assert (out / "last" / "notes.txt").read_text() == "mine\n"


@pytest.mark.slow
def test_resumed_run_keeps_the_argmax_over_the_whole_run(base, first, train, tmp_path):
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
    saved = json.loads((whole / "checkpoint-2" / CHECKPOINT_DIR / STATE_FILE).read_text())
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
    logged = [e for e in trainer.state.log_history if "merge_preview/average" in e]
    assert [e["step"] for e in logged] == [1, 2, 3, 4]  # the restored log and the new previews
    kept = resumed.history[record["kept_step"] - 1]
    merged = tmp_path / "merged"
    models = [{"stage": str(first)}, {"stage": str(resumed_dir)}]
    import ram_trl

    ram_trl.merge(
        {"merge_method": "ram_plus", "base_model": str(base), "models": models, "out_dtype": "float32"},
        merged,
        progress=False,
    )
    assert weights_digest(merged) == kept["merged_sha256"]
