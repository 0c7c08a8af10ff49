"""Merge-aware RL: the merge-preview callback (:mod:`ram_trl.preview.callback`)."""

from __future__ import annotations

from ram_trl.preview.callback import (
    CHECKPOINT_DIR,
    LAST_DIR,
    PREVIEW_PREFIX,
    STATE_FILE,
    WORK_DIR,
    MergePreviewCallback,
    check_last_dir,
    default_preview_every,
    preview_merge_config,
    preview_prompt_indices,
    weights_digest,
)

__all__ = [
    "CHECKPOINT_DIR",
    "LAST_DIR",
    "PREVIEW_PREFIX",
    "STATE_FILE",
    "WORK_DIR",
    "MergePreviewCallback",
    "check_last_dir",
    "default_preview_every",
    "preview_merge_config",
    "preview_prompt_indices",
    "weights_digest",
]
