"""Fixtures of the merge-preview tests: a tiny base and a first stage trained with the telemetry callback (once for
the folder), and the tiny GRPO run a second stage trains with the preview (``train``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

#: Optimizer steps of every stage these tests train.
STEPS = 4


def _train(
    base: Path,
    out: Path,
    callback: Any,
    seed: int = 0,
    save_steps: int | None = None,
    resume: Path | None = None,
    learning_rate: float = 3e-3,
) -> Any:
    """A tiny GRPO stage of :data:`STEPS` steps from ``base`` into ``out`` with ``callback``; returns the trainer."""
    from trl import GRPOConfig, GRPOTrainer

    from tests.helpers import distinct_chars, rl_config, rl_prompts, train_rl

    saving = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}
    config = rl_config(GRPOConfig, out, max_steps=STEPS, learning_rate=learning_rate, seed=seed, **saving)
    return train_rl(GRPOTrainer, base, config, callback, distinct_chars, rl_prompts(8), resume_from_checkpoint=resume)


@pytest.fixture
def train() -> Callable[..., Any]:
    """``train(base, out, callback, seed=0, save_steps=None, resume=None, learning_rate=3e-3)``: a tiny GRPO stage
    of 4 steps; returns the trainer."""
    return _train


@pytest.fixture(scope="package")
def base(tmp_path_factory) -> Path:
    from ram_trl.synthetic import make_base_checkpoint

    return make_base_checkpoint(
        tmp_path_factory.mktemp("base") / "base", hidden_size=32, num_layers=2, intermediate_size=64
    )


@pytest.fixture(scope="package")
def first(base, tmp_path_factory) -> Path:
    from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback

    out = tmp_path_factory.mktemp("stages") / "first"
    _train(base, out, TaskVectorSparsityCallback(base_model=base, stage_name="first"))
    return out
