"""Package attributes loaded on first access (PEP 562), so that importing a package stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, namespace: dict[str, Any], names: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module-level ``__getattr__`` and ``__dir__`` for names defined in modules it does not import.

    Args:
        package: The package's ``__name__`` (named in the ``AttributeError`` of an unknown name).
        namespace: The package's ``globals()``: a loaded name is stored there, so it is looked up only once.
        names: Each lazily loaded name -> the module that defines it.

    Returns:
        ``(__getattr__, __dir__)``, to assign at the package's top level.

    Example:

    ```python
    >>> __getattr__, __dir__ = lazy_exports(__name__, globals(), {"merge": "ram_trl.merging.engine"})
    ```
    """

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
