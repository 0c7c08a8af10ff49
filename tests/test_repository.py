"""The repository leaves nothing behind: every virtualenv the project's scripts and tests create is ignored by git and
removed by ``make clean``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _created_venvs() -> set[str]:
    sources = [REPO / ".ci" / "run", REPO / "Makefile", *sorted((REPO / "tests").rglob("*.py"))]
    found = set()
    for source in sources:
        found |= set(re.findall(r"\.venv(?:-[a-z0-9]+)?\b", source.read_text(encoding="utf-8")))
    return found


def test_the_project_venvs_are_found():
    assert {".venv", ".venv-ci", ".venv-ppo"} <= _created_venvs()


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_every_created_venv_is_ignored_by_git():
    venvs = sorted(_created_venvs())
    ignored = subprocess.run(
        ["git", "check-ignore", *[f"{v}/x" for v in venvs]], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    assert sorted(p.removesuffix("/x") for p in ignored) == venvs


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_clean_removes_every_created_venv():
    # as a user types it: not inside CI's own make (MAKELEVEL prints directories) nor with CI's VENV exported
    env = {k: v for k, v in os.environ.items() if k not in {"VENV", "MAKEFLAGS", "MAKELEVEL", "MFLAGS"}}
    command = subprocess.run(
        ["make", "--no-print-directory", "-n", "clean"], cwd=REPO, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert set(_created_venvs()) <= set(command)
