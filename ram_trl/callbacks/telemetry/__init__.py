"""Task-vector telemetry during training: what a running RL job's weights changed relative to its base.

Details: docs/telemetry.md.
"""

from ram_trl.callbacks.telemetry.base_weights import MappedCheckpointBase, ModelBase, SnapshotBase, base_name
from ram_trl.callbacks.telemetry.shards import LocalShard, iter_local_shards
from ram_trl.callbacks.telemetry.tracker import TaskVectorTracker

__all__ = [
    "LocalShard",
    "MappedCheckpointBase",
    "ModelBase",
    "SnapshotBase",
    "TaskVectorTracker",
    "base_name",
    "iter_local_shards",
]
