"""The run context of a merge (config, inputs, plan, ranks, accumulated state), handed by the engine to the passes,
and the input opening and density checks the analysis shares; reads no tensor data. ``engine -> passes -> context``,
``analysis -> context`` (docs/development.md)."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ram_trl.distributed import DistContext
from ram_trl.errors import CheckpointError
from ram_trl.io.checkpoint import Checkpoint, open_checkpoint
from ram_trl.io.json_files import read_json_object
from ram_trl.io.safetensors_io import RowReader, dtype_itemsize, whole_number
from ram_trl.io.vocabulary import pad_vocabularies
from ram_trl.merging.config.settings import ResolvedConfig
from ram_trl.merging.planner import DEFAULT_CHUNK_BUDGET, DEFAULT_MAX_SHARD_SIZE, MergePlan, TensorTask
from ram_trl.merging.streaming import InputCache, ReadCounter
from ram_trl.statistics import OverlapStatistics
from ram_trl.statistics.counting import DEFAULT_EPS
from ram_trl.statistics.effect import MergeEffect

logger = logging.getLogger(__name__)

DENSE_AGENT_WARNING = 0.99  #: Agents differing from the base in more than this share of elements are warned about.


@dataclass
class MergeOptions:
    """Run options (the CLI flags), separate from what is merged (the config)."""

    overwrite: bool = False
    dry_run: bool = False
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE
    device: str = "cpu"
    allow_pickle: bool = False
    chunk_budget: str | int = DEFAULT_CHUNK_BUDGET
    progress: bool = True
    allow_external_shards: bool = False
    print_summary: bool = False
    input_cache: str | int = "auto"


@dataclass
class MergeState:
    """What the passes accumulate: global and per-tensor overlap statistics, cuts, warnings, bytes read and the
    inputs the statistics pass keeps for the merge pass (``cache``)."""

    stats: OverlapStatistics
    tensor_stats: dict[str, OverlapStatistics] = field(default_factory=dict)
    lambdas: list[float] | None = None
    warnings: list[str] = field(default_factory=list)
    read: ReadCounter = field(default_factory=ReadCounter)
    bytes_written: int = 0
    cache: InputCache | None = None
    effect: MergeEffect = field(default_factory=MergeEffect)


@dataclass
class RunContext:
    """Everything one merge run's passes read and update, in one object."""

    resolved: ResolvedConfig
    options: MergeOptions
    base: Checkpoint
    agents: list[Checkpoint]
    plan: MergePlan
    dist: DistContext
    state: MergeState
    device: torch.device
    tasks: list[TensorTask]
    reader: RowReader | None = None

    @property
    def progress(self) -> bool:
        """Show progress bars (the main process only)."""
        return self.options.progress and self.dist.is_main

    @property
    def eps(self) -> float:
        """The activity threshold of the overlap counts."""
        return run_eps(self.resolved)

    @property
    def checked(self) -> bool:
        """Whether the merge pass needs no finiteness check (allowed, or done by the statistics pass)."""
        return self.resolved.allow_nonfinite or self.resolved.method.needs_statistics

    def require_reader(self) -> RowReader:
        """The run's reader (the passes run inside the engine's ``with RowReader()``)."""
        assert self.reader is not None, "the passes run with a reader"
        return self.reader


def run_eps(resolved: ResolvedConfig) -> float:
    """The activity threshold of a config (its ``eps`` parameter, else the default)."""
    return float(resolved.params.get("eps", DEFAULT_EPS))


def open_inputs(
    resolved: ResolvedConfig, allow_pickle: bool, allow_external_shards: bool = False, fetch: bool = True
) -> tuple[Checkpoint, list[Checkpoint]]:
    """Open the base and every agent (headers only; the base's ``config.json`` is validated too)."""
    base = open_checkpoint(
        resolved.base_path,
        f"base model ({resolved.base_path})",
        allow_pickle=allow_pickle,
        allow_external_shards=allow_external_shards,
        fetch=fetch,
    )
    if base.config_path is not None:
        check_model_config(base.config_path, base.role)
    shapes = {name: tuple(meta.shape) for name, meta in base.tensors.items()}
    agents = [
        open_checkpoint(
            agent.path,
            f"agent {agent.index} ({agent.name}, {agent.path})",
            allow_pickle=allow_pickle,
            allow_external_shards=allow_external_shards,
            base_shapes=shapes,
            base_config=base.config_path,
            fetch=fetch,
        )
        for agent in resolved.agents
    ]
    if resolved.union_rows is not None:
        base, *agents = pad_vocabularies(base, agents, resolved.union_rows)
    return base, agents


def task_input_bytes(task: TensorTask, agents: list[Checkpoint]) -> int:
    """Bytes of one tensor in the base and every agent (what the split over processes balances)."""
    total = task.base.numel * dtype_itemsize(task.base.dtype)
    if task.floating:
        total += sum(
            a.tensors[task.name].numel * dtype_itemsize(a.tensors[task.name].dtype)
            for a in agents
            if task.name in a.tensors
        )
    return total


def check_densities(resolved: ResolvedConfig, state: MergeState, emit: bool = True) -> None:
    """Warn about agents whose task vector is zero, or differs from the base almost everywhere (another base?)."""
    for t, agent in enumerate(resolved.agents):
        density = state.stats.density(t)
        if state.stats.active(t) == 0:
            message = (
                f"agent {agent.index} ({agent.name}): its task vector is zero at eps={run_eps(resolved):g} "
                "(identical to the base: density 0); it contributes nothing"
            )
        elif density > DENSE_AGENT_WARNING:
            message = (
                f"agent {agent.index} ({agent.name}): {density:.2%} of its elements differ from the base; "
                "is it derived from this base model (same checkpoint, same dtype)?"
            )
        else:
            continue
        state.warnings.append(message)
        if emit:
            warnings.warn(message, stacklevel=2)
            logger.warning(message)


__all__ = [
    "MergeOptions",
    "MergeState",
    "RunContext",
    "check_densities",
    "check_model_config",
    "open_inputs",
    "run_eps",
    "task_input_bytes",
]


def check_model_config(path: Path, role: str) -> dict[str, Any]:
    """A model's ``config.json``: a JSON object whose size fields, when present, are positive integers."""
    config = read_json_object(path, role)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size"):
        if key in config and not (whole_number(config[key]) and config[key] > 0):
            raise CheckpointError(f"{role}: {path}: {key} must be a positive integer, got {config[key]!r}")
    for key in ("model_type", "torch_dtype", "dtype"):
        if key in config and config[key] is not None and not isinstance(config[key], str):
            raise CheckpointError(f"{role}: {path}: {key} must be a string, got {config[key]!r}")
    return config
