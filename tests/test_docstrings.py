"""The package's docstrings: every function and method of the public API (``ram_trl.__all__``, the merge methods, the
callbacks) with two or more parameters documents each of them in an ``Args:`` section (Hugging Face style,
docs/development.md); private helpers carry a short docstring only. Read from the modules' syntax trees; nothing is
imported."""

from __future__ import annotations

import ast
import inspect
import re
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ram_trl"

#: The public API, as ``module path pattern: [qualified name patterns]``: what users call and subclass.
PUBLIC_API = {
    "ram_trl/methods/*.py": ["*"],
    "ram_trl/errors.py": ["*"],
    "ram_trl/callbacks/sparsity.py": ["TaskVectorSparsityCallback.*"],
    "ram_trl/stage/save.py": ["save_agent"],
    "ram_trl/callbacks/preview/callback.py": ["MergePreviewCallback.*"],
    "ram_trl/callbacks/preview/config.py": ["default_preview_every", "preview_merge_config"],
    "ram_trl/callbacks/telemetry/tracker.py": ["TaskVectorTracker.*"],
    "ram_trl/merging/engine.py": ["merge"],
    "ram_trl/analysis/__init__.py": ["analyze"],
    "ram_trl/merging/config/schema.py": ["MergeConfig.*"],
    "ram_trl/recipes/runner.py": ["run_recipe"],
    "ram_trl/recipes/layout.py": ["RunOptions"],
}

#: Functions whose parameters are documented elsewhere, as ``module path:qualified name`` patterns, with the reason.
EXEMPT = {
    "ram_trl/callbacks/sparsity.py:TaskVectorSparsityCallback.on_*": "TrainerCallback events: transformers documents "
    "(args, state, control, **kwargs)",
    "ram_trl/callbacks/preview/callback.py:MergePreviewCallback.on_*": "TrainerCallback events: transformers documents "
    "(args, state, control, **kwargs)",
}

#: An entry of an ``Args:`` section: ``name:``, ``name (`type`, *optional*):``, ``*args:``, ``**kwargs:``.
_ENTRY = re.compile(r"(\*{0,2}\w+)\s*(?:\(.*\))?\s*:")


def documented_args(docstring: str | None) -> set[str] | None:
    """The parameter names an ``Args:`` section documents.

    Args:
        docstring: A docstring as written (indented or not), or ``None``.

    Returns:
        The names of the section's entries (without ``*`` / ``**``), or ``None`` when there is no ``Args:`` section.
        The entries are the section's lines at its first indentation level; deeper lines continue an entry.
    """
    lines = inspect.cleandoc(docstring or "").splitlines()
    if "Args:" not in (line.strip() for line in lines):
        return None
    names: set[str] = set()
    level = None
    inside = False
    for line in lines:
        if line.strip() == "Args:":
            inside, level = True, None
            continue
        if not inside or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:  # the section ends at the next unindented line
            inside = False
            continue
        level = indent if level is None else level
        entry = _ENTRY.match(line.strip())
        if indent == level and entry:
            names.add(entry.group(1).lstrip("*"))
    return names


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    """The parameters a caller passes: all of them, ``*args`` and ``**kwargs`` included, but ``self`` / ``cls``.

    Args:
        function: The function's syntax tree.
        method: Whether it is defined in a class body (its first parameter is then ``self`` or ``cls`` unless it is
            a ``staticmethod``).

    Returns:
        The parameter names in order.
    """
    spec = function.args
    names = [a.arg for a in (*spec.posonlyargs, *spec.args)]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in function.decorator_list)
    if method and not static:
        names = names[1:]
    names += [a.arg for a in spec.kwonlyargs]
    names += [a.arg for a in (spec.vararg, spec.kwarg) if a is not None]
    return names


def _public(module: str, name: str) -> bool:
    return any(
        fnmatchcase(module, path) and any(fnmatchcase(name, n) for n in names) for path, names in PUBLIC_API.items()
    )


