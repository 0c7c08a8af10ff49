"""The conftest guard against launcher variables leaking into the test process's environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run_pytest(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Runs ``body`` as a test module in its own directory whose conftest is the project's."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import _launch_environment_unchanged, pytest_collection_finish  # noqa: F401\n"
    )
    (tmp_path / "test_probe.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_GUARD_PROBE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_variable_set_at_import_refuses_the_run(tmp_path: Path) -> None:
    result = _run_pytest(
        tmp_path, 'import os\nos.environ["ACCELERATE_GUARD_PROBE"] = "1"\n\ndef test_nothing():\n    pass\n'
    )
    assert result.returncode != 0
    assert "ACCELERATE_GUARD_PROBE" in result.stdout + result.stderr
    assert "importing the test modules changed" in result.stdout + result.stderr


@pytest.mark.slow
def test_a_variable_left_by_a_test_fails_it_and_is_restored(tmp_path: Path) -> None:
    body = (
        "import os\n\n"
        'def test_leaks():\n    os.environ["ACCELERATE_GUARD_PROBE"] = "1"\n\n'
        'def test_after():\n    assert "ACCELERATE_GUARD_PROBE" not in os.environ\n\n'
        'def test_monkeypatch_is_fine(monkeypatch):\n    monkeypatch.setenv("ACCELERATE_GUARD_PROBE", "2")\n'
    )
    result = _run_pytest(tmp_path, body)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "3 passed, 1 error" in output, output
    assert "left ['ACCELERATE_GUARD_PROBE'] changed" in output
