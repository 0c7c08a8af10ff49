"""Scoring models on held-out prompts with each stage's rewards, for the recipes and the merge preview.
Names load on first access, so importing one submodule does not import the others."""

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

__all__ = ["EvalTask", "EvaluationSpec", "evaluate_loaded", "evaluate_model", "mean_retention", "retention"]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
