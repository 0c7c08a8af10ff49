"""Loading through transformers without its progress bars, and without changing the host's setting (in a trainer's
process the switch in ``transformers.utils.logging`` is theirs)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["progress_bars_off"]


@contextmanager
def progress_bars_off() -> Iterator[None]:
    """transformers' progress bars off inside the block, then as they were before it (on stays on, off stays off)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
