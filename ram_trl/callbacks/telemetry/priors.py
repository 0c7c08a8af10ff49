"""Agents trained before this run (prior stages): their activity masks against the base, for the overlap telemetry,
read once with the merge's own reader (the masks the merge will use), one bit per element (docs/telemetry.md)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ram_trl.errors import ConfigError
from ram_trl.io.checkpoint import open_checkpoint
from ram_trl.io.safetensors_io import RowReader
from ram_trl.stage.manifest import StageManifest, manifest_path, read_manifest, verify_stage
from ram_trl.statistics.counting import active_mask


@dataclass(frozen=True)
class PriorStage:
    """A prior stage, read from its manifest."""

    name: str
    manifest_file: Path
    manifest: StageManifest
    checkpoint: Path


def read_prior_stages(paths: Sequence[str | os.PathLike]) -> list[PriorStage]:
    """Read the manifests of prior stages."""
    priors = []
    for path in paths:
        file = manifest_path(path)
        manifest = read_manifest(file)
        try:
            checkpoint = verify_stage(manifest, file)
        except ConfigError as exc:
            raise ConfigError(f"prior stage: {exc}") from None
        if not checkpoint.exists():
            raise ConfigError(f"prior stage {manifest.stage!r} ({file}): its checkpoint {checkpoint} does not exist")
        priors.append(PriorStage(manifest.stage, file, manifest, checkpoint))
    names = [p.name for p in priors]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"prior stages: the stage name {duplicates[0]!r} appears more than once")
    return priors


@dataclass
class PriorMasks:
    """The priors' activity masks on the flat ranges this process measures, one bit per element."""

    stages: list[PriorStage]
    packed: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)

    @property
    def num_priors(self) -> int:
        return len(self.stages)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.packed.values())

    def rows(self, name: str, offset: int, start: int, numel: int) -> torch.Tensor:
        """The priors' masks of elements ``[start, start + numel)`` of the range at ``offset`` of ``name``."""
        assert start % 8 == 0
        packed = self.packed[(name, offset)][:, start // 8 : (start + numel + 7) // 8]
        return torch.from_numpy(np.unpackbits(packed, axis=1, count=numel)).view(torch.bool)


def compute_prior_masks(
    stages: list[PriorStage], base_path: str | os.PathLike, ranges: dict[str, list[tuple[int, int]]], eps: float
) -> PriorMasks:
    """Compute each prior's mask ``|tau| > eps`` against the base on the given flat ranges."""
    # The merge's planner and reader, imported here: a run without prior stages (and ``import ram_trl.callbacks.sparsity``)
    # never loads them. Neither imports the telemetry, so this is no cycle.
    from ram_trl.merging.planner import build_plan
    from ram_trl.merging.streaming import iter_chunks, to_deltas

    base = open_checkpoint(base_path, "base model")
    shapes = {name: tuple(meta.shape) for name, meta in base.tensors.items()}
    agents = [
        open_checkpoint(
            s.checkpoint, f"prior stage {s.name!r} ({s.checkpoint})", base_shapes=shapes, base_config=base.config_path
        )
        for s in stages
    ]
    plan = build_plan(
        base, agents, out_dtype=None, shape_mismatch="error", needs_statistics=False, trims_by_magnitude=False
    )
    tasks = [t for t in plan.tasks if t.floating and t.name in ranges]
    missing = sorted(set(ranges) - {t.name for t in tasks})
    if missing:
        raise ConfigError(
            f"base model {base_path}: has no floating tensor {missing[0]!r}, which the trained model has; "
            "the prior stages' base is not this run's base"
        )
    out = PriorMasks(stages)
    parts: list[torch.Tensor] = []
    current: str | None = None

    def finish(name: str) -> None:
        full = torch.cat(parts, dim=1)
        for offset, numel in ranges[name]:
            piece = full[:, offset : offset + numel].contiguous().numpy()
            out.packed[(name, offset)] = np.packbits(piece, axis=1)
        parts.clear()

    device = torch.device("cpu")
    with RowReader() as reader:
        for chunk in iter_chunks(base, agents, tasks, reader):
            if current is not None and chunk.task.name != current:
                finish(current)
            current = chunk.task.name
            deltas, _ = to_deltas(chunk, device, base, agents, reader)
            parts.append(active_mask(deltas, eps))
        if current is not None:
            finish(current)
    return out
