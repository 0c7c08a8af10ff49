"""The guest in a trainer's process: callbacks for TRL / transformers trainers, and what they run.

- :class:`TaskVectorSparsityCallback` (:mod:`.sparsity`): the task vector measured while it trains (through the
  tracker of :mod:`.telemetry`), the run ending as a merge stage (:func:`save_agent`, ``ram_stage.json``).
- :class:`MergePreviewCallback` (:mod:`.preview`): the same plus, every N steps, the merge of the current policy
  with the earlier stages' agents, scored on every stage's validation prompts.

``from ram_trl.callbacks import TaskVectorSparsityCallback`` loads the telemetry only: the preview (which uses the
merge engine) loads on first use of :class:`MergePreviewCallback`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback, save_agent
from ram_trl.lazy import lazy_exports

if TYPE_CHECKING:
    from ram_trl.callbacks.preview import MergePreviewCallback

__all__ = ["MergePreviewCallback", "TaskVectorSparsityCallback", "save_agent"]

__getattr__, __dir__ = lazy_exports(
    __name__, globals(), {"MergePreviewCallback": "ram_trl.callbacks.preview"}
)
