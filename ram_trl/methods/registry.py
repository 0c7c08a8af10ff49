"""Merge methods registered by name: the built-in methods (each declared whole in its family's file), their aliases,
and :func:`register` for more."""

from __future__ import annotations

from typing import Any

from ram_trl.methods import breadcrumbs, dare, della, fisher, linear, model_stock, ram, sce, slerp, ties
from ram_trl.methods.base import Alias, MergeMethod

__all__ = ["alias_names", "method_names", "register", "resolve_method"]


_METHODS: dict[str, MergeMethod] = {}
_ALIASES: dict[str, Alias] = {}


def register(method: MergeMethod, aliases: dict[str, Alias] | None = None) -> MergeMethod:
    """Make ``method`` (and its aliases) available by name, to configs, ``merge()`` and ``ram-trl methods``; returns
    ``method``.

    Args:
        method (`MergeMethod`): The method; its ``name`` becomes a canonical name.
        aliases (`dict[str, Alias]`, *optional*): Other names, each optionally with other parameter defaults.

    Raises:
        ValueError: A name (canonical or alias) is already registered.
    """
    for name in [method.name, *(aliases or {})]:
        if name in _METHODS or name in _ALIASES:
            raise ValueError(f"merge method name {name!r} is already registered")
    _METHODS[method.name] = method
    _ALIASES.update(aliases or {})
    return method


def resolve_method(name: str) -> tuple[MergeMethod, dict[str, Any]]:
    """Look a method up by canonical name or alias (case-insensitive, surrounding spaces ignored): ``(method,
    default_overrides)``, the parameter defaults the alias implies.

    Args:
        name (`str`): The name as the config gives it.

    Raises:
        KeyError: with the list of known names.
    """
    key = name.strip().lower()
    if key in _METHODS:
        return _METHODS[key], {}
    if key in _ALIASES:
        alias = _ALIASES[key]
        return _METHODS[alias.method], dict(alias.defaults)
    raise KeyError(name)


def method_names() -> list[str]:
    """The canonical names of the registered methods, sorted."""
    return sorted(_METHODS)


def alias_names() -> dict[str, Alias]:
    """The registered aliases, in registration order: name to :class:`Alias` (its method and default overrides)."""
    return dict(_ALIASES)


# ---------------------------------------------------------------------------------------------------------------
# The built-in methods, one line each, in the order ``ram-trl methods`` lists their aliases

register(ram.RAM)
register(ram.RAM_UNIQUE)
register(ram.RAM_PLUS, ram.RAM_PLUS_ALIASES)
register(ram.RAM_PLUS_SOFT, ram.RAM_PLUS_SOFT_ALIASES)
register(linear.TASK_ARITHMETIC, linear.TASK_ARITHMETIC_ALIASES)
register(ties.TIES)
register(dare.DARE_LINEAR, dare.DARE_LINEAR_ALIASES)
register(dare.DARE_TIES)
register(linear.LINEAR, linear.LINEAR_ALIASES)
register(fisher.FISHER, fisher.FISHER_ALIASES)
register(slerp.SLERP)
register(breadcrumbs.BREADCRUMBS)
register(breadcrumbs.BREADCRUMBS_TIES)
register(model_stock.MODEL_STOCK)
register(della.DELLA)
register(della.DELLA_LINEAR)
register(sce.SCE)
