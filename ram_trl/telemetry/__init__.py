"""Task-vector telemetry during training: what a running RL job's weights changed relative to its base.

The counting reuses :mod:`ram_trl.statistics` (the code behind the merge's statistics pass and ``ram-trl analyze``).
:mod:`ram_trl.telemetry.shards` yields the locally held elements of every parameter (plain, DDP, DeepSpeed ZeRO-3,
FSDP2), so measurements run on each rank's own partition and only counts are all-reduced.
"""

from ram_trl.telemetry.base import MappedCheckpointBase, ModelBase, SnapshotBase, base_name
from ram_trl.telemetry.shards import LocalShard, iter_local_shards
from ram_trl.telemetry.tracker import TaskVectorTracker

__all__ = [
    "LocalShard",
    "MappedCheckpointBase",
    "ModelBase",
    "SnapshotBase",
    "TaskVectorTracker",
    "base_name",
    "iter_local_shards",
]
