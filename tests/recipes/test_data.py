"""Prompt rows: held-out prompts are never trained on (RL or warm start); JSON Lines errors name file and line."""

from __future__ import annotations

import pytest

from ram_trl.errors import ConfigError
from ram_trl.recipes.data import draw_rows, draw_warm_rows, read_jsonl, write_jsonl
from ram_trl.recipes.schema import StageSpec


def stage(**prompts) -> StageSpec:
    return StageSpec(
        name="tools",
        prompts={"generator": "ram_trl.recipes.tasks:tool_call_prompts", **prompts},
        rewards=["ram_trl.recipes.tasks:tool_call_reward"],
    )


def test_held_out_and_warm_rows_are_disjoint_from_what_they_must_not_see(tmp_path):
    spec = stage(train_size=50, eval_size=24, warm_size=78)
    train, held = draw_rows(spec, tmp_path)
    assert (len(train), len(held)) == (50, 24)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    warm = draw_warm_rows(spec, held)
    # 102 distinct tool prompts exist: all 78 that are not held out, whatever the training rows are.
    assert len(warm) == 78
    assert not {r["prompt"] for r in warm} & {r["prompt"] for r in held}
    assert draw_rows(spec, tmp_path) == (train, held)
    assert draw_warm_rows(stage(train_size=50, eval_size=24), held) == []


def test_file_prompts_and_jsonl_errors(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}]
    write_jsonl(rows, tmp_path / "train.jsonl")
    assert read_jsonl(tmp_path / "train.jsonl") == rows
    spec = StageSpec(
        name="s", prompts={"train_file": "train.jsonl"}, rewards=["ram_trl.recipes.tasks:recall_reward"]
    )
    assert draw_rows(spec, tmp_path) == (rows, [])
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n\n{"answer": 1}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl, line 3: expected an object with a string 'prompt'"):
        read_jsonl(tmp_path / "bad.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl, line 1: not JSON"):
        read_jsonl(tmp_path / "bad.jsonl")


def test_a_failing_generator_names_the_stage(tmp_path):
    spec = stage(train_size=500)  # more distinct prompts than exist
    with pytest.raises(ConfigError, match="stage 'tools': prompt generator .* failed: ValueError"):
        draw_rows(spec, tmp_path)
