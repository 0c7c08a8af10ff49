"""Prompt rows: held-out prompts are never trained on (RL or warm start); JSON Lines errors name file and line."""

from __future__ import annotations

import pytest

from ram_trl.errors import ConfigError
from ram_trl.recipes.data import draw_splits, draw_warm_rows, read_jsonl, write_jsonl
from ram_trl.recipes.schema import StageSpec


def stage(**prompts) -> StageSpec:
    return StageSpec(
        name="tools",
        prompts={"generator": "ram_trl.recipes.tasks:tool_call_prompts", **prompts},
        rewards=["ram_trl.recipes.tasks:tool_call_reward"],
    )


def test_held_out_validation_and_warm_rows_are_disjoint_from_what_they_must_not_see(tmp_path):
    spec = stage(train_size=50, eval_size=24, warm_size=1540)
    train, held, val = draw_splits(spec, tmp_path)
    assert (len(train), len(held), len(val)) == (50, 24, 24)  # val_size defaults to eval_size
    prompts = [{r["prompt"] for r in rows} for rows in (train, held, val)]
    assert not prompts[0] & prompts[1] and not prompts[0] & prompts[2] and not prompts[1] & prompts[2]
    warm = draw_warm_rows(spec, held + val)
    # 1,588 distinct tool prompts exist: all 1,540 that are neither test nor validation, whatever the training rows are.
    assert len(warm) == 1540
    assert not {r["prompt"] for r in warm} & (prompts[1] | prompts[2])
    assert draw_splits(spec, tmp_path) == (train, held, val)
    assert draw_warm_rows(stage(train_size=50, eval_size=24), held) == []


def test_validation_leaves_the_test_rows_unchanged_and_can_be_sized_or_off(tmp_path):
    arithmetic = {"generator": "ram_trl.recipes.tasks:arithmetic_prompts", "train_size": 40, "eval_size": 16}
    base = StageSpec(
        name="c", prompts={**arithmetic, "val_size": 0}, rewards=["ram_trl.recipes.tasks:arithmetic_reward"]
    )
    train, held, val = draw_splits(base, tmp_path)
    assert val == [] and len(held) == 16
    sized = StageSpec(name="c", prompts={**arithmetic, "val_size": 8}, rewards=base.rewards)
    assert draw_splits(sized, tmp_path)[:2] == (train, held)  # the test rows do not move
    assert len(draw_splits(sized, tmp_path)[2]) == 8
    few = StageSpec(
        name="f",
        prompts={"generator": "tests.recipes.failing:few_prompts", "train_size": 1, "eval_size": 1, "val_size": 2},
        rewards=base.rewards,
    )
    with pytest.raises(ConfigError, match=r"stage 'f': only 1 of prompts.val_size=2 validation prompts"):
        draw_splits(few, tmp_path)


def test_file_prompts_and_jsonl_errors(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}]
    write_jsonl(rows, tmp_path / "train.jsonl")
    assert read_jsonl(tmp_path / "train.jsonl") == rows
    spec = StageSpec(name="s", prompts={"train_file": "train.jsonl"}, rewards=["ram_trl.recipes.tasks:recall_reward"])
    assert draw_splits(spec, tmp_path)[:2] == (rows, [])
    write_jsonl([{"prompt": "2+2=", "answer": "4"}], tmp_path / "val.jsonl")
    spec = StageSpec(
        name="s",
        prompts={"train_file": "train.jsonl", "val_file": "val.jsonl"},
        rewards=["ram_trl.recipes.tasks:recall_reward"],
    )
    assert draw_splits(spec, tmp_path) == (rows, [], [{"prompt": "2+2=", "answer": "4"}])
    write_jsonl(rows, tmp_path / "val.jsonl")
    with pytest.raises(ConfigError, match="1 val_file prompts are also training or eval_file prompts"):
        draw_splits(spec, tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n\n{"answer": 1}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl, line 3: expected an object with a string 'prompt'"):
        read_jsonl(tmp_path / "bad.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl, line 1: not JSON"):
        read_jsonl(tmp_path / "bad.jsonl")


def test_a_failing_generator_names_the_stage(tmp_path):
    spec = stage(train_size=2000)  # more distinct prompts than exist
    with pytest.raises(ConfigError, match="stage 'tools': prompt generator .* failed: ValueError"):
        draw_splits(spec, tmp_path)
