"""The run directory's layout (ram_trl/recipes/layout.py): where a run's files go, paths resolved against the
recipe's directory, and when a stage counts as finished."""

from __future__ import annotations

from pathlib import Path

from ram_trl.recipes.layout import RunLayout, resolve_path, safe_name, stage_complete
from ram_trl.recipes.runner import RunOptions
from ram_trl.recipes.schema import load_recipe
from tests.helpers import base_tensors, recipe_dict, save_checkpoint


def test_paths_of_a_run(tmp_path):
    """A built base goes to RUN/base_init, a warm-started one to RUN/base; a trained stage's agent to
    RUN/stages/NAME, a given checkpoint stays where the recipe (relative to its directory) puts it."""
    data = recipe_dict(
        stages=[{**recipe_dict()["stages"][0], "name": "trained"}, {"name": "given", "checkpoint": "agents/given"}]
    )
    recipe, _ = load_recipe(data)
    run = RunLayout(recipe, tmp_path / "recipes", tmp_path / "run", RunOptions())
    trained, given = recipe.stages
    assert run.stage_dir(trained) == run.agent_path(trained) == tmp_path / "run" / "stages" / "trained"
    assert run.agent_path(given) == tmp_path / "recipes" / "agents" / "given"
    assert run.base == run.initial_base == tmp_path / "run" / "base_init"
    warm, _ = load_recipe({**data, "warm_start": {"steps": 2, "batch_size": 4}})
    warm_run = RunLayout(warm, tmp_path, tmp_path / "run", RunOptions())
    assert warm_run.base == tmp_path / "run" / "base" and warm_run.initial_base == tmp_path / "run" / "base_init"
    resolved = run.resolved_recipe()
    assert resolved["stages"][1]["checkpoint"] == str(tmp_path / "recipes" / "agents" / "given")
    assert run.eval_tasks() == [] and run.check_tasks() == []  # no prompt files written yet


def test_resolve_path_and_safe_name(tmp_path):
    assert resolve_path("a/../b", tmp_path) == tmp_path / "b"
    assert resolve_path(str(tmp_path / "x"), Path("/elsewhere")) == tmp_path / "x"
    assert resolve_path("~/x", tmp_path) == Path.home() / "x"
    assert safe_name("ram_plus(r=0.1)") == "ram_plus_r=0.1_"
    assert safe_name("task arithmetic/λ") == "task_arithmetic__"
    assert safe_name("dare-ties(lambda=0.5)") == "dare-ties_lambda=0.5_"


def test_a_stage_is_complete_when_its_manifest_names_an_existing_checkpoint(tmp_path):
    from ram_trl.stage.manifest import MANIFEST_NAME, StageManifest, write_manifest

    stage = tmp_path / "stage"
    assert not stage_complete(stage)
    save_checkpoint(stage, base_tensors())
    assert not stage_complete(stage)  # weights without a manifest: an interrupted stage
    (stage / MANIFEST_NAME).write_text("{not json")
    assert not stage_complete(stage)
    write_manifest(StageManifest(stage="s", base_model="b", checkpoint="."), stage)
    assert stage_complete(stage)
    write_manifest(StageManifest(stage="s", base_model="b", checkpoint="elsewhere"), stage)
    assert not stage_complete(stage)  # its checkpoint is not there
