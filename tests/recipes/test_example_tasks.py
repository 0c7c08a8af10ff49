"""The how-to for users' own verticals (examples/string_tasks.py, examples/string-tasks.yaml): golden rewards, seeded
distinct prompts with correct answers, and the recipe validates with the tasks plugged in by import path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ram_trl.recipes.environment import validate_recipe
from ram_trl.recipes.schema import expand_merges, load_recipe

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def string_tasks(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import string_tasks

    yield string_tasks
    sys.modules.pop("string_tasks", None)


def test_position_reward_golden(string_tasks):
    completions = ["dcba", " dcba \nmore", "dcbx", "abcd", "dc", "dcbaa", ""]
    # exact -> 1; else 0.5 * (positions right / longer length): "dcbx" 3/4, "abcd" 0/4, "dc" 2/4, "dcbaa" 4/5.
    assert string_tasks.position_reward(completions, answer=["dcba"] * 7) == [
        1.0, 1.0, 0.375, 0.0, 0.25, 0.4, 0.0,
    ]  # fmt: skip


def test_generators_are_seeded_distinct_and_right(string_tasks):
    for make, check in (
        (string_tasks.reverse_prompts, lambda word, answer: answer == word[::-1]),
        (string_tasks.sort_prompts, lambda word, answer: answer == "".join(sorted(word))),
    ):
        rows = make(300, seed=3)
        assert rows == make(300, seed=3) != make(300, seed=4)
        assert len({r["prompt"] for r in rows}) == 300
        for row in rows:
            assert check(row["prompt"].split(" ", 1)[1].removesuffix("="), row["answer"])
    for row in string_tasks.count_prompts(300, seed=0):
        _, letter, _, word = row["prompt"].removesuffix("=").split(" ")
        assert row["answer"] == str(word.count(letter))
    with pytest.raises(ValueError, match="distinct prompts"):
        string_tasks.reverse_prompts(101, length=2)  # 10 letters: 100 two-letter words


def test_the_example_recipe_validates_with_the_tasks_plugged_in(string_tasks):
    recipe, root = load_recipe(EXAMPLES / "string-tasks.yaml")
    assert recipe.names == ["reverse", "sort", "count"]
    assert validate_recipe(recipe, root) == []
    assert len(expand_merges(recipe)) == 10
