"""Task-vector telemetry during training: what a running RL job's weights changed relative to its base.
Details: docs/telemetry.md."""

from ram_trl.callbacks.telemetry.base_weights import MappedCheckpointBase, ModelBase
from ram_trl.callbacks.telemetry.tracker import TaskVectorTracker

__all__ = ["MappedCheckpointBase", "ModelBase", "TaskVectorTracker"]
