"""ram_trl.lazy: a package's names loaded from their modules on first access, once."""

from __future__ import annotations

import sys

import pytest

import ram_trl
import ram_trl.evaluation
from ram_trl.lazy import lazy_exports


def test_a_name_is_loaded_on_first_access_and_kept():
    namespace: dict = {"existing": 1}
    getattr_, dir_ = lazy_exports("pkg", namespace, {"dumps": "json"})
    assert dir_() == ["dumps", "existing"]
    import json

    assert getattr_("dumps") is json.dumps and namespace["dumps"] is json.dumps
    with pytest.raises(AttributeError, match="module 'pkg' has no attribute 'loads'"):
        getattr_("loads")


@pytest.mark.parametrize(
    ("package", "name", "module"),
    [(ram_trl, "merge", "ram_trl.merging.engine"), (ram_trl.evaluation, "EvaluationSpec", "ram_trl.evaluation.spec")],
)
def test_the_packages_lazy_names(package, name, module):
    assert name in dir(package) and name in package.__all__
    assert getattr(package, name) is getattr(sys.modules[module], name)
    with pytest.raises(AttributeError, match=f"module '{package.__name__}' has no attribute 'missing'"):
        package.missing  # noqa: B018
