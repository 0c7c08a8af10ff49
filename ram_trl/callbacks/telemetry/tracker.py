"""The task-vector tracker: measures a training model's task vector against its base, framework-agnostic.
Details: docs/telemetry.md."""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Literal

import torch

from ram_trl import defaults
from ram_trl.callbacks.telemetry.base_weights import (
    BaseSource,
    DeviceBase,
    MappedCheckpointBase,
    ModelBase,
    SnapshotBase,
    resident_bytes,
    source_fingerprint,
)
from ram_trl.callbacks.telemetry.chunks import (
    Chunk,
    ChunkCounts,
    Workspace,
    flag_count,
    nonfinite_count,
    region_chunks,
    row_numel,
    sample_windows,
)
from ram_trl.callbacks.telemetry.layout import ModelLayout, check_layout, compute_device, local_regions, model_layout
from ram_trl.callbacks.telemetry.metrics import measurement_metrics
from ram_trl.callbacks.telemetry.precision import (
    auto_save_dtype,
    precision_record,
    resolve_save_dtype,
    training_dtypes,
)
from ram_trl.callbacks.telemetry.priors import PriorMasks, compute_prior_masks, read_prior_stages
from ram_trl.callbacks.telemetry.shards import training_context
from ram_trl.errors import CheckpointError, ConfigError
from ram_trl.parallel import compute_pool, imap_blocks, plan_threads, single_threaded_call, single_threaded_worker
from ram_trl.stage.manifest import BaseFingerprint, base_model_path, fingerprint_checkpoint, unchecked_base
from ram_trl.statistics import MagnitudeStatistics, OverlapStatistics, magnitude_bin_edges, sum_of_squares
from ram_trl.statistics.counting import DEFAULT_EPS, float32_threshold, masked_deltas

#: Elements compared at once (a multiple of 8). Small enough for the buffers (~6 MB) to stay in cache.
CHUNK_ELEMENTS = 1 << 18
#: Models with fewer local elements are measured on the calling thread (no worker threads).
SMALL_MODEL_ELEMENTS = 1 << 20
#: Default size of the systematic sample the magnitude statistics are taken from (see :class:`TaskVectorTracker`).
MAGNITUDE_SAMPLE_ELEMENTS = defaults.MAGNITUDE_SAMPLE
DEFAULT_PREFIX = defaults.METRIC_PREFIX
_FLOAT32_EXACT = (torch.float32, torch.bfloat16, torch.float16)


