"""Scoring models on held-out prompts with each stage's reward functions (:mod:`ram_trl.evaluation.scoring`)."""
