"""A reward function that raises, for the failing-stage test (imported by the stage process by path)."""

from __future__ import annotations


def raising_reward(completions, **kwargs):
    raise ValueError("boom: this reward always fails")


def few_prompts(n: int, seed: int = 0) -> list[dict]:
    """A generator with only three distinct prompts, repeated to ``n`` rows."""
    return [{"prompt": f"p{(i + seed) % 3}", "answer": "x"} for i in range(n)]
