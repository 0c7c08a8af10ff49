"""The package metadata builds without setuptools deprecations (the ``project.license`` table is deprecated; setuptools
stops supporting it after 2027-02-18)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_metadata_applies_without_a_deprecation_warning(tmp_path, monkeypatch):
    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration

    if tuple(int(p) for p in setuptools.__version__.split(".")[:2]) < (77, 0):
        pytest.skip("SPDX license strings need setuptools >= 77")
    monkeypatch.chdir(REPO)  # license-files resolve against the project root
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(setuptools.Distribution(), REPO / "pyproject.toml")
    assert [str(w.message) for w in caught if "license" in str(w.message).lower()] == []
    assert dist.metadata.license_expression == "Apache-2.0"
    assert "LICENSE" in dist.metadata.license_files
