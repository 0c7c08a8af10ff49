"""The environment checks of a recipe (``--dry-run``): import paths, trainer and PEFT configs, config files and
paths, the shipped recipes, the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ram_trl.errors import ConfigError
from ram_trl.evaluation.rewards import import_object
from ram_trl.recipes import DEMO_RECIPE, QUICK_OVERRIDES
from ram_trl.recipes.environment import validate_recipe
from ram_trl.recipes.schema import load_recipe
from tests.helpers import check_recipe, recipe_dict

REPO = Path(__file__).resolve().parents[2]


def test_bad_import_paths_name_the_stage_and_path():
    bad_module = recipe_dict(stages={"*": {"rewards": ["no_such_module:reward"]}})
    with pytest.raises(ConfigError, match=r"stage 'coding': reward function 'no_such_module:reward': cannot import"):
        check_recipe(bad_module)
    bad_attr = recipe_dict(stages={"*": {"rewards": ["ram_trl.recipes.tasks:no_reward"]}})
    with pytest.raises(ConfigError, match="module 'ram_trl.recipes.tasks' has no attribute 'no_reward'"):
        check_recipe(bad_attr)
    bad_generator = recipe_dict(stages={"*": {"prompts": {"generator": "ram_trl.recipes.tasks"}}})
    with pytest.raises(ConfigError, match="prompt generator 'ram_trl.recipes.tasks'"):
        check_recipe(bad_generator)
    with pytest.raises(ConfigError, match="write it as 'package.module:function'"):
        import_object("reward", "reward function")


def test_trainer_config_errors_name_the_stage():
    with pytest.raises(ConfigError, match="stage 'coding': GRPOConfig has no field 'learning_rat'"):
        check_recipe(recipe_dict(stages={"*": {"config": {"learning_rat": 1e-5}}}))
    with pytest.raises(ConfigError, match="stage 'coding': invalid GRPOConfig"):
        check_recipe(recipe_dict(stages={"*": {"config": {"per_device_train_batch_size": 3, "num_generations": 2}}}))
    with pytest.raises(ConfigError, match="config.output_dir is set by the runner"):
        load_recipe(recipe_dict(stages={"*": {"config": {"output_dir": "x"}}}))
    with pytest.raises(ConfigError, match="invalid peft LoraConfig"):
        check_recipe(recipe_dict(stages={"*": {"peft": {"rank": 4}}}))


def test_paths_are_checked_unless_skipped(tmp_path):
    data = recipe_dict(base={"path": str(tmp_path / "nowhere"), "build": None})
    data["base"].pop("build")
    with pytest.raises(ConfigError, match=r"base.path .*nowhere is not a directory"):
        check_recipe(data)
    assert any("--skip-paths" in note for note in check_recipe(data, check_paths=False))
    accelerate = recipe_dict(stages={"*": {"accelerate_config": str(tmp_path / "acc.yaml")}})
    with pytest.raises(ConfigError, match="accelerate_config .*acc.yaml does not exist"):
        check_recipe(accelerate)
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump({"deepspeed_config": {"deepspeed_config_file": "ds.json"}}))
    with pytest.raises(ConfigError, match="DeepSpeed config .*ds.json named by .*acc.yaml does not exist"):
        check_recipe(accelerate)


@pytest.mark.parametrize(
    "path, overrides",
    [
        (DEMO_RECIPE, None),
        (DEMO_RECIPE, QUICK_OVERRIDES),
        (REPO / "recipes" / "qwen2.5-7b-paper-agents.yaml", None),
        (REPO / "recipes" / "qwen2.5-1.5b-grpo-zero3.yaml", None),
        (REPO / "recipes" / "smollm2-agents.yaml", None),
        (REPO / "recipes" / "smollm2-agents-lora.yaml", None),
        (REPO / "recipes" / "smollm2-agents-gpu.yaml", None),
    ],
)
def test_shipped_recipes_pass_dry_run_validation(path, overrides):
    parsed, root = load_recipe(path, overrides)
    validate_recipe(parsed, root, check_paths=False)


def test_cli_dry_run_validates_and_reports_errors(tmp_path, capsys):
    from ram_trl.cli import main

    assert main(["run", str(REPO / "recipes" / "qwen2.5-7b-paper-agents.yaml"), "--dry-run", "--skip-paths"]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(recipe_dict(merges=["ram", "ram_minus"])))
    assert main(["run", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"ram-trl run: error: recipe {bad}: merge 'ram_minus'" in err
    assert main(["run", str(bad), "--skip-paths"]) == 2
    assert "--skip-paths only applies to --dry-run" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_fisher_settings_follow_the_method_not_its_name():
    """``fisher:`` settings belong to the method that reads Fisher files, under its name or its alias."""
    for method in ("fisher", "fisher_merging"):
        assert check_recipe(recipe_dict(merges=[{"method": method, "fisher": {"num_samples": 4}}])) == []
    with pytest.raises(ConfigError, match="merge 'ties': 'fisher:' settings apply only to method 'fisher'"):
        check_recipe(recipe_dict(merges=[{"method": "ties", "fisher": {"num_samples": 4}}]))


def test_lambda_matched_needs_ram_and_a_numeric_task_arithmetic_row():
    """``lambda: matched`` is resolved from RAM's and a task-arithmetic merge's norms: both must be in the recipe."""
    matched = {"method": "task_arithmetic", "name": "ta_matched", "parameters": {"lambda": "matched"}}
    grid = {"method": "ta", "parameters": {"lambda": [0.5, 1.0]}}
    assert check_recipe(recipe_dict(merges=["ram", grid, matched])) == []
    needs = "merge 'ta_matched': lambda: matched [(]task arithmetic at RAM's L2 norm[)] needs"
    with pytest.raises(ConfigError, match=f"{needs} '- ram' in the recipe's merges"):
        check_recipe(recipe_dict(merges=[grid, matched]))
    with pytest.raises(ConfigError, match=f"{needs} a task_arithmetic row with a numeric lambda"):
        check_recipe(recipe_dict(merges=["ram", matched]))
    normalized = {**matched, "parameters": {"lambda": "matched", "normalize": True}}
    with pytest.raises(ConfigError, match=f"{needs} no normalize on this row"):
        check_recipe(recipe_dict(merges=["ram", grid, normalized]))
    with pytest.raises(ConfigError, match="merge 'ties': parameters"):  # elsewhere, a word is not a number
        check_recipe(recipe_dict(merges=[{"method": "ties", "parameters": {"lambda": "matched"}}]))


#: An accelerate DeepSpeed section with ZeRO-3 that can save the policy (what the preview needs under ZeRO-3).
ZERO3 = {"zero_stage": 3, "zero3_save_16bit_model": True}


@pytest.mark.parametrize(
    ("launch", "stage", "match"),
    [
        ({"distributed_type": "FSDP"}, {}, "does not support FSDP"),
        ({"deepspeed_config": ZERO3}, {"preview": {"method": "ties"}}, "method 'ties' needs whole"),
        ({"deepspeed_config": ZERO3}, {"peft": {"r": 4}}, "PEFT \\(LoRA\\) stage is not supported"),
        ({"deepspeed_config": {"deepspeed_config_file": "ds.json"}}, {"preview": {"method": "della"}}, "della"),
        ({"deepspeed_config": {"zero_stage": 3}}, {}, "needs stage3_gather_16bit_weights_on_model_save: true"),
        ({"deepspeed_config": ZERO3}, {}, None),
        ({"deepspeed_config": {"deepspeed_config_file": "ds.json"}}, {}, None),
        ({"deepspeed_config": {"zero_stage": 2}}, {"preview": {"method": "ties"}}, None),
    ],
)
def test_preview_is_checked_against_the_stage_launch(tmp_path, launch, stage, match):
    """The merge preview under a stage's accelerate launch, refused at --dry-run where it would fail at train begin:
    FSDP; under ZeRO-3 a method that needs whole tensors, a PEFT stage, or a DeepSpeed config that cannot save the
    policy (docs/merge-preview.md)."""
    launch = {"distributed_type": "DEEPSPEED", **launch}
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(launch))
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": zero}))
    settings = {"accelerate_config": str(tmp_path / "acc.yaml"), "prompts": {"val_size": 4}}
    settings["preview"] = {"method": "ram_plus", **stage.pop("preview", {})}
    data = recipe_dict(stages={"*": {**settings, **stage}})
    if match is None:
        check_recipe(data)
    else:
        with pytest.raises(ConfigError, match=match):
            check_recipe(data)


def test_gguf_base_is_checked_before_any_work(tmp_path, monkeypatch):
    """A recipe's ``base.gguf``: the file must exist and start like a GGUF file, and the gguf package be installed."""
    pytest.importorskip("gguf")
    gguf_base = {"build": None, "gguf": str(tmp_path / "m.gguf")}
    with pytest.raises(ConfigError, match=r"base.gguf: GGUF source .*m.gguf does not exist"):
        check_recipe(recipe_dict(base=gguf_base))
    (tmp_path / "m.gguf").write_bytes(b"GGML and more")
    with pytest.raises(ConfigError, match=r"base.gguf: GGUF source .*m.gguf is not a GGUF file"):
        check_recipe(recipe_dict(base=gguf_base))
    (tmp_path / "m.gguf").write_bytes(b"GGUF and more")
    assert check_recipe(recipe_dict(base=gguf_base)) == []
    assert any(
        "--skip-paths" in n for n in check_recipe(recipe_dict(base={**gguf_base, "gguf": "x"}), check_paths=False)
    )
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    with pytest.raises(ConfigError, match=r"base.gguf: reading a GGUF file needs the gguf package"):
        check_recipe(recipe_dict(base=gguf_base), check_paths=False)


