"""Task-vector telemetry during training: what a running RL job's weights changed relative to its base.

The counting reuses :mod:`ram_trl.statistics` (the code behind the merge's statistics pass and ``ram-trl analyze``).
:mod:`ram_trl.callbacks.telemetry.shards` yields the locally held elements of every parameter (plain, DDP, DeepSpeed ZeRO-3,
FSDP2), so measurements run on each rank's own partition and only counts are all-reduced.

- :class:`TaskVectorTracker` (:mod:`ram_trl.callbacks.telemetry.tracker`): ``setup(model)`` / ``measure(model, step)`` for
  any training loop; :class:`ram_trl.callbacks.TaskVectorSparsityCallback` drives it from a TRL / transformers
  trainer.
- :mod:`ram_trl.callbacks.telemetry.layout`: what a model's process measures (regions: dense, LoRA, frozen); and
  :mod:`ram_trl.callbacks.telemetry.chunks`: the chunks a measurement counts and the buffers they reuse.
- :mod:`ram_trl.callbacks.telemetry.base_weights`: where base weights come from (reference model, memory-mapped checkpoint,
  snapshot) and how parameter names map to checkpoint names.
- :mod:`ram_trl.callbacks.telemetry.priors`: the activity masks of agents trained before (prior stages).
- :mod:`ram_trl.callbacks.telemetry.precision`: the training and save dtypes (``save_dtype="auto"``) and the
  densities in each.
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