class TaskVectorTracker:
    """Measures a training model's task vector (trained weights minus base) while it trains.

    Args:
        base_model: The base checkpoint on disk (read through memory maps), or ``None``.
        reference_model: A model in memory holding the base weights (e.g. a trainer's reference model), or
            ``None``. Preferred over ``base_model`` (nothing is read from disk).
        eps: Activity threshold, ``|tau| > eps`` (strict), as RAM masks.
        save_dtype: The dtype the agent is saved in, the ``density_saved`` view: ``"auto"`` (the dtype of the trained
            parameters, resolved at :meth:`setup`), ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        prior_stages: Stage manifests (``ram_stage.json`` files or their directories) of agents trained before
            this one from the same base.
        r: RAM+ / RAM+s rescale strength for the prior-stage lambda_t.
        alpha: RAM+ clip bound of rho_t.
        prefix: Prefix of every metric name.
        magnitudes: Also accumulate the magnitude statistics (the costliest part of a measurement).
        magnitude_sample: Take the magnitude statistics from a systematic sample of about this many elements when
            the model has more: the model's tensors laid end to end (in parameter order) are cut into windows of
            ``chunk_elements`` and every ``k``-th window is sampled, ``k = numel // magnitude_sample``. The same
            elements in every measurement and in every process layout (single process, DDP, ZeRO, FSDP2); the
            densities always count every element. ``None``: every element.
        chunk_elements: Elements compared at once.
        threads: Worker threads that measure chunks in parallel on the CPU; ``None`` (default): the telemetry
            workers of :func:`~ram_trl.parallel.plan_threads` (one per core of this process, at measurement time), or
            none for a model of fewer than ``SMALL_MODEL_ELEMENTS`` local elements; 1 measures on the calling
            thread. Every worker runs single-threaded torch operations (its own setting; the training threads'
            settings and the garbage collector are never touched): on a CPU shared with training (and other jobs),
            torch's multi-threaded operations made the chunked loop 10-20x slower (BENCHMARKS.md). The results do not
            depend on the number of workers.

    Base weights: a PEFT LoRA model needs none (the task vector is its adapters' delta; modules_to_save are compared
    with their original module). Otherwise the reference model, else ``base_model``, else a snapshot of the model's
    parameters taken by :meth:`setup` (which must then run before training changes them).
    """

    def __init__(
        self,
        base_model: str | os.PathLike | None = None,
        *,
        reference_model: torch.nn.Module | None = None,
        eps: float = DEFAULT_EPS,
        save_dtype: str | torch.dtype = defaults.SAVE_DTYPE,
        prior_stages: Sequence[str | os.PathLike] = (),
        r: float = defaults.R,
        alpha: float = defaults.ALPHA,
        prefix: str = DEFAULT_PREFIX,
        magnitudes: bool = True,
        magnitude_sample: int | None = MAGNITUDE_SAMPLE_ELEMENTS,
        chunk_elements: int = CHUNK_ELEMENTS,
        threads: int | None = None,
    ) -> None:
        if not eps >= 0:
            raise ConfigError(f"eps={eps} must be a number >= 0")
        if not r >= 0 or not alpha >= 0:
            raise ConfigError(f"r={r} and alpha={alpha} must be numbers >= 0")
        if threads is not None and threads < 1:
            raise ConfigError(f"threads={threads} must be a positive integer (or None)")
        if chunk_elements < 8 or chunk_elements % 8:
            raise ConfigError(f"chunk_elements={chunk_elements} must be a positive multiple of 8")
        if magnitude_sample is not None and magnitude_sample < chunk_elements:
            raise ConfigError(
                f"magnitude_sample={magnitude_sample} must be at least chunk_elements={chunk_elements} "
                "(or None: every element)"
            )
        if base_model is not None and not os.path.exists(base_model):
            raise ConfigError(f"base_model: {base_model} does not exist (the telemetry reads local checkpoints)")
        self.base_model = None if base_model is None else os.fspath(base_model)
        self.reference_model = reference_model
        self.eps = float(eps)
        self._save_dtype = resolve_save_dtype(save_dtype)
        self.save_dtype = self._save_dtype  # "auto" (None): the training dtype, at setup
        self.training_dtypes: list[torch.dtype] = []
        self.prior_paths = [os.fspath(p) for p in prior_stages]
        self.r, self.alpha = float(r), float(alpha)
        self.prefix = prefix
        self.magnitudes = magnitudes
        self.magnitude_sample = magnitude_sample
        self.chunk_elements = chunk_elements
        self.threads = threads
        self.source: BaseSource | None = None
        self.kind: Literal["full", "lora"] = "full"
        self.base_fingerprint: BaseFingerprint | None = None
        self.priors: PriorMasks | None = None
        self.last: dict[str, float] = {}
        self.last_step: int | None = None
        self.history: list[tuple[int | None, dict[str, float]]] = []
        self._ready = False
        self._threshold = float32_threshold(self.eps)
        self._zero_fill = self._threshold >= float(magnitude_bin_edges(1, 1)[0])
        self._workspaces: list[Workspace] = []
        self._spare_workspaces: dict[torch.device, list[Workspace]] = {}
        self._host_worker: ThreadPoolExecutor | None = None  # the single-threaded host work, started on first use

    # -- setup ---------------------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether :meth:`setup` has run."""
        return self._ready

    @property
    def base_description(self) -> str:
        """Where the base weights come from (for logs and the manifest)."""
        return "none" if self.source is None else self.source.description

    def setup(self, model: torch.nn.Module) -> None:
        """Choose the base, check the model against it, fingerprint it and load the prior stages' masks.

        Call before the first optimizer step when the base is a snapshot (no reference model, no ``base_model``,
        not a PEFT model); otherwise :meth:`measure` calls it on first use.

        Raises:
            ConfigError: for an unsupported model layout, prior stages of another base, or prior stages without a
                base checkpoint on disk.
            CheckpointError: when the model's parameters do not match the base checkpoint (names, shapes).
        """
        layout = model_layout(model)
        self.kind = "lora" if layout.peft else "full"
        self.training_dtypes = training_dtypes(layout.regions)
        self.save_dtype = self._save_dtype or auto_save_dtype(self.training_dtypes)
        if layout.peft:
            self.source = layout.frozen_base
        elif self.reference_model is not None:
            self.source = ModelBase.from_model(self.reference_model, "reference model")
        elif self.base_model is not None:
            self.source = MappedCheckpointBase(self.base_model)
        else:
            self.source = SnapshotBase({r.name: r.shard for r in layout.regions})
        assert self.source is not None
        check_layout(self.source, layout)
        if isinstance(self.source, MappedCheckpointBase):
            self.base_fingerprint = fingerprint_checkpoint(self.source.path)
        else:
            self.base_fingerprint = source_fingerprint(self.source)
        if self.prior_paths:
            self.priors = self._load_priors(layout)
        self._place_base(layout)
        self._ready = True

    def _place_base(self, layout: ModelLayout) -> None:
        """On an accelerator, keep the measured base ranges resident on it (stored dtype) when its free memory
        holds them twice over; else every chunk of base is staged through a pinned host buffer
        (:meth:`~ram_trl.callbacks.telemetry.chunks.Workspace.stage`)."""
        device = compute_device(layout.regions)
        if device.type != "cuda" or self.source is None or isinstance(self.source, DeviceBase):
            return
        if isinstance(self.source, ModelBase) and not isinstance(self.source, SnapshotBase):
            return  # a model in memory: on the device already, or the user's choice of where it lives
        ranges: dict[str, tuple[int, int]] = {}
        for region in layout.regions:
            if region.kind == "dense" and region.name not in ranges:
                ranges[region.name] = (region.shard.offset, region.shard.numel)
        if not ranges:
            return
        free, _ = torch.cuda.mem_get_info(device)
        if 2 * resident_bytes(self.source, ranges) <= free:
            self.source = DeviceBase(self.source, ranges, device)

    def _load_priors(self, layout: ModelLayout) -> PriorMasks:
        stages = read_prior_stages(self.prior_paths)
        assert self.base_fingerprint is not None and self.source is not None
        for stage in stages:
            theirs = stage.manifest.base_fingerprint
            if theirs is None:
                warning = unchecked_base(stage.manifest, stage.manifest_file, self.base_model)
                if warning:
                    warnings.warn(f"prior {warning}", UserWarning, stacklevel=3)
                continue
            try:
                ours = (
                    fingerprint_checkpoint(self.source.path, theirs.tensors)
                    if isinstance(self.source, MappedCheckpointBase)
                    else source_fingerprint(self.source, theirs.tensors)
                )
            except (CheckpointError, ConfigError, KeyError):
                ours = None
            if ours is None or ours.sha256 != theirs.sha256:
                raise ConfigError(
                    f"prior stage {stage.name!r} ({stage.manifest_file}) was trained from base "
                    f"{stage.manifest.base_model!r}, whose fingerprint differs from this run's base "
                    f"({self.base_description}); prior stages must share this run's base model"
                )
        base_path = self.base_model
        if base_path is None:
            for stage in stages:
                candidate = base_model_path(stage.manifest, stage.manifest_file)  # beside the manifest
                if candidate is not None:
                    base_path = str(candidate)
                    break
        if base_path is None:
            raise ConfigError(
                "prior_stages need the base checkpoint on disk to compute the priors' task vectors: pass "
                "base_model=PATH (the priors' manifests name no existing base path)"
            )
        ranges: dict[str, list[tuple[int, int]]] = {}
        for region in layout.regions:
            ranges.setdefault(region.name, []).append((region.shard.offset, region.shard.numel))
        return compute_prior_masks(stages, base_path, ranges, self.eps)

    # -- measuring -----------------------------------------------------------------------------------------------

    @property
    def state_bytes(self) -> int:
        """Bytes the tracker holds between measurements."""
        held = 0 if self.source is None else self.source.nbytes
        held += 0 if self.priors is None else self.priors.nbytes
        return held

    def measure(self, model: torch.nn.Module, step: int | None = None) -> dict[str, float]:
        """Measure the task vector of ``model`` now.

        Every process of a distributed run must call this at the same time (it all-reduces counts).

        Args:
            model: The training model (wrapped or not).
            step: The training step, recorded with the result.

        Returns:
            Metric name (with the prefix) to value; see the module docstring. Undefined values (the magnitude
            statistics of a task vector without active elements) are left out; rho is ``inf`` for a run whose
            active elements all overlap the priors'.
        """
        started = time.perf_counter()
        if not self._ready:
            self.setup(model)
        # worker threads of a process the library owns run single-threaded torch operations
        # (:func:`~ram_trl.parallel.compute_pool`); in a user's process everything runs on the calling thread, and
        # torch's thread settings and the garbage collector are left alone (a guest in the training process)
        out = self._measure(model, self.threads or plan_threads().telemetry)
        out[f"{self.prefix}measure_seconds"] = time.perf_counter() - started
        self.last = out
        self.last_step = step
        self.history.append((step, out))
        return out

    def _measure(self, model: torch.nn.Module, workers: int) -> dict[str, float]:
        layout = model_layout(model)
        ctx = training_context()
        num_priors = 0 if self.priors is None else self.priors.num_priors
        names: list[str] = list(dict.fromkeys(r.name for r in layout.regions))
        index = {n: i for i, n in enumerate(names)}
        totals = [[0, 0, 0, 0] for _ in names]  # active, changed, active_saved, numel
        squares = torch.zeros((), dtype=torch.float64)  # host; sum tau**2, added in chunk order
        overlap = OverlapStatistics.zeros(num_priors + 1)
        regions = local_regions(layout, ctx)
        for region in regions:
            totals[index[region.name]][3] += region.shard.numel
        starts, stride = sample_windows(layout, self.magnitude_sample if self.magnitudes else None)
        size, frozen = self.chunk_elements, self.priors is not None
        chunks = [
            chunk
            for region in regions
            for chunk in region_chunks(region, index[region.name], starts[region.name], stride, size, frozen)
        ]
        device = compute_device(regions)
        # small models, unless threads were asked for: the pool's start-up and hand-offs cost more than the counting
        small = self.threads is None and sum(chunk.count for chunk in chunks) < SMALL_MODEL_ELEMENTS
        workers = 1 if small else max(1, min(workers, len(chunks)))
        self._reserve_workspaces(device, workers)
        if self._host_worker is None:
            self._host_worker = single_threaded_worker()

        def reset_histograms() -> None:
            for ws in self._workspaces:
                ws.histogram = MagnitudeStatistics.zeros(1)

        single_threaded_call(reset_histograms, self._host_worker)
        nonfinite: dict[str, int] = {}  # base tensor -> NaN/Inf elements (first measurement)
        # chunk results are added in chunk order: the float64 sums do not depend on the number of workers
        with compute_pool(device, workers) as pool:
            for part in imap_blocks(pool, self._measure_chunk, chunks, ahead=2 * workers):
                row = totals[part.row]
                row[0] += part.active
                row[1] += part.changed
                row[2] += part.active_saved
                if part.nonfinite_base:
                    nonfinite[names[part.row]] = nonfinite.get(names[part.row], 0) + part.nonfinite_base
                if part.square_sum is not None:
                    squares += part.square_sum
                if part.overlap is not None:
                    overlap.add(part.overlap)
        for name, bad in nonfinite.items():
            warnings.warn(
                f"{self.base_description}: tensor {name!r} holds {bad} NaN/Inf value(s), so the task vector there "
                "is undefined: every metric leaves those elements out and a merge against this base is refused. "
                "Use a finite base checkpoint",
                UserWarning,
                stacklevel=3,
            )
        # the host work after the counting runs single-threaded off the calling thread in a process the library owns
        # (multi-threaded operations on these small tensors stall on busy cores); in a user's process, on it

        def reduce_locally() -> tuple[MagnitudeStatistics, torch.Tensor]:
            # the histograms hold integers: their sum does not depend on which worker counted which chunk
            magnitudes = MagnitudeStatistics.zeros(1)
            for ws in self._workspaces:
                magnitudes.add(ws.histogram)
            magnitudes.square_sums[0] += squares
            return magnitudes, torch.tensor(totals, dtype=torch.int64).reshape(len(names), 4)  # host

        if device.type != "cpu":  # the device's histograms into their host totals, on the calling thread (its device)
            for ws in self._workspaces:
                ws.histogram.settle()
        magnitudes, counts = single_threaded_call(reduce_locally, self._host_worker)
        if ctx.enabled:  # collectives on the calling thread (its current device)
            ctx.all_reduce_sum(counts)
            magnitudes.all_reduce(ctx)
            overlap.all_reduce(ctx)
        metrics = single_threaded_call(
            lambda: measurement_metrics(
                names, counts, magnitudes if self.magnitudes else None, overlap, self.priors, self.r, self.alpha
            ),
            self._host_worker,
        )
        if self.magnitudes:
            metrics["magnitude/sample_fraction"] = 1.0 / stride
        metrics["state_mb"] = self.state_bytes / 2**20
        metrics["work_mb"] = sum(ws.nbytes for ws in self._workspaces) / 2**20
        return {f"{self.prefix}{k}": float(v) for k, v in metrics.items() if not math.isnan(v)}

    def _measure_chunk(self, chunk: Chunk) -> ChunkCounts:
        """Count one chunk (on any thread: the buffers are a workspace no other thread holds meanwhile)."""
        part = ChunkCounts(chunk.row)
        if chunk.region.kind == "frozen":
            part.overlap = self._chunk_overlap(chunk, torch.zeros(chunk.count))  # host: tau = 0
            return part
        device = chunk.region.shard.values.device if chunk.region.kind == "dense" else torch.device("cpu")
        with torch.no_grad(), self._borrowed_workspace(device) as ws:
            tau, saved = self._delta(chunk, ws)
            count = chunk.count
            if not self.history and chunk.region.kind == "dense":  # the base, checked whole once
                part.nonfinite_base = nonfinite_count(ws.base[:count])
            part.changed = flag_count(torch.ne(tau, 0, out=ws.flags[:count]))
            flags = None  # the activity flags of tau, when needed
            magnitudes = self.magnitudes and chunk.sampled
            if magnitudes:
                part.square_sum, part.active = self._chunk_magnitudes(tau, ws)
            if not magnitudes or (saved is None and self.priors is not None):
                flags = torch.gt(torch.abs(tau, out=ws.scratch[:count]), self._threshold, out=ws.flags[:count])
                part.active = flag_count(flags)
            saved_flags, part.active_saved = flags, part.active
            if saved is not None:
                saved_flags = torch.gt(torch.abs(saved, out=saved), self._threshold, out=ws.saved_flags[:count])
                part.active_saved = flag_count(saved_flags)
            if self.priors is not None:
                assert saved_flags is not None
                part.overlap = self._chunk_overlap(chunk, saved_flags.cpu())
        # the boundary: everything a chunk returns lives on the host (the measurement's accumulators are there)
        if part.square_sum is not None:
            part.square_sum = part.square_sum.cpu()
        return part

    def _chunk_magnitudes(self, tau: torch.Tensor, ws: Workspace) -> tuple[torch.Tensor, int]:
        """Add a chunk's active elements to the workspace's ``|tau|`` histogram."""
        if self._zero_fill:
            values = masked_deltas(tau, self.eps, out=ws.scratch[: tau.numel()])
            squares = sum_of_squares(values, ws.magnitude)
            if math.isfinite(float(squares)):  # else NaN (left out) or inf (counted) in the chunk
                return squares, ws.histogram.add_histogram(
                    0, values, zero_filled=True, finite=True, workspace=ws.magnitude
                )
        values = tau[torch.abs(tau) > self._threshold]  # NaN is not above the threshold
        return sum_of_squares(values, ws.magnitude), ws.histogram.add_histogram(0, values, workspace=ws.magnitude)

    def _chunk_overlap(self, chunk: Chunk, saved_flags: torch.Tensor) -> OverlapStatistics:
        """The overlap statistics of a chunk: its saved-view activity flags (float32, CPU) with the priors'."""
        assert self.priors is not None
        region = chunk.region
        overlap = OverlapStatistics.zeros(self.priors.num_priors + 1)
        prior_rows = self.priors.rows(region.name, region.shard.offset, chunk.start, chunk.count)
        overlap.update(torch.cat([prior_rows.to(saved_flags.dtype), saved_flags.unsqueeze(0)]))
        return overlap

    def _reserve_workspaces(self, device: torch.device, count: int) -> None:
        """Workspaces on ``device`` up to ``count``, one per worker (``work_mb`` then ignores who ran what)."""
        spare = self._spare_workspaces.setdefault(device, [])
        while len(spare) < count:
            spare.append(Workspace(self.chunk_elements, self.save_dtype, device))
            self._workspaces.append(spare[-1])

    @contextmanager
    def _borrowed_workspace(self, device: torch.device) -> Iterator[Workspace]:
        """A workspace on ``device`` no other thread uses until it is returned (created on first need, then kept)."""
        spare = self._spare_workspaces.setdefault(device, [])
        try:
            ws = spare.pop()
        except IndexError:
            ws = Workspace(self.chunk_elements, self.save_dtype, device)
            self._workspaces.append(ws)
        try:
            yield ws
        finally:
            spare.append(ws)

    def _delta(self, chunk: Chunk, ws: Workspace) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(tau, tau_saved)`` of a ``dense`` or ``lora`` chunk, as views into the workspace."""
        shard, count = chunk.region.shard, chunk.count
        tau = ws.tau[:count]
        if chunk.region.kind == "lora":
            assert chunk.region.lora is not None and chunk.rows is not None
            lora, (row_start, row_stop) = chunk.region.lora, chunk.rows
            skip = shard.offset + chunk.start - row_start * row_numel(shard.shape)
            tau.copy_(lora.delta_rows(row_start, row_stop).reshape(-1)[skip : skip + count])
            if self.save_dtype == torch.float32 and lora.a.dtype in _FLOAT32_EXACT:
                return tau, None
            saved = ws.saved[:count]
            saved.copy_(lora.delta_rows(row_start, row_stop, self.save_dtype).reshape(-1)[skip : skip + count])
            return tau, saved
        assert self.source is not None
        trained = shard.values[chunk.start : chunk.start + count]
        stored = ws.stage(self.source.read(chunk.region.name, shard.offset + chunk.start, count))
        base = ws.base[:count]
        base.copy_(stored, non_blocking=ws.device.type == "cuda")  # pinned staging: an asynchronous copy
        torch.sub(trained, base, out=tau)
        if self._saving_is_exact(trained.dtype, stored.dtype):
            return tau, None
        rounded = ws.rounded[:count]
        saved = ws.saved[:count]
        saved.copy_(rounded.copy_(trained))
        if stored.dtype != self.save_dtype:
            base = ws.base_saved[:count]
            base.copy_(rounded.copy_(stored))
        torch.sub(saved, base, out=saved)
        return tau, saved

    def _saving_is_exact(self, trained: torch.dtype, base: torch.dtype) -> bool:
        """Whether rounding both sides to ``save_dtype`` leaves the task vector unchanged."""
        if self.save_dtype == torch.float32:
            return trained in _FLOAT32_EXACT and base in _FLOAT32_EXACT
        return trained == self.save_dtype and base == self.save_dtype

    def summary(self) -> dict[str, Any]:
        """What the manifest records about the measurement (besides the last metrics)."""
        return {
            "eps": self.eps,
            "base_source": self.base_description,
            "prior_stages": [] if self.priors is None else [s.name for s in self.priors.stages],
            "measured_steps": [s for s, _ in self.history],
            **precision_record(self.training_dtypes, self.save_dtype, self.last, self.prefix),
        }


__all__ = [
    "CHUNK_ELEMENTS",
    "DEFAULT_PREFIX",
    "MAGNITUDE_SAMPLE_ELEMENTS",
    "SMALL_MODEL_ELEMENTS",
    "TaskVectorTracker",
]