def test_smollm2_recipes_are_the_same_pipeline_at_three_sizes():
    """The LoRA and GPU variants change only what their headers say: the base, tasks, rewards and merges agree."""
    full, _ = load_recipe(REPO / "recipes" / "smollm2-agents.yaml")
    lora, _ = load_recipe(REPO / "recipes" / "smollm2-agents-lora.yaml")
    gpu, _ = load_recipe(REPO / "recipes" / "smollm2-agents-gpu.yaml")
    for other in (lora, gpu):
        assert other.base == full.base and other.names == full.names
        assert [(m.method, m.parameters) for m in other.merges] == [(m.method, m.parameters) for m in full.merges]
        for a, b in zip(full.stages, other.stages, strict=True):
            assert (a.rewards, a.prompts.generator, a.prompts.kwargs) == (
                b.rewards,
                b.prompts.generator,
                b.prompts.kwargs,
            )
    for stage in full.stages:
        assert stage.peft is None and stage.save_dtype == "float32" and stage.has_validation
        assert 1e-6 <= stage.config["learning_rate"] <= 2e-5  # revision 3: 2e-5 (revision 2: 1e-5)
    assert all(s.peft and s.peft["r"] == 16 and s.config["learning_rate"] <= 1e-5 for s in lora.stages)
    assert all(s.config["max_steps"] > full.stages[0].config["max_steps"] and s.config.get("bf16") for s in gpu.stages)
    # the mechanism rows (docs/recipes.md) and the dtype the merges are scored in are named in the recipe itself
    raw = yaml.safe_load((REPO / "recipes" / "smollm2-agents.yaml").read_text())
    assert raw["merge_dtype"] == full.merge_dtype == "float32"
    names = {m.name for m in full.merges}
    assert {"ram_1_over_n", "ties_density_1", "unique_coding", "unique_tools", "unique_memory"} <= names
    methods = {m.method for m in full.merges}
    from ram_trl.methods.registry import method_names

    assert methods == set(method_names()) - {"slerp"}


