"""The digest of a reward function's code closure, for ``--resume``'s evaluation reuse (docs/recipes.md)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import inspect
import sys
import sysconfig
from pathlib import Path
from typing import Any

from ram_trl.digest import text_digest

__all__ = ["UnsoundKey", "library_versions", "reward_digest"]

#: Libraries whose versions key every evaluation (a version change can change generations or scores).
LIBRARIES = ("torch", "transformers", "trl", "peft", "ram_trl")


class UnsoundKey(Exception):
    """The digest cannot be computed soundly; the message says why."""


def library_versions() -> dict[str, str]:
    """The installed versions of :data:`LIBRARIES` (``"absent"`` for one not installed)."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def _installed_roots() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple(Path(r).resolve() for r in roots)


def _is_installed(file: Path, roots: tuple[Path, ...]) -> bool:
    return any(file.is_relative_to(root) for root in roots) or "site-packages" in file.parts


def _module_file(name: str) -> Path | None | bool:
    """Module ``name``'s source file; ``None`` when it has none (built-in, frozen), ``False`` when not found."""
    module = sys.modules.get(name)
    if module is not None:
        origin = getattr(module, "__file__", None)
    else:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return False
        if spec is None:
            return False
        origin = spec.origin if spec.has_location else None
    return Path(origin).resolve() if origin else None


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module an AST imports (``import a.b``: ``a`` and ``a.b``; ``from .c import d`` also ``pkg.c.d``)."""
    names: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                names.update(".".join(parts[: i + 1]) for i in range(len(parts)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - node.level + 1]
                source = ".".join(parts + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source:
                names.add(source)
                names.update(f"{source}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def _top_installed(top: str, roots: tuple[Path, ...]) -> bool:
    """Whether top-level module ``top`` is built in or lies in the standard library or site-packages."""
    module = sys.modules.get(top)
    try:
        spec = module.__spec__ if module is not None else importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return module is not None  # a module without a spec (``__main__``-like): nothing to read
    if spec.has_location and spec.origin:
        places = [spec.origin]
    else:
        places = list(spec.submodule_search_locations or [])
        if not places:
            return True  # built-in or frozen
    return all(_is_installed(Path(p).resolve(), roots) for p in places)


def _closure(modules: set[str]) -> dict[str, str]:
    """SHA-256 of each project-local module's source reachable by imports (``"absent"`` if not found)."""
    roots = _installed_roots()
    installed: dict[str, bool] = {}
    digests: dict[str, str] = {}
    pending = sorted(modules)
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        top = name.partition(".")[0]
        if top not in installed:  # a whole installed library is keyed by its version, never imported here
            installed[top] = _top_installed(top, roots)
        if installed[top]:
            continue
        file = _module_file(name)
        if file is False:
            digests[name] = "absent"
            continue
        if file is None:
            continue
        if file.suffix != ".py":
            raise UnsoundKey(f"module {name!r} has no Python source ({file.name})")
        try:
            source = file.read_bytes()
            tree = ast.parse(source, filename=str(file))
        except (OSError, SyntaxError, ValueError) as exc:
            raise UnsoundKey(f"module {name!r}: cannot read {file} ({exc})") from None
        digests[name] = text_digest(source)
        pending.extend(_imported_names(tree, name, file.name == "__init__.py") - seen)
    return digests


def _roots_of(obj: Any, modules: set[str], arguments: list[str], depth: int = 0) -> None:
    """Collect the modules whose code ``obj`` runs, and the ``repr`` of the values bound into it."""
    if depth > 50:
        raise UnsoundKey("the reward is wrapped more than 50 times")
    if isinstance(obj, functools.partial):
        _roots_of(obj.func, modules, arguments, depth + 1)
        for value in [*obj.args, *obj.keywords.values()]:
            text = repr(value)
            if " at 0x" in text:
                raise UnsoundKey(f"a functools.partial argument has no stable repr ({text[:60]})")
            arguments.append(text)
        return
    if inspect.ismethod(obj):
        _roots_of(obj.__func__, modules, arguments, depth + 1)
        _roots_of(type(obj.__self__) if not inspect.isclass(obj.__self__) else obj.__self__, modules, arguments)
        return
    module = getattr(obj, "__module__", None) if (inspect.isroutine(obj) or inspect.isclass(obj)) else None
    if module is None and not inspect.isroutine(obj):  # a callable object: its class's code
        for cls in type(obj).__mro__:
            if cls.__module__ != "builtins":
                modules.add(cls.__module__)
    elif module:
        modules.add(module)
        if inspect.isclass(obj):
            modules.update(cls.__module__ for cls in obj.__mro__ if cls.__module__ != "builtins")
    wrapped = getattr(obj, "__wrapped__", None)
    if wrapped is not None and wrapped is not obj:
        _roots_of(wrapped, modules, arguments, depth + 1)


def reward_digest(path: str, obj: Any) -> str:
    """The digest of the code a reward function runs."""
    modules: set[str] = set()
    module_name = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
    modules.add(module_name)
    arguments: list[str] = []
    _roots_of(obj, modules, arguments)
    sources = _closure(modules)
    text = repr((sorted(sources.items()), arguments))
    return text_digest(text)
