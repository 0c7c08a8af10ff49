"""ram_trl/evaluation/spec.py: the evaluation settings and the strict base of the settings models (unknown keys,
NaN/Inf and booleans given for numbers refused; the recipe schema's models share it)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ram_trl.evaluation.spec import MAX_SEED, EvaluationSpec, StrictModel
from ram_trl.recipes.schema import Recipe


def test_defaults_are_greedy_decoding_of_32_tokens_in_float32():
    spec = EvaluationSpec()
    assert (spec.do_sample, spec.max_new_tokens, spec.dtype, spec.seed, spec.batch_size) == (
        False,
        32,
        "float32",
        0,
        64,
    )
    assert spec.retention_min_gain == 0.02


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_new_tokens": True}, "max_new_tokens: must be a number, got True"),
        ({"temperature": float("nan")}, "temperature"),
        ({"retention_min_gain": float("inf")}, "retention_min_gain"),
        ({"max_new_token": 8}, "max_new_token"),
        ({"seed": MAX_SEED + 1}, "seed"),
        ({"dtype": "float64"}, "dtype"),
    ],
)
def test_bad_fields_are_refused_by_name(fields, message):
    with pytest.raises(ValidationError, match=message):
        EvaluationSpec.model_validate(fields)


def test_the_recipe_models_share_the_strict_base():
    assert issubclass(EvaluationSpec, StrictModel)
    assert issubclass(Recipe, StrictModel)
    assert EvaluationSpec.model_validate({"do_sample": True}).do_sample is True  # a bool field takes a bool
