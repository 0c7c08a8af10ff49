"""Held-out scoring with each stage's rewards, as the recipes import it: the names of
:mod:`ram_trl.evaluation.scoring`, where the evaluation lives (below the recipes and the merge preview, which both
use it)."""

from __future__ import annotations

from ram_trl.evaluation.scoring import (
    EvalTask,
    evaluate_loaded,
    evaluate_model,
    generate,
    generation_tokenizer,
    load_model,
    score_completions,
)

__all__ = [
    "EvalTask",
    "evaluate_loaded",
    "evaluate_model",
    "generate",
    "generation_tokenizer",
    "load_model",
    "score_completions",
]
