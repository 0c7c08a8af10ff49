"""Hostile recipes against ``ram-trl run``: each is refused with one ``error:`` line (exit 2) naming the recipe file
and the field, stage or function, before anything is written (no run directory) and without a traceback.

The checks live in the validation layer (:mod:`ram_trl.recipes.schema`, :mod:`ram_trl.recipes.environment`, :func:`ram_trl.recipes.data.check_rows`,
:func:`ram_trl.evaluation.rewards.check_reward_values`, :class:`ram_trl.output.OutputDir`), not in these cases.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ram_trl.cli import main
from ram_trl.recipes.schema import apply_overrides
from tests.helpers import recipe_dict

F = "tests.recipes.failing"


def recipe(**changes) -> dict:
    """A fresh valid recipe (:func:`tests.helpers.recipe_dict`: 8 training and 4 test prompts, one merge) with
    ``changes``."""
    valid = recipe_dict(name="hostile", stages={"*": {"prompts": {"train_size": 8, "eval_size": 4}}}, merges=["ram"])
    return apply_overrides(valid, changes)


STAGE = recipe()["stages"][0]


def stage(**changes) -> dict:
    return recipe(stages={"*": changes})


def prompts(**changes) -> dict:
    return stage(prompts=changes)


def files(**names: str) -> dict:
    data = recipe()
    data["stages"][0] = {**STAGE, "prompts": names}
    return data


def merge(method: str, **parameters) -> dict:
    return recipe(merges=[{"method": method, "parameters": parameters}])


# (id, recipe, expected text after "error: recipe PATH")
CASES = [
    ("stages-mapping", {**recipe(), "stages": {"coding": STAGE}}, ": must be a valid list"),
    ("warm-lr-nan", recipe(warm_start={"learning_rate": float("nan")}), "warm_start.learning_rate = nan: must be a finite number"),
    ("warm-steps-negative", recipe(warm_start={"steps": -3}), "warm_start.steps = -3: must be greater than or equal to 1"),
    ("train-size-negative", prompts(train_size=-1), "stages.0.prompts.train_size = -1: must be greater than or equal to 1"),
    ("eval-size-bool", prompts(eval_size=True), "stages.0.prompts: eval_size: must be a number, got True"),
    ("temperature-inf", recipe(evaluation={"temperature": float("inf")}), "evaluation.temperature = inf: must be a finite number"),
    ("seed-negative", recipe(seed=-1), "seed = -1: must be greater than or equal to 0"),
    ("analysis-r-nan", recipe(analysis={"r": float("nan")}), "analysis.r = nan: must be a finite number"),
    ("config-lr-nan", stage(config={"learning_rate": float("nan")}), "stage 'coding': config.learning_rate is nan; give a finite number"),
    ("config-lr-negative", stage(config={"learning_rate": -1e-5}), "stage 'coding': config.learning_rate must be > 0"),
    ("config-steps-text", stage(config={"max_steps": "ten"}), "stage 'coding': config.max_steps must be a number, got 'ten'"),
    ("config-batch-zero", stage(config={"per_device_train_batch_size": 0}), "config.per_device_train_batch_size must be >= 1"),
    ("config-steps-fraction", stage(config={"max_steps": 2.5}), "config.max_steps must be a whole number"),
    ("peft-rank-zero", stage(peft={"r": 0, "target_modules": ["q_proj"]}), "stage 'coding': peft: r must be a positive integer rank"),
    ("peft-alpha-nan", stage(peft={"r": 2, "lora_alpha": float("nan")}), "stage 'coding': peft.lora_alpha is nan"),
    ("merge-r-nan", merge("ram_plus", r=float("nan")), "merge 'ram_plus': parameters: parameter 'r' must be a finite number"),
    ("merge-sweep-nan", recipe(merges=[{"method": "ram_plus", "parameters": {"r": [0.1, float("nan")]}}]), "merge 'ram_plus(r=nan)': parameters: parameter 'r' must be a finite number"),
    ("stage-name-path", stage(name="../escape"), "stages.0.name = '../escape': must match pattern"),
    ("rewards-string", stage(rewards="ram_trl.recipes.tasks:arithmetic_reward"), "stages.0.rewards = 'ram_trl.recipes.tasks:arithmetic_reward': must be a valid list"),
    ("merge-density-above-1", merge("ties", density=2), "merge 'ties': parameters: parameter 'density' must be <= 1"),
    ("build-negative-width", recipe(base={"build": {"hidden_size": -8}}), "base.build: hidden_size must be >= 1"),
    ("build-heads", recipe(base={"build": {"hidden_size": 30}}), "num_attention_heads 4 must divide hidden_size 30"),
    ("kwargs-nan", prompts(kwargs={"scale": float("nan")}), "stage 'coding': prompts.kwargs.scale is nan"),
    ("reward-raises", stage(rewards=[f"{F}:raising_reward"]), f"reward function {F}:raising_reward raised ValueError('boom"),
    ("reward-nan", stage(rewards=[f"{F}:nan_reward"]), f"reward function {F}:nan_reward: value 0 is nan; return a finite float"),
    ("reward-none", stage(rewards=[f"{F}:none_reward"]), f"reward function {F}:none_reward returned NoneType"),
    ("reward-short", stage(rewards=[f"{F}:short_reward"]), f"reward function {F}:short_reward returned 1 values for 2 completions"),
    ("reward-text", stage(rewards=[f"{F}:text_reward"]), "value 0 is 'good', not a number"),
    ("generator-no-prompt", prompts(generator=f"{F}:promptless_prompts"), "row 0 must be an object with a non-empty string 'prompt'"),
    ("generator-nothing", prompts(generator=f"{F}:no_prompts"), "returned 0 rows, 8 were asked for"),
    ("generator-reserved-column", prompts(generator=f"{F}:reserved_column_prompts"), "row 0 has column 'completions'"),
    ("generator-unwritable", prompts(generator=f"{F}:unwritable_prompts"), "row 0 cannot be written as JSON"),
    ("generator-duplicates", prompts(generator=f"{F}:one_prompt"), "only 0 of prompts.eval_size=4 test prompts are distinct"),
    ("missing-train-file", files(train_file="nowhere.jsonl"), "stage 'coding': prompts.train_file"),
    ("stage-named-base", stage(name="base"), "stages: the name 'base' is reserved for the results' 'base' row"),
    ("stage-named-average", stage(name="Average"), "the name 'Average' is reserved"),
    ("stage-named-like-a-merge", stage(name="ram"), "merge row 'ram' and stage 'ram' would share a row of the results"),
    ("merge-named-like-a-stage", recipe(merges=[{"method": "ram", "name": "coding"}]), "merge row 'coding' and stage 'coding' would share"),
    ("rows-equal-up-to-case", recipe(merges=[{"method": "ram", "name": "CODING"}]), "merge row 'CODING' and stage 'coding'"),
]  # fmt: skip


def run(tmp_path: Path, data: dict, capsys, *extra: str) -> tuple[int, str, Path]:
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    code = main(["run", str(path), "--out", str(out), "--no-progress", *extra])
    return code, capsys.readouterr().err, path


@pytest.mark.parametrize("data, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_recipe_is_one_error_line_before_any_work(tmp_path, capsys, data, expected):
    code, err, path = run(tmp_path, data, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ram-trl run: error: recipe {path}"), lines[0]
    assert expected in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_file_prompts_test_rows_must_be_held_out(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    (tmp_path / "test.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n')
    (tmp_path / "val.jsonl").write_text('{"prompt": "3+3=", "answer": "6"}\n{"prompt": "3+3=", "answer": "6"}\n')
    code, err, path = run(tmp_path, files(train_file="train.jsonl", eval_file="test.jsonl"), capsys)
    assert code == 2 and "1 eval_file prompts are also training prompts (e.g. '2+2=')" in err
    code, err, path = run(tmp_path, files(train_file="train.jsonl", val_file="train.jsonl"), capsys)
    assert code == 2 and "val_file prompts are also training or eval_file prompts" in err
    (tmp_path / "empty.jsonl").write_text("\n")
    code, err, path = run(tmp_path, files(train_file="empty.jsonl"), capsys)
    assert code == 2 and "train_file empty.jsonl holds no rows" in err
    assert not (tmp_path / "run").exists()


def test_run_directory_never_holds_an_input_nor_foreign_files(tmp_path, capsys):
    """``--out`` that is the recipe's own directory (the recipe named recipe.yaml would be overwritten), or an
    existing directory that is not a previous run, is refused before anything is written."""
    home = tmp_path / "project"
    home.mkdir()
    path = home / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe()))
    before = path.read_bytes()
    assert main(["run", str(path), "--out", str(home), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"run directory {home} overlaps the recipe at {path}" in err
    assert path.read_bytes() == before and sorted(p.name for p in home.iterdir()) == ["recipe.yaml"]
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"\xff\xd8")
    assert main(["run", str(path), "--out", str(foreign), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"run directory {foreign} exists and is not a previous ram_trl output" in err and "holiday.jpg" in err
    assert sorted(p.name for p in foreign.iterdir()) == ["holiday.jpg"]
