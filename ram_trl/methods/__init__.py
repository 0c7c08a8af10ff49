"""Merge methods: the method API (:mod:`~ram_trl.methods.base`), pure tensor maths per family, and the methods
registered by name in :mod:`ram_trl.methods.registry`."""

from ram_trl.methods.base import Alias, ChunkInputs, MergeMethod, Parameter, TensorView
from ram_trl.methods.registry import alias_names, method_names, register, resolve_method

__all__ = [
    "Alias",
    "ChunkInputs",
    "MergeMethod",
    "Parameter",
    "TensorView",
    "alias_names",
    "method_names",
    "register",
    "resolve_method",
]
