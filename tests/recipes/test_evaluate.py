"""ram_trl/recipes/evaluate.py: the recipes' names of the evaluation, which lives in ram_trl/evaluation/ (tested in
tests/evaluation/): user code importing it from the recipes keeps working."""

from __future__ import annotations

import ram_trl.evaluation.scoring as scoring
import ram_trl.recipes as recipes
import ram_trl.recipes.evaluate as evaluate
from ram_trl.evaluation.spec import EvaluationSpec
from ram_trl.recipes.schema import EvaluationSpec as SchemaEvaluationSpec


def test_the_recipes_re_export_the_evaluation():
    for name in evaluate.__all__:
        assert getattr(evaluate, name) is getattr(scoring, name), name
    assert recipes.EvalTask is scoring.EvalTask
    assert recipes.evaluate_model is scoring.evaluate_model
    assert recipes.EvaluationSpec is EvaluationSpec is SchemaEvaluationSpec
    assert {"EvalTask", "EvaluationSpec", "evaluate_model"} <= set(dir(recipes))


def test_unknown_names_of_the_recipes_package_raise_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        recipes.nothing  # noqa: B018
