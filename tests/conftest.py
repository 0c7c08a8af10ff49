"""Fixtures shared by the test modules. The builders behind them are in ``tests/helpers.py``.

Markers (registered in ``pyproject.toml``; ``make test`` and CI run every test whatever its markers):

- ``slow``: takes more than a few seconds (real training runs, subprocess merges);
- ``distributed``: starts several processes (torchrun, accelerate launch, the DeepSpeed launcher, mp.spawn);
- ``network``: needs the package index (builds a separate virtualenv).

Deselect while developing, e.g. ``pytest -m "not slow and not distributed"``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import Checkpoints, make_checkpoints


@pytest.fixture
def ckpts(tmp_path: Path) -> Checkpoints:
    """A tiny float32 base and two sparse agents under ``tmp_path / "inputs"``."""
    return make_checkpoints(tmp_path / "inputs")


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """A merge output directory that does not exist yet."""
    return tmp_path / "merged"
