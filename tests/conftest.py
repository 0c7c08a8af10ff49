"""Fixtures shared by the test modules. The builders behind them are in ``tests/helpers.py``.

Markers (registered in ``pyproject.toml``; ``make test`` and CI run every test whatever its markers):

- ``slow``: takes more than a few seconds (real training runs, subprocess merges);
- ``distributed``: starts several processes (torchrun, accelerate launch, the DeepSpeed launcher, mp.spawn);
- ``network``: needs the package index (builds a separate virtualenv);
- ``cuda``: needs a real CUDA device (skipped without one; the ``fake_cuda`` fixture covers the rest on CPU).

Deselect while developing, e.g. ``pytest -m "not slow and not distributed"``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.fake_cuda import fake_cuda_device
from tests.helpers import Checkpoints, make_checkpoints

# Variables that steer process groups and launchers. A test process that sets one of them (at import or in a test)
# hands it to every later job it starts, and the job then joins the wrong group or runs the wrong backend: a leaked
# ``ACCELERATE_USE_CPU`` once broke every later ZeRO-3 worker. Tests set them with ``monkeypatch.setenv`` or in the
# ``env`` of the job they start, never in the test process's own environment.
_LAUNCH_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)
_LAUNCH_PREFIXES = ("ACCELERATE_", "TORCHELASTIC_", "DEEPSPEED_", "DS_", "FSDP_")


def launch_environment() -> dict[str, str]:
    """The process-group and launcher variables in this process's environment."""
    return {
        key: value for key, value in os.environ.items() if key in _LAUNCH_VARIABLES or key.startswith(_LAUNCH_PREFIXES)
    }


_AT_START = launch_environment()


def _changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Refuses a run in which importing a test module changed a launcher variable."""
    changed = _changes(_AT_START, launch_environment())
    if changed:
        raise pytest.UsageError(
            f"importing the test modules changed {changed} in the test process's environment; every later "
            "multi-process job would inherit it: set it in the job's own env or with monkeypatch"
        )


@pytest.fixture(autouse=True)
def _launch_environment_unchanged() -> Iterator[None]:
    """Fails a test that leaves a launcher variable changed, and restores the variable for the tests after it."""
    before = launch_environment()
    yield
    changed = _changes(before, launch_environment())
    if changed:
        for key in changed:
            if key in before:
                os.environ[key] = before[key]
            else:
                os.environ.pop(key, None)
        pytest.fail(
            f"the test left {changed} changed in the test process's environment (restored now); set it in the job's "
            "own env or with monkeypatch",
            pytrace=False,
        )


@pytest.fixture
def ckpts(tmp_path: Path) -> Checkpoints:
    """A tiny float32 base and two sparse agents under ``tmp_path / "inputs"``."""
    return make_checkpoints(tmp_path / "inputs")


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """A merge output directory that does not exist yet."""
    return tmp_path / "merged"


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[torch.device]:
    """A CUDA device on a CPU-only torch (``tests/fake_cuda.py``): ``device="cuda"`` tensors keep their data on the
    CPU and raise as CUDA does when an op mixes them with CPU tensors. Yields ``torch.device("cuda", 0)``."""
    with fake_cuda_device(monkeypatch):
        yield torch.device("cuda", 0)


@pytest.fixture(params=["cpu", "fake_cuda"])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each test twice: on the CPU, and on the fake CUDA device (see :func:`fake_cuda`)."""
    if request.param == "cpu":
        return torch.device("cpu")
    return request.getfixturevalue("fake_cuda")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips the tests marked ``cuda`` where torch has no real CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a real CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
