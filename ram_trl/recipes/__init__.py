"""Specialize-then-merge recipes: ``ram-trl run RECIPE.yaml``, ``ram-trl eval``, ``ram-trl demo``.

- :mod:`ram_trl.recipes.schema`: the recipe file (pydantic models), overrides, sweeps.
- :mod:`ram_trl.recipes.environment`: the ``--dry-run`` checks against the environment (imports, trainer
  configs, config files, paths) and the trainer settings of a stage.
- :mod:`ram_trl.recipes.tasks`: the demo's three verifiable tasks (prompt generators, reward functions).
- :mod:`ram_trl.recipes.stage`: one stage as its own process (TRL trainer, telemetry callback, manifest).
- :mod:`ram_trl.recipes.runner`: the pipeline (base, warm start, stages, analysis, merges, evaluation).
- :mod:`ram_trl.recipes.evaluate`: held-out scoring with each stage's rewards.
- :mod:`ram_trl.recipes.results`: ``results.json``, ``results.md``, charts, the terminal table.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEMO_RECIPE", "QUICK_OVERRIDES"]

#: The embedded CPU demo recipe (package data; ``recipes/demo-cpu.yaml`` in the repository links to it).
DEMO_RECIPE = Path(__file__).with_name("demo-cpu.yaml")

#: ``ram-trl demo --quick``: the demo's pipeline with tiny sizes (a smoke test of every part in a few minutes).
QUICK_OVERRIDES: dict = {
    "base": {"build": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64}},
    "warm_start": {"steps": 20, "batch_size": 16, "abstain_steps": 10},
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
