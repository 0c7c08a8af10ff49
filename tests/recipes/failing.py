"""Reward functions and prompt generators that fail on purpose (raise, return NaN, None, too few values or text;
no prompts, rows without a prompt, reserved or unwritable columns, duplicates), named by import path in the recipes
of the failing-stage test (tests/recipes/test_runner.py) and the hostile recipes (test_hostile_recipes.py)."""

from __future__ import annotations


def raising_reward(completions, **kwargs):
    raise ValueError("boom: this reward always fails")


def few_prompts(n: int, seed: int = 0) -> list[dict]:
    """A generator with only three distinct prompts, repeated to ``n`` rows."""
    return [{"prompt": f"p{(i + seed) % 3}", "answer": "x"} for i in range(n)]


def nan_reward(completions, **kwargs):
    return [float("nan")] * len(completions)


def none_reward(completions, **kwargs):
    return None


def short_reward(completions, **kwargs):
    return [1.0]


def text_reward(completions, **kwargs):
    return ["good"] * len(completions)


def promptless_prompts(n: int, seed: int = 0) -> list[dict]:
    return [{"question": f"q{i}"} for i in range(n)]


def no_prompts(n: int, seed: int = 0) -> list[dict]:
    return []


def reserved_column_prompts(n: int, seed: int = 0) -> list[dict]:
    return [{"prompt": f"p{i + seed * n}", "completions": "x"} for i in range(n)]


def unwritable_prompts(n: int, seed: int = 0) -> list[dict]:
    return [{"prompt": f"p{i + seed * n}", "answer": {1, 2}} for i in range(n)]


def one_prompt(n: int, seed: int = 0) -> list[dict]:
    return [{"prompt": "always the same", "answer": "x"}] * n


def batch_failing_reward(completions, **kwargs):
    """Fails only on a training batch (more than the two completions of the pre-flight check): a stage that
    passes the checks before training and fails in it."""
    if len(completions) > 2:
        raise ValueError("boom: this reward fails in training")
    return [0.0] * len(completions)
