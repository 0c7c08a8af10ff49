"""The shared method parameters (:mod:`ram_trl.methods.parameters`): one definition each, in the order the methods
list them, with the defaults of :mod:`ram_trl.defaults`."""

from __future__ import annotations

from ram_trl import defaults
from ram_trl.methods import resolve_method
from ram_trl.methods.base import Parameter
from ram_trl.methods.parameters import INT8_MASK, LAMBDA, WEIGHT, density, normalize, rescale, sparsified_parameters


def test_shared_parameters_carry_the_defaults():
    assert (LAMBDA.name, LAMBDA.scope, LAMBDA.default) == ("lambda", "global", defaults.LAMBDA)
    assert (WEIGHT.name, WEIGHT.scope, WEIGHT.default) == ("weight", "agent", defaults.WEIGHT)
    assert (INT8_MASK.kind, INT8_MASK.default) == (bool, False)
    kept = density("kept")
    assert (kept.default, kept.minimum, kept.maximum, kept.scope) == (defaults.DENSITY, 0.0, 1.0, "agent")
    assert normalize(True, "h") == Parameter("normalize", bool, True, "global", "h")
    assert rescale(False, "h") == Parameter("rescale", bool, False, "global", "h")


def test_sparsified_parameters_are_listed_in_order_with_the_methods_own_before_int8_mask():
    own = Parameter("gamma", float, 0.01, "agent", "outliers")
    names = [p.name for p in sparsified_parameters(False, "n", True, "r", "d", own)]
    assert names == ["lambda", "normalize", "rescale", "weight", "density", "gamma", "int8_mask"]
    assert [p.name for p in sparsified_parameters(False, "n", True, "r", "d")][-2:] == ["density", "int8_mask"]


def test_methods_share_one_definition():
    for name in ("task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "della", "della_linear"):
        method, _ = resolve_method(name)
        assert method.parameter("lambda") is LAMBDA, name
        assert method.parameter("weight") is WEIGHT, name
        assert method.parameter("int8_mask") is INT8_MASK, name
    # defaults that differ between methods stay the methods' own
    assert resolve_method("della")[0].parameter("normalize").default is True
    assert resolve_method("della_linear")[0].parameter("normalize").default is False
    assert resolve_method("breadcrumbs")[0].parameter("rescale").default is False
    assert resolve_method("dare_ties")[0].parameter("rescale").default is True
