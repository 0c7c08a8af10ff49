"""Merge methods: pure tensor maths per family, registered by name in :mod:`ram_trl.methods.registry`."""

from ram_trl.methods.registry import (
    ChunkInputs,
    MergeMethod,
    Parameter,
    alias_names,
    method_names,
    register,
    resolve_method,
)

__all__ = [
    "ChunkInputs",
    "MergeMethod",
    "Parameter",
    "alias_names",
    "method_names",
    "register",
    "resolve_method",
]