@pytest.mark.parametrize("given", [{}, {"gradient_checkpointing": False}, {"gradient_checkpointing": True}])
def test_trainer_settings_raise_no_deprecation_warning(tmp_path, given):
    # TRL's configs default `gradient_checkpointing` on, which transformers 5 deprecates with a FutureWarning
    import dataclasses
    import warnings

    from trl import GRPOConfig

    from ram_trl.recipes.environment import trainer_settings

    recipe, _ = load_recipe(recipe_dict(stages={"*": {"config": {"max_steps": 1, **given}}}))
    settings = trainer_settings(recipe.stages[0], 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = GRPOConfig(output_dir=str(tmp_path), **settings)
    default = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}["gradient_checkpointing"]
    assert config.gradient_checkpointing is given.get("gradient_checkpointing", default)  # the same setting


def test_trainer_settings_turn_the_trainers_bar_off_unless_the_recipe_says():
    # a stage's output is a log file: the trainer's bar would be a line per redraw (the launcher shows the steps)
    from ram_trl.recipes.environment import trainer_settings

    recipe, _ = load_recipe(recipe_dict(stages={"*": {"config": {"max_steps": 1}}}))
    assert trainer_settings(recipe.stages[0], 0)["disable_tqdm"] is True
    recipe, _ = load_recipe(recipe_dict(stages={"*": {"config": {"max_steps": 1, "disable_tqdm": False}}}))
    assert trainer_settings(recipe.stages[0], 0)["disable_tqdm"] is False
