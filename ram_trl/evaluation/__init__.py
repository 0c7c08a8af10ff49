"""Scoring models on held-out prompts with each stage's reward functions: what the recipes (``ram-trl eval``,
``ram-trl run``) and the merge preview (:mod:`ram_trl.callbacks.preview`) share, below both.

- :mod:`ram_trl.evaluation.spec`: :class:`~ram_trl.evaluation.spec.EvaluationSpec`, the decoding and reporting
  settings (the recipe's ``evaluation:``).
- :mod:`ram_trl.evaluation.rewards`: reward functions imported by path and wrapped so that failures name the stage.
- :mod:`ram_trl.evaluation.scoring`: :class:`~ram_trl.evaluation.scoring.EvalTask`, generation and scoring.
- :mod:`ram_trl.evaluation.retention`: retention of a merge over the base and the specialist.

The main names load on first access (``from ram_trl.evaluation import EvalTask``), so importing one submodule does
not import the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ram_trl.lazy import lazy_exports

if TYPE_CHECKING:
    from ram_trl.evaluation.retention import mean_retention, retention
    from ram_trl.evaluation.scoring import EvalTask, evaluate_loaded, evaluate_model
    from ram_trl.evaluation.spec import EvaluationSpec

#: Public names loaded on first access: name -> defining module.
_LAZY = {
    "EvalTask": "ram_trl.evaluation.scoring",
    "EvaluationSpec": "ram_trl.evaluation.spec",
    "evaluate_loaded": "ram_trl.evaluation.scoring",
    "evaluate_model": "ram_trl.evaluation.scoring",
    "mean_retention": "ram_trl.evaluation.retention",
    "retention": "ram_trl.evaluation.retention",
}

__all__ = [
    "EvalTask",
    "EvaluationSpec",
    "evaluate_loaded",
    "evaluate_model",
    "mean_retention",
    "retention",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
