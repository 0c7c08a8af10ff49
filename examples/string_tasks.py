"""Your own verticals in a recipe: a family of small verifiable string tasks, plugged in by import path.

A vertical needs two functions, nothing else:

- a prompt *generator* ``fn(n, seed, **kwargs) -> list[dict]``: ``n`` distinct rows, each with a ``"prompt"`` and
  the columns its reward reads (here the reference ``"answer"``); seeded, so every process draws the same rows;
- a *reward function* in TRL's signature ``fn(completions, answer, **kwargs) -> list[float]``: one float per
  completion, in ``[0, 1]``; TRL passes the dataset's extra columns (``answer``) as keyword arguments.

``examples/string-tasks.yaml`` is the demo recipe with its three stages swapped for the three tasks below; run it
from the repository root with this directory importable:

    PYTHONPATH=examples ram-trl run examples/string-tasks.yaml --out runs/string-tasks

Tasks (letters from ``a``-``j``, so every task has tens of thousands of distinct prompts):

- ``reverse``: ``"rev dbja="`` -> ``"ajbd"``;
- ``sort``: ``"sort dbja="`` -> ``"abdj"``;
- ``count``: ``"count b in dbbjab="`` -> ``"3"``.

The reward gives 1.0 for the exact answer and otherwise 0.5 times the share of positions right (the Hamming
similarity over the longer of the two strings), so a partly right completion earns partial credit and GRPO groups
carry a signal before the model is good.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ram_trl.recipes.tasks import completion_text

LETTERS = "abcdefghij"

__all__ = ["count_prompts", "position_reward", "reverse_prompts", "sort_prompts"]


def _distinct(make, n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows: dict[str, dict[str, str]] = {}
    for _ in range(100 * n + 1000):
        row = make(rng)
        rows.setdefault(row["prompt"], row)
        if len(rows) == n:
            return list(rows.values())
    raise ValueError(f"cannot draw {n} distinct prompts (only {len(rows)} exist); ask for fewer")


def _word(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(length))


def reverse_prompts(n: int, seed: int = 0, length: int = 4) -> list[dict[str, str]]:
    """``n`` prompts ``"rev WORD="`` whose answer is the word reversed."""

    def make(rng: random.Random) -> dict[str, str]:
        word = _word(rng, length)
        return {"prompt": f"rev {word}=", "answer": word[::-1]}

    return _distinct(make, n, seed)


def sort_prompts(n: int, seed: int = 0, length: int = 4) -> list[dict[str, str]]:
    """``n`` prompts ``"sort WORD="`` whose answer is the word's letters in alphabetical order."""

    def make(rng: random.Random) -> dict[str, str]:
        word = _word(rng, length)
        return {"prompt": f"sort {word}=", "answer": "".join(sorted(word))}

    return _distinct(make, n, seed)


def count_prompts(n: int, seed: int = 0, length: int = 6) -> list[dict[str, str]]:
    """``n`` prompts ``"count L in WORD="`` whose answer is how often letter ``L`` occurs in the word."""

    def make(rng: random.Random) -> dict[str, str]:
        word = _word(rng, length)
        letter = rng.choice(word) if rng.random() < 0.8 else rng.choice(LETTERS)
        return {"prompt": f"count {letter} in {word}=", "answer": str(word.count(letter))}

    return _distinct(make, n, seed)


def position_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 for the exact answer, else 0.5 x the share of positions whose character is right (over the longer of
    the completion and the answer)."""
    rewards = []
    for completion, want in zip(completions, answer, strict=True):
        text = completion_text(completion)
        if text == want:
            rewards.append(1.0)
            continue
        right = sum(1 for got, ref in zip(text, want, strict=False) if got == ref)
        rewards.append(0.5 * right / max(len(text), len(want), 1))
    return rewards
