"""Exception types. Every message names the file, tensor and agent involved, and what to change."""

from __future__ import annotations


class RamTrlError(Exception):
    """Base class for errors raised by ram_trl on bad input."""


class ConfigError(RamTrlError, ValueError):
    """The merge config is invalid (including paths that do not exist); raised before any tensor is read."""


class CheckpointError(RamTrlError):
    """A checkpoint directory or file is not a checkpoint, is corrupt, or is inconsistent with the base."""


class NonFiniteError(RamTrlError):
    """An input tensor holds NaN or Inf values."""


class OutputError(RamTrlError):
    """The output cannot be written or committed: it exists, overlaps an input, appeared meanwhile, or the file
    system refuses it (read-only, full, no permission)."""
