"""The recipe schema: errors that say what to change, methods, sweeps, overrides, preview and split settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from ram_trl.errors import ConfigError
from ram_trl.recipes import DEMO_RECIPE
from ram_trl.recipes.schema import DEFAULT_METHODS, apply_overrides, expand_merges, load_recipe
from tests.helpers import check_recipe, recipe_dict

REPO = Path(__file__).resolve().parents[2]


def test_minimal_recipe_is_valid_with_the_default_methods():
    parsed, _ = load_recipe(recipe_dict())
    assert [row.name for row in expand_merges(parsed)] == list(DEFAULT_METHODS)
    assert check_recipe(recipe_dict()) == []


def test_sweeps_expand_to_one_row_per_point():
    data = recipe_dict(
        merges=["ram", {"method": "ram_plus", "parameters": {"r": [0, 0.05], "alpha": [1, 2.5], "eps": 0}}]
    )
    rows = expand_merges(load_recipe(data)[0])
    assert [(r.name, r.parameters) for r in rows] == [
        ("ram", {}),
        ("ram_plus(r=0,alpha=1)", {"eps": 0, "r": 0, "alpha": 1}),
        ("ram_plus(r=0,alpha=2.5)", {"eps": 0, "r": 0, "alpha": 2.5}),
        ("ram_plus(r=0.05,alpha=1)", {"eps": 0, "r": 0.05, "alpha": 1}),
        ("ram_plus(r=0.05,alpha=2.5)", {"eps": 0, "r": 0.05, "alpha": 2.5}),
    ]
    named = recipe_dict(merges=[{"method": "ties", "name": "ties20", "parameters": {"density": [0.2]}}])
    assert [r.name for r in expand_merges(load_recipe(named)[0])] == ["ties20(density=0.2)"]


def test_bad_sweeps_are_refused():
    with pytest.raises(ConfigError, match=r"merges\.0\.parameters: .*'r' sweeps an empty list"):
        load_recipe(recipe_dict(merges=[{"method": "ram_plus", "parameters": {"r": []}}]))
    with pytest.raises(ConfigError, match="'r': give a value or a list of values"):
        load_recipe(recipe_dict(merges=[{"method": "ram_plus", "parameters": {"r": {"a": 1}}}]))
    with pytest.raises(ConfigError, match="two entries make the row 'ram'; give one of them a 'name:'"):
        load_recipe(recipe_dict(merges=["ram", "ram"]))


def test_unknown_method_and_parameter_are_named():
    with pytest.raises(ConfigError, match="merge 'ram_minus'") as info:
        check_recipe(recipe_dict(merges=["ram_minus"]))
    assert "ram_minus" in str(info.value)
    with pytest.raises(ConfigError, match="merge 'ram_plus': method 'ram_plus' has no parameter 'beta'"):
        check_recipe(recipe_dict(merges=[{"method": "ram_plus", "parameters": {"beta": 1}}]))


def test_methods_check_how_many_stages_they_merge():
    one_stage = recipe_dict(
        merges=["slerp", "breadcrumbs", {"method": "breadcrumbs_ties", "parameters": {"gamma": 0.05}}]
    )
    assert check_recipe(one_stage) == []
    two_stages = recipe_dict(merges=["slerp", "breadcrumbs"])
    two_stages["stages"].append({**two_stages["stages"][0], "name": "math"})
    with pytest.raises(ConfigError, match="merge 'slerp': method 'slerp' merges exactly 1 model") as info:
        check_recipe(two_stages)
    assert "breadcrumbs" not in str(info.value)


def test_schema_errors_say_what_to_change(tmp_path):
    with pytest.raises(ConfigError, match="base: give exactly one of 'path: CHECKPOINT_DIR', 'gguf: FILE_OR_WHEEL'"):
        load_recipe(recipe_dict(base={"path": "x"}))
    with pytest.raises(ConfigError, match="base: give exactly one of"):
        load_recipe(recipe_dict(base={"build": None, "path": "x", "gguf": "m.gguf"}))
    with pytest.raises(ConfigError, match="base: 'gguf_member' applies to 'gguf: ARCHIVE'"):
        load_recipe(recipe_dict(base={"gguf_member": "a/m.gguf"}))
    gguf = load_recipe(recipe_dict(base={"build": None, "gguf": "m.whl", "gguf_member": "a/m.gguf"}))[0].base
    assert (gguf.gguf, gguf.gguf_member, gguf.gguf_dtype, gguf.build) == ("m.whl", "a/m.gguf", "bfloat16", None)
    with pytest.raises(ConfigError, match="stage name 'coding' is used twice"):
        data = recipe_dict()
        data["stages"] = data["stages"] * 2
        load_recipe(data)
    with pytest.raises(ConfigError, match="a trained stage needs 'rewards:"):
        load_recipe(recipe_dict(stages={"*": {"rewards": []}}))
    with pytest.raises(ConfigError, match="stages.0.trainer"):
        load_recipe(recipe_dict(stages={"*": {"trainer": "ppo"}}))
    with pytest.raises(ConfigError, match="unknown field 'stages.0.learning_rate'"):
        load_recipe(recipe_dict(stages={"*": {"learning_rate": 1}}))
    file = tmp_path / "r.yaml"
    file.write_text("- a list\n")
    with pytest.raises(ConfigError, match=f"recipe {file}: expected a mapping"):
        load_recipe(file)
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")


def test_overrides_update_every_stage():
    data = apply_overrides(recipe_dict(), {"stages": {"*": {"config": {"max_steps": 7}}}, "seed": 3})
    assert data["seed"] == 3
    assert data["stages"][0]["config"] == {"max_steps": 7, "per_device_train_batch_size": 4, "num_generations": 4}


def test_repository_demo_recipe_is_the_package_data():
    assert (REPO / "recipes" / "demo-cpu.yaml").read_bytes() == DEMO_RECIPE.read_bytes()


def test_paper_recipe_uses_the_papers_agents_and_ram_plus_defaults():
    parsed, _ = load_recipe(REPO / "recipes" / "qwen2.5-7b-paper-agents.yaml")
    assert parsed.base.hub_id == "Qwen/Qwen2.5-7B-Instruct"
    assert [s.hub_id for s in parsed.stages] == [
        "Gen-Verse/ReasonFlux-Coder-7B",
        "emrecanacikgoz/Qwen2.5-7B-Instruct-ToolRL-grpo-cold",
        "BytedTsinghua-SIA/RL-MemoryAgent-7B",
    ]
    rows = {r.name: r for r in expand_merges(parsed)}
    assert rows["ram_plus"].parameters == {"r": 0.1, "alpha": 2.0}
    assert not any(s.trained for s in parsed.stages)


def test_validation_split_settings():
    parsed, _ = load_recipe(recipe_dict())
    prompts = parsed.stages[0].prompts
    assert (prompts.val_size, prompts.validation_size) == (None, 64)  # default: as many as eval_size
    parsed, _ = load_recipe(recipe_dict(stages={"*": {"prompts": {"val_size": 16, "eval_size": 32}}}))
    assert parsed.stages[0].prompts.validation_size == 16
    evaluation = parsed.evaluation
    assert (evaluation.bootstrap_resamples, evaluation.bootstrap_seed, evaluation.retention_min_gain) == (
        2000,
        0,
        0.02,
    )
    with pytest.raises(ConfigError, match="give either 'generator:' or 'train_file:'/'eval_file:'/'val_file:'"):
        load_recipe(recipe_dict(stages={"*": {"prompts": {"val_file": "v.jsonl"}}}))
    files = {"prompts": {"generator": None, "train_file": "t.jsonl", "val_size": 8}}
    with pytest.raises(ConfigError, match="val_size applies to a generator; with files, give 'val_file:'"):
        load_recipe(recipe_dict(stages={"*": files}))
    with pytest.raises(ConfigError, match="evaluation.bootstrap_resamples"):
        load_recipe(recipe_dict(evaluation={"bootstrap_resamples": 10}))
    notes = check_recipe(recipe_dict(stages={"*": {"prompts": {"val_size": 0}}}))
    assert notes == [
        "stage 'coding' has no validation prompts (val_size: 0 / no val_file): nothing is chosen on its column"
    ]


def test_preview_settings_are_validated():
    parsed, _ = load_recipe(recipe_dict(stages={"*": {"preview": {}}}))
    preview = parsed.stages[0].preview
    assert (preview.every, preview.prompts, preview.method, preview.parameters, preview.keep) == (
        None,
        24,
        "ram_plus",
        {},
        "best",
    )
    assert load_recipe(recipe_dict())[0].stages[0].preview is None  # off unless asked for
    assert (
        check_recipe(recipe_dict(stages={"*": {"preview": {"every": 5, "keep": "last", "parameters": {"r": 0.2}}}}))
        == []
    )
    with pytest.raises(ConfigError, match="stages.0.preview.every"):
        load_recipe(recipe_dict(stages={"*": {"preview": {"every": 0}}}))
    with pytest.raises(ConfigError, match="stages.0.preview.keep"):
        load_recipe(recipe_dict(stages={"*": {"preview": {"keep": "first"}}}))
    with pytest.raises(ConfigError, match="stage 'coding': 'preview:' .* and stage 'coding' has none"):
        load_recipe(recipe_dict(stages={"*": {"preview": {}, "prompts": {"val_size": 0}}}))
    with pytest.raises(ConfigError, match="'preview:' scores prompts; evaluation.enabled is false"):
        load_recipe(recipe_dict(stages={"*": {"preview": {}}}, evaluation={"enabled": False}))
    with pytest.raises(ConfigError, match="stage 'coding': preview: .*'ram_minus'"):
        check_recipe(recipe_dict(stages={"*": {"preview": {"method": "ram_minus"}}}))
    with pytest.raises(ConfigError, match="preview: method 'ram_plus' has no parameter 'beta'"):
        check_recipe(recipe_dict(stages={"*": {"preview": {"parameters": {"beta": 1}}}}))
    with pytest.raises(ConfigError, match="stage 'coding': preview: parameters"):  # values checked as a merge's
        check_recipe(recipe_dict(stages={"*": {"preview": {"parameters": {"r": -1.0}}}}))


def test_preview_needs_validation_prompts_on_every_earlier_stage():
    data = recipe_dict()
    second = {**data["stages"][0], "name": "tools", "preview": {}}
    data["stages"] = [{**data["stages"][0], "prompts": {**data["stages"][0]["prompts"], "val_size": 0}}, second]
    with pytest.raises(ConfigError, match="stage 'tools': 'preview:' .* stage 'coding' has none"):
        load_recipe(data)
    existing = {"name": "old", "checkpoint": "agents/old", "preview": {}}
    with pytest.raises(ConfigError, match="'preview:' applies to a trained stage"):
        load_recipe({**recipe_dict(), "stages": [existing]})


def test_merges_are_written_in_float32_unless_the_recipe_names_a_dtype():
    data = recipe_dict(merges=["ram", {"method": "ties", "out_dtype": "bfloat16"}])
    rows = expand_merges(load_recipe(data)[0])
    assert [(r.name, r.out_dtype) for r in rows] == [("ram", "float32"), ("ties", "bfloat16")]
    rows = expand_merges(load_recipe({**data, "merge_dtype": "bfloat16"})[0])
    assert [r.out_dtype for r in rows] == ["bfloat16", "bfloat16"]
    with pytest.raises(ConfigError, match=r"merge_dtype"):
        load_recipe({**data, "merge_dtype": "int8"})


def test_ram_unique_must_name_a_stage():
    with pytest.raises(
        ConfigError, match=r"merge 'ram_unique': parameters.agent: agent 'tools' is not one of the merged agents"
    ):
        check_recipe(recipe_dict(merges=[{"method": "ram_unique", "parameters": {"agent": "tools"}}]))
    assert check_recipe(recipe_dict(merges=[{"method": "ram_unique", "parameters": {"agent": "coding"}}])) == []
