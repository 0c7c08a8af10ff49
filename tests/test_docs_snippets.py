"""Every fenced python / bash / yaml snippet of README.md and docs/ is checked as pasted: YAML parses and validates
against the schema it is written for (merge config, recipe), Python compiles, its ``ram_trl`` imports exist and its
TRL configs name real fields (with ``bf16`` said explicitly: TRL's configs default it on, which a CPU refuses), bash
is valid and every ``ram-trl`` command line parses. A snippet that cannot be checked here says why, on the line
before its fence: ``<!-- snippet: skip REASON -->``."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = (
    pytest.mark.slow
)  # imports TRL and parses every command line: about 2 minutes on a loaded 2-core machine

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(python|bash|yaml)\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"<!-- snippet: skip (?P<reason>\S.*?) -->\s*$")


def _snippets() -> list[tuple[str, str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            if _SKIP.search(before):
                continue
            line = text[: match.start()].count("\n") + 1
            found.append((f"{page.relative_to(REPO)}:{line}", match.group(1), match.group(2)))
    return found


SNIPPETS = _snippets()


def test_snippets_are_found():
    kinds = {kind for _, kind, _ in SNIPPETS}
    assert kinds == {"python", "bash", "yaml"} and len(SNIPPETS) >= 20


def _check_python(code: str) -> None:
    tree = ast.parse(code)
    classes = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in ("ram_trl", "trl")
        ):
            if node.module.split(".")[0] == "trl":
                pytest.importorskip("trl")
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                classes[alias.asname or alias.name] = getattr(module, alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith("Config"):
            cls = classes.get(node.func.id)
            if cls is None or not dataclasses.is_dataclass(cls):
                continue
            fields = {f.name for f in dataclasses.fields(cls)}
            given = {k.arg for k in node.keywords if k.arg}
            assert given <= fields, f"{node.func.id} has no field {sorted(given - fields)}"
            if "bf16" in fields:  # TRL's configs default bf16 on; transformers refuses it on a CPU
                assert "bf16" in given, f"{node.func.id}(...) must say bf16 (bf16=False on a CPU)"


def _check_yaml(code: str) -> None:
    data = yaml.safe_load(code)
    if isinstance(data, dict) and "merge_method" in data:
        from ram_trl.merging.config.schema import MergeConfig

        MergeConfig.model_validate(data)
    elif isinstance(data, dict) and {"name", "base", "stages"} <= set(data):  # a whole recipe, not a fragment
        from ram_trl.recipes.schema import Recipe

        Recipe.model_validate(data)


def _check_bash(code: str) -> None:
    if shutil.which("bash"):
        done = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    from ram_trl.cli_parser import build_parser

    for line in code.replace("\\\n", " ").splitlines():
        command = re.sub(r"\[[^\]]*\]", "", line.split("#", 1)[0]).strip()  # [--optional FLAGS] left out
        words = shlex.split(command) if command else []
        if "ram-trl" in words:
            args = words[words.index("ram-trl") + 1 :]
        elif "ram_trl" in words and "-m" in words:
            args = words[words.index("ram_trl") + 1 :]
        else:
            continue
        if not args or any("..." in w or w.startswith("<") for w in args):
            continue
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            raise AssertionError(f"`ram-trl {' '.join(args)}` does not parse (exit {exc.code})") from None


@pytest.mark.parametrize("where, kind, code", SNIPPETS, ids=[s[0] for s in SNIPPETS])
def test_snippet(where, kind, code):
    {"python": _check_python, "yaml": _check_yaml, "bash": _check_bash}[kind](code)
