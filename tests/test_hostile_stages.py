"""Hostile inputs on the stage surfaces (issue 26): eval's output file, the callback's saves, stage manifests as
merge / analyze / eval inputs, recipe names, the callback's arguments.

Every refusal: one line naming the file (or argument) and what to change, no traceback, nothing lost.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ram_trl.cli import main
from tests.helpers import error_line

# ---------------------------------------------------------------------------------------------------------------
# ram-trl eval --json: never over an input, never over a file it did not create


@pytest.fixture
def eval_inputs(tmp_path) -> tuple[Path, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}\n')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: r\n")
    return model, recipe


@pytest.mark.parametrize("target", ["model_config", "recipe", "model_dir"])
def test_eval_json_never_writes_over_an_input(eval_inputs, capsys, target):
    model, recipe = eval_inputs
    path = {"model_config": model / "config.json", "recipe": recipe, "model_dir": model / "scores.json"}[target]
    before = path.read_bytes() if path.exists() else None
    code = main(["eval", str(model), "--recipe", str(recipe), "--json", str(path), "--overwrite"])
    line = error_line(capsys, code)
    assert str(path) in line and "reads" in line
    assert (path.read_bytes() if path.exists() else None) == before


def test_eval_json_refuses_an_existing_file_without_overwrite(eval_inputs, tmp_path, capsys):
    model, recipe = eval_inputs
    existing = tmp_path / "notes.json"
    existing.write_text("mine\n")
    line = error_line(capsys, main(["eval", str(model), "--recipe", str(recipe), "--json", str(existing)]))
    assert str(existing) in line and "--overwrite" in line
    assert existing.read_text() == "mine\n"


def test_eval_refuses_zero_new_tokens(eval_inputs, capsys):
    model, recipe = eval_inputs
    line = error_line(capsys, main(["eval", str(model), "--recipe", str(recipe), "--max-new-tokens", "0"]))
    assert "--max-new-tokens" in line


# ---------------------------------------------------------------------------------------------------------------
# The callback's arguments: all validated at construction, before any training


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"every_n_steps": True}, "every_n_steps=True"),
        ({"every_n_steps": 2.0}, "every_n_steps=2.0"),
        ({"eps": float("inf")}, "eps must be a finite number"),
        ({"eps": "1e-5"}, "eps must be a number"),
        ({"r": float("nan")}, "r must be a finite number"),
        ({"threads": 2.5}, "threads=2.5"),
        ({"magnitude_sample": 0}, "magnitude_sample=0"),
        ({"prior_stages": "runs/coding"}, "prior_stages='runs/coding': give a list"),
        ({"prior_stages": [3]}, "every entry must be a path"),
        ({"stage_name": 5}, "stage_name=5: give a non-empty string"),
        ({"domain": ["code"]}, "domain=['code']"),
        ({"stage_name": "a\n# injected"}, "without control characters"),
        ({"stage_name": "../other"}, "may not hold '/'"),
        ({"stage_name": "x" * 250}, "at most 200 characters"),
        ({"save_agent": "yes"}, "save_agent='yes': give True or False"),
        ({"base_model": 5}, "base_model=5"),
    ],
)
def test_callback_arguments_are_refused_at_construction(kwargs, needle):
    from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback
    from ram_trl.errors import ConfigError

    with pytest.raises(ConfigError, match="TaskVectorSparsityCallback") as exc:
        TaskVectorSparsityCallback(**kwargs)
    assert needle in str(exc.value) and "\n" not in str(exc.value).replace(repr(kwargs.get("stage_name")), "")


# ---------------------------------------------------------------------------------------------------------------
# Disk full / read-only while safetensors writes: one line, not the library's exception


@pytest.mark.parametrize(("code", "needle"), [(28, "free some space"), (30, "read-only")])
def test_safetensors_errors_of_a_full_or_read_only_disk_are_one_line(tmp_path, code, needle):
    from ram_trl.errors import OutputError
    from ram_trl.output import guard_os_errors

    class SafetensorError(Exception):  # the Rust writer's exception type, by name
        pass

    match = rf"cannot write agent directory {tmp_path}.*{needle}"
    with pytest.raises(OutputError, match=match) as exc, guard_os_errors(f"agent directory {tmp_path}"):
        raise SafetensorError(f'Error while serializing: I/O error: x (os error {code}) at path "/x"')
    assert "\n" not in str(exc.value)
    with pytest.raises(SafetensorError), guard_os_errors("x"):  # anything else is not the user's disk
        raise SafetensorError("Error while serializing: header too large")


def test_atomic_file_turns_a_full_disk_in_safetensors_into_one_line(tmp_path):
    from ram_trl.errors import OutputError
    from ram_trl.output import atomic_file

    class SafetensorError(Exception):
        pass

    target = tmp_path / "fisher.safetensors"
    match = f"cannot write Fisher file {target}.*free some space"
    with pytest.raises(OutputError, match=match), atomic_file(target, "Fisher file") as temp:
        temp.write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left (os error 28)")
    assert list(tmp_path.iterdir()) == []


def test_eval_of_a_directory_without_a_model_is_one_line(tmp_path, capsys):
    empty = tmp_path / "notamodel"
    empty.mkdir()
    (empty / "notes.txt").write_text("x\n")
    recipe = tmp_path / "recipe.yaml"
    import yaml

    from tests.helpers import recipe_dict

    recipe.write_text(
        yaml.safe_dump(recipe_dict(name="r", stages={"*": {"prompts": {"train_size": 8, "eval_size": 4}}}))
    )
    line = error_line(capsys, main(["eval", str(empty), "--recipe", str(recipe)]))
    assert f"agent {empty} holds no model" in line


@pytest.mark.parametrize(
    ("option", "value"),
    [("max_shard_size", 0), ("max_shard_size", "0MB"), ("chunk_budget", "0"), ("chunk_budget", -1)],
)
def test_zero_or_negative_sizes_are_refused(tmp_path, option, value):
    import ram_trl
    from ram_trl.errors import ConfigError
    from tests.helpers import config_for, make_checkpoints

    ckpts = make_checkpoints(tmp_path / "inputs")
    with pytest.raises(ConfigError, match=rf"{option}={value!r}: give a positive size"):
        ram_trl.merge(config_for(ckpts, "ram"), tmp_path / "out", progress=False, **{option: value})
    assert not (tmp_path / "out").exists()
    if option == "chunk_budget":
        with pytest.raises(ConfigError, match=rf"{option}={value!r}: give a positive size"):
            ram_trl.analyze(ckpts.base, ckpts.agents, None, progress=False, chunk_budget=value)


def test_an_output_name_of_250_characters_is_written(tmp_path):
    from ram_trl.output import OutputDir, atomic_file

    name = "m" * 250
    OutputDir(tmp_path / name, what="output directory").write(lambda temp: (temp / "a.txt").write_text("x"))
    assert (tmp_path / name / "a.txt").read_text() == "x"
    with atomic_file(tmp_path / ("f" * 250)) as temp:
        temp.write_text("y")
    assert (tmp_path / ("f" * 250)).read_text() == "y"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f" * 250, name]
