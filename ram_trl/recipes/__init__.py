"""Specialize-then-merge recipes: ``ram-trl run RECIPE.yaml``, ``ram-trl eval``, ``ram-trl demo`` (docs/recipes.md)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEMO_RECIPE", "QUICK_OVERRIDES", "seed_overrides"]


#: The embedded CPU demo recipe (package data; ``recipes/demo-cpu.yaml`` in the repository links to it).
DEMO_RECIPE = Path(__file__).with_name("demo-cpu.yaml")

#: ``ram-trl demo --quick``: the demo's pipeline with tiny sizes (a smoke test of every part in a few minutes).
QUICK_OVERRIDES: dict = {
    "base": {"build": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64}},
    "warm_start": {
        "steps": 20,
        "batch_size": 16,
        "abstain_steps": 10,
        "accept": {
            "check_size": 4,
            "pass_k": 2,
            "every": 10,
            "max_steps": 30,
            "abstain_every": 5,
            "abstain_max_steps": 10,
        },
    },
    "stages": {
        "*": {
            "prompts": {"train_size": 16, "eval_size": 8, "val_size": 8, "warm_size": 16},
            "config": {
                "max_steps": 2,
                "per_device_train_batch_size": 8,
                "num_generations": 4,
                "max_completion_length": 8,
                "logging_steps": 1,
            },
        }
    },
    "evaluation": {"max_new_tokens": 8},
}


def seed_overrides(seed: int) -> dict:
    """``ram-trl demo --seed S``: every seed of the demo recipe (all 0 in it) set to ``seed`` (range checked)."""
    from ram_trl.errors import ConfigError
    from ram_trl.evaluation.spec import MAX_SEED

    # the lowest limit of the seeds it sets (a stage's prompt seed: its splits draw from later ones)
    highest = MAX_SEED - 2
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= highest:
        raise ConfigError(f"--seed {seed}: must be an integer from 0 to {highest}")
    return {
        "seed": seed,
        "base": {"build": {"seed": seed}},
        "warm_start": {"seed": seed, "accept": {"seed": seed}},
        "stages": {"*": {"prompts": {"seed": seed}}},
        "evaluation": {"seed": seed, "bootstrap_seed": seed},
    }
