"""Merge-aware RL: preview, while a stage trains, the merge of the current policy with the earlier stages' agents.
Details: docs/merge-preview.md."""

from __future__ import annotations

from ram_trl.callbacks.preview.callback import MergePreviewCallback
from ram_trl.callbacks.preview.config import PREVIEW_PREFIX, default_preview_every, preview_merge_config
from ram_trl.callbacks.preview.scores import preview_prompt_indices
from ram_trl.callbacks.preview.state import LAST_DIR

__all__ = [
    "LAST_DIR",
    "PREVIEW_PREFIX",
    "MergePreviewCallback",
    "default_preview_every",
    "preview_merge_config",
    "preview_prompt_indices",
]