def public_functions() -> list[tuple[str, str, list[str], set[str] | None]]:
    """Every function and method of the public API (:data:`PUBLIC_API`) with two or more parameters.

    A module is public when no part of its path starts with ``_`` (``__init__.py`` is its package); a function when
    its name does not (``__init__`` and ``__call__`` count: a class's constructor is documented in the class
    docstring or its own); a method when its class is public too. Functions nested in functions and ``@overload``
    stubs are skipped.

    Returns:
        ``(module path, qualified name, parameters, documented names)`` for each, the documented names ``None``
        without an ``Args:`` section; for ``__init__`` the class docstring's entries count too.
    """
    found: list[tuple[str, str, list[str], set[str] | None]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE.parent)
        if any(part.startswith("_") and part != "__init__.py" for part in module.parts):
            continue
        for name, node, owner in _definitions(ast.parse(path.read_text(encoding="utf-8")).body, None, ""):
            if not _public(module.as_posix(), name):
                continue
            names = parameters(node, owner is not None)
            if len(names) < 2:
                continue
            documented = documented_args(ast.get_docstring(node))
            if node.name == "__init__" and owner is not None:
                in_class = documented_args(ast.get_docstring(owner))
                if in_class is not None:
                    documented = (documented or set()) | in_class
            found.append((module.as_posix(), name, names, documented))
    return found


def _definitions(
    body: list[ast.stmt], owner: ast.ClassDef | None, prefix: str
) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, ast.ClassDef | None]]:
    """The public functions of a module or class body (and of its public classes): qualified name, node, class."""
    found = []
    for node in body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            found += _definitions(node.body, node, f"{prefix}{node.name}.")
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.startswith("_") and node.name not in ("__init__", "__call__"):
            continue
        if any(isinstance(d, ast.Name) and d.id == "overload" for d in node.decorator_list):
            continue
        found.append((f"{prefix}{node.name}", node, owner))
    return found


def _exempt(module: str, name: str) -> str | None:
    return next((p for p in EXEMPT if fnmatchcase(f"{module}:{name}", p)), None)


def test_public_functions_document_every_parameter():
    missing = []
    for module, name, names, documented in public_functions():
        if _exempt(module, name):
            continue
        if documented is None:
            missing.append(f"{module}:{name}: no Args: section ({', '.join(names)})")
        elif undocumented := [n for n in names if n not in documented]:
            missing.append(f"{module}:{name}: Args: lacks {', '.join(undocumented)}")
    assert missing == [], "\n".join(missing)


def test_args_sections_name_only_parameters():
    """An ``Args:`` entry of any function in the package (private ones too) names one of its parameters: a renamed
    or removed parameter does not leave its description behind."""
    stale = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            documented = documented_args(ast.get_docstring(node))
            extra = sorted((documented or set()) - set(parameters(node, method=False)))
            if extra:
                stale.append(f"{path.relative_to(PACKAGE.parent).as_posix()}:{node.lineno} {node.name}: {extra}")
    assert stale == [], "\n".join(stale)


def test_every_exemption_is_used():
    used = {_exempt(module, name) for module, name, _, _ in public_functions()}
    assert set(EXEMPT) <= used, f"exemptions that match nothing: {sorted(set(EXEMPT) - used)}"


def test_the_args_parser():
    doc = """Summary.

    Args:
        first (`int`, *optional*, defaults to `1`): One.
            A continued line: not an entry.
        second: Two
            (on two lines).
        *rest: The others.
        **options: Settings.

    Returns:
        thing: not an argument.
    """
    assert documented_args(doc) == {"first", "second", "rest", "options"}
    assert documented_args("Summary only.") is None
    assert documented_args(None) is None


def test_the_rule_binds_the_public_api_only(tmp_path, monkeypatch):
    """A public function without its ``Args:`` section fails the check; a helper elsewhere needs none."""
    package = tmp_path / "ram_trl"
    (package / "merging").mkdir(parents=True)
    (package / "merging" / "engine.py").write_text('def merge(config, output_dir):\n    """Merge."""\n')
    (package / "helpers.py").write_text('def helper(a, b):\n    """Add."""\n')
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert [(m, n, d) for m, n, _, d in public_functions()] == [("ram_trl/merging/engine.py", "merge", None)]
    with pytest.raises(AssertionError, match=r"engine.py:merge: no Args: section \(config, output_dir\)"):
        test_public_functions_document_every_parameter()
