"""The guest in a trainer's process: callbacks for TRL / transformers trainers, and what they run.
Details: docs/telemetry.md and docs/merge-preview.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback
from ram_trl.lazy import lazy_exports
from ram_trl.stage.save import save_agent

if TYPE_CHECKING:
    from ram_trl.callbacks.preview import MergePreviewCallback

__all__ = ["MergePreviewCallback", "TaskVectorSparsityCallback", "save_agent"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), {"MergePreviewCallback": "ram_trl.callbacks.preview"})
