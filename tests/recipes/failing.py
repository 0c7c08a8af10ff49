"""A reward function that raises, for the failing-stage test (imported by the stage process by path)."""

from __future__ import annotations


def raising_reward(completions, **kwargs):
    raise ValueError("boom: this reward always fails")
