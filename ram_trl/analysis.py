"""Task-vector sparsity analysis: the numbers behind a choice of merge method, for a base and N agents.

One streaming pass over the inputs (the merge's reader, :mod:`ram_trl.streaming`, and its plan,
:func:`ram_trl.planner.build_plan`) measures, per agent and over the whole model:

- density at ``eps`` (``|tau| > eps``, strict, as RAM masks) and at exact equality of the stored values, plus, when
  an input is stored wider than bfloat16, the density the agent would have if base and agent were both saved in
  bfloat16 (what a merge of bf16 checkpoints would see); the stored dtype of every input is recorded;
- the overlap histogram, unique / shared / active counts, rho_t and the lambda_t it implies for RAM+ and RAM+s, and
  pairwise Jaccard indices, all from :class:`~ram_trl.statistics.OverlapStatistics` (the merge's counts);
- the anatomy: density per module type and per decoder layer (:mod:`ram_trl.anatomy`);
- magnitude statistics of the active deltas (:class:`~ram_trl.statistics.MagnitudeStatistics`).

Task vectors are ``float32(agent) - float32(base)`` of the stored values, exactly as the merge computes them, so
every number shared with the merge report (active, unique, shared, density, rho, lambda) is the same.
Like the merge, the pass runs over several processes under ``accelerate launch`` / ``torchrun``: tensors are
partitioned by bytes, the statistics are summed over ranks, and rank 0 writes ``analysis.json``, ``analysis.md``
and the figures (:mod:`ram_trl.plots`).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import ram_trl
from ram_trl import defaults
from ram_trl.anatomy import classify, summarize
from ram_trl.config import MergeConfig, ResolvedConfig, load_config, resolve_config
from ram_trl.distributed import DistContext, partition_by_bytes
from ram_trl.engine import MergeState, check_densities, open_inputs, task_input_bytes
from ram_trl.errors import ConfigError
from ram_trl.io.checkpoint import Checkpoint
from ram_trl.io.safetensors_io import RowReader, dtype_itemsize
from ram_trl.manifest import is_stage, read_manifest
from ram_trl.methods.ram import DEFAULT_EPS, active_mask
from ram_trl.output import OutputDir, guard_os_errors
from ram_trl.planner import DEFAULT_CHUNK_BUDGET, MergePlan, TensorTask, build_plan, parse_size
from ram_trl.statistics import MagnitudeStatistics, TensorAnalysis
from ram_trl.streaming import RawChunk, ReadCounter, iter_chunks, to_deltas
from ram_trl.validation import check_optional_number

JSON_FILE = "analysis.json"
MARKDOWN_FILE = "analysis.md"
DEFAULT_R = defaults.R
DEFAULT_ALPHA = defaults.ALPHA
#: Stored dtypes at most this wide (bytes per element) need no bfloat16 view: bf16 and fp16.
_BF16_ITEMSIZE = 2


@dataclass
class AnalysisInputs:
    """What to analyse, resolved and validated (paths exist, parameters in range).

    Args:
        resolved: The inputs as a merge config (``merge_method`` is irrelevant to the analysis).
        eps: Activity threshold (strict).
        r: RAM+ / RAM+s rescale strength for the implied lambda_t.
        alpha: RAM+ clip bound of rho_t.
    """

    resolved: ResolvedConfig
    eps: float
    r: float
    alpha: float


def analyze(
    base: str | os.PathLike | None = None,
    agents: Sequence[str | os.PathLike] = (),
    out_dir: str | os.PathLike | None = None,
    eps: float | None = None,
    r: float | None = None,
    alpha: float | None = None,
    *,
    config: str | os.PathLike | dict[str, Any] | MergeConfig | None = None,
    names: Sequence[str] | None = None,
    allow_pickle: bool = False,
    chunk_budget: str | int = DEFAULT_CHUNK_BUDGET,
    figures: bool = True,
    progress: bool = True,
    print_summary: bool = False,
    allow_external_shards: bool = False,
) -> dict[str, Any]:
    """Measure the sparsity, overlap, anatomy and magnitudes of the task vectors of ``agents`` against ``base``.

    Give either ``base`` and ``agents`` or a merge ``config`` (its base, agents, and its ``eps``, ``r`` and
    ``alpha`` when it has them). Reads every input once, chunk by chunk: memory is about ``chunk_budget`` plus
    1.5 MB per agent, whatever the model's size.

    Args:
        base: The base checkpoint directory.
        agents: Agent checkpoint directories (fine-tuned from ``base``).
        out_dir: Where to write ``analysis.json``, ``analysis.md`` and the figures (created if missing; a previous
            analysis or an empty directory is replaced when the new one is complete, any other existing directory
            is refused). ``None``: write nothing, only return the result.
        eps: Activity threshold, ``|tau| > eps`` (default: the config's, else 1e-5).
        r: Rescale strength for the lambda_t of RAM+ and RAM+s (default: the config's, else 0.1).
        alpha: RAM+ clip bound of rho_t (default: the config's, else 2.0).
        config: A merge config (YAML path, dict or :class:`~ram_trl.config.MergeConfig`) instead of base/agents.
        names: Agent labels for the reports (default: directory names).
        allow_pickle: Accept ``pytorch_model*.bin`` checkpoints (loaded with ``torch.load(weights_only=True)``).
        chunk_budget: Bytes for one chunk's buffers, e.g. ``"256MB"``.
        figures: Write the PNG figures (needs matplotlib).
        progress: Show a progress bar while streaming.
        print_summary: Print the summary tables to the terminal (rank 0).
        allow_external_shards: Accept index files whose shards resolve outside their checkpoint directory.

    Returns:
        The analysis (the content of ``analysis.json``): per-agent densities, counts, rho_t, lambda_t, overlap
        shares and magnitude statistics; pairwise Jaccard indices; the anatomy by module type, family and layer;
        per-tensor counts. Infinite values are written as ``"inf"`` and undefined ones as ``None``.

    Raises:
        ConfigError: for missing or contradictory arguments, missing paths, or out-of-range parameters.
        CheckpointError: for unreadable, corrupt or mismatched checkpoints (before any tensor is read).
        NonFiniteError: for NaN/Inf in an input (unless the config sets ``allow_nonfinite``).
    """
    inputs = resolve_inputs(base, agents, eps, r, alpha, config=config, names=names)
    ctx = DistContext.from_env("cpu")
    try:
        out = None if out_dir is None else Path(out_dir)
        return _run(
            inputs,
            out,
            ctx,
            allow_pickle,
            chunk_budget,
            figures,
            progress,
            print_summary,
            allow_external_shards,
        )
    finally:
        ctx.close()


def resolve_inputs(
    base: str | os.PathLike | None,
    agents: Sequence[str | os.PathLike],
    eps: float | None,
    r: float | None,
    alpha: float | None,
    *,
    config: str | os.PathLike | dict[str, Any] | MergeConfig | None = None,
    names: Sequence[str] | None = None,
) -> AnalysisInputs:
    """Validate the arguments of :func:`analyze` (through the merge's config resolution).

    Raises:
        ConfigError: naming the argument or config field to change.
    """
    given = {"eps": eps, "r": r, "alpha": alpha}
    for key, value in given.items():
        check_optional_number(value, "analyze", f"--{key}", minimum=0.0)
    if config is not None:
        if base is not None or agents:
            raise ConfigError("give either a merge config or a base and agents, not both")
        parsed, config_path = load_config(config)
        resolved = resolve_config(parsed, config_path)
    else:
        if base is None and agents and all(is_stage(a) for a in agents):
            bases = {read_manifest(a).base_model for a in agents}
            if len(bases) == 1 and Path(next(iter(bases))).exists():
                base = next(iter(bases))
        if base is None or not agents:
            raise ConfigError(
                "give a base model and at least one agent (or a merge config); the base may be left out only "
                "when every agent is a stage manifest of the same local base"
            )
        for label, path in [("base model", base), *((f"agent {i}", a) for i, a in enumerate(agents))]:
            if not Path(path).exists():
                raise ConfigError(f"{label}: {path} does not exist (ram_trl reads local checkpoints)")
        if all(Path(a).resolve() == Path(base).resolve() for a in agents):
            raise ConfigError(f"every agent is the base model {base}: there is no task vector to analyse")
        entries = [{"stage" if is_stage(path) else "model": str(path)} for path in agents]
        parameters = {k: v for k, v in given.items() if v is not None}
        raw = {
            "merge_method": "ram_plus",
            "base_model": str(base),
            "models": entries,
            "parameters": parameters,
        }
        resolved = resolve_config(load_config(raw)[0])
    if names is not None:
        if len(names) != len(resolved.agents):
            raise ConfigError(
                f"{len(names)} names given for {len(resolved.agents)} agents; give one per agent"
            )
        for agent, name in zip(resolved.agents, names, strict=True):
            agent.name = name
    defaults = {"eps": DEFAULT_EPS, "r": DEFAULT_R, "alpha": DEFAULT_ALPHA}
    values = {
        key: float(given[key] if given[key] is not None else resolved.params.get(key, defaults[key]))
        for key in defaults
    }
    # the merge's density warnings read eps from the parameters
    resolved.params = {**resolved.params, **values}
    return AnalysisInputs(resolved, values["eps"], values["r"], values["alpha"])


# ---------------------------------------------------------------------------------------------------------------
# The pass


def _run(
    inputs: AnalysisInputs,
    out_dir: Path | None,
    ctx: DistContext,
    allow_pickle: bool,
    chunk_budget: str | int,
    figures: bool,
    progress: bool,
    print_summary: bool,
    allow_external_shards: bool = False,
) -> dict[str, Any]:
    started = time.perf_counter()
    resolved = inputs.resolved
    output = None if out_dir is None else analysis_output(out_dir, resolved)
    if output is not None:
        ctx.guarded(output.check)

    def prepare() -> tuple[Checkpoint, list[Checkpoint], MergePlan]:
        base, agents = open_inputs(resolved, allow_pickle, allow_external_shards)
        plan = build_plan(
            base,
            agents,
            out_dtype=None,
            shape_mismatch="error",
            needs_statistics=False,
            trims_by_magnitude=False,
            chunk_budget=parse_size(chunk_budget),
        )
        return base, agents, plan

    base, agents, plan = ctx.guarded(prepare)
    floating = [t for t in plan.tasks if t.floating]
    owned = partition_by_bytes([task_input_bytes(t, agents) for t in floating], ctx.world_size)[ctx.rank]
    wide = bf16_view_agents(base, agents, floating)
    magnitudes = MagnitudeStatistics.zeros(len(agents))
    read = ReadCounter()
    records = ctx.guarded(
        lambda: analysis_pass(
            base,
            agents,
            [floating[i] for i in owned],
            inputs.eps,
            any(wide),
            magnitudes,
            read,
            resolved.allow_nonfinite,
            progress and ctx.is_main,
        )
    )
    merged: dict[str, TensorAnalysis] = {}
    for part in ctx.gather_objects(records):
        merged.update(part)
    magnitudes.all_reduce(ctx)
    read.bytes = ctx.all_reduce_int(read.bytes)
    timings = {"seconds": time.perf_counter() - started}

    def finish() -> dict[str, Any] | None:
        if not ctx.is_main:
            return None
        result = build_result(inputs, base, agents, floating, merged, magnitudes, wide)
        result.update(timings=timings, bytes_read=read.bytes, processes=ctx.world_size)
        if output is not None:
            temp = output.begin()
            try:
                with guard_os_errors(f"output directory {out_dir}"):
                    write_outputs(result, temp, figures)
                output.commit()
            except BaseException:
                output.abort()
                raise
        return result

    result = ctx.broadcast_object(ctx.guarded(finish))
    if print_summary and ctx.is_main:
        print_tables(result)
    return result


def analysis_output(out_dir: Path, resolved: ResolvedConfig) -> OutputDir:
    """The commit protocol of an analysis directory: never inside (nor holding) an input; a previous analysis
    (``analysis.json``) or an empty directory is replaced, anything else is refused.

    Args:
        out_dir: The output directory.
        resolved: The inputs.
    """
    return OutputDir(out_dir, reads=resolved.inputs(), markers=(JSON_FILE,), replace_previous=True)


def bf16_view_agents(base: Checkpoint, agents: list[Checkpoint], tasks: list[TensorTask]) -> list[bool]:
    """Which agents get a bfloat16 view: those whose task vector is held wider than bf16.

    Args:
        base: The base checkpoint.
        agents: The agents.
        tasks: The floating tensors.

    Returns:
        Per agent: the base or the agent stores a floating tensor wider than bf16 (float32, float64), or the agent is
        a LoRA adapter (its deltas are computed in float32).
    """
    base_wide = any(dtype_itemsize(t.base.dtype) > _BF16_ITEMSIZE for t in tasks)
    return [
        base_wide
        or agent.kind == "lora"
        or any(
            dtype_itemsize(agent.tensors[t.name].dtype) > _BF16_ITEMSIZE
            for t in tasks
            if t.name in agent.tensors
        )
        for agent in agents
    ]


def as_bf16(chunk: RawChunk) -> RawChunk:
    """The chunk as bfloat16 checkpoints would store it.

    Args:
        chunk: Stored values (and LoRA deltas) of one row chunk.

    Returns:
        A chunk whose base and agent values are rounded to bf16 (round to nearest even, as ``save_pretrained`` in
        bf16 does). A LoRA agent's values are the base (or its stored values) plus its delta, added in float32 and
        then rounded, as ``merge_and_unload`` followed by a bf16 save gives; the new chunk has no LoRA deltas.
    """
    assert chunk.base is not None
    agents: list[torch.Tensor | None] = []
    for values, lora in zip(chunk.agents, chunk.lora, strict=True):
        if lora is not None:
            stored = chunk.base if values is None else values
            full = stored.reshape(-1)[: lora.numel()].to(torch.float32) + lora.reshape(-1)
            values = full
        agents.append(None if values is None else values.to(torch.bfloat16))
    return replace(chunk, base=chunk.base.to(torch.bfloat16), agents=agents, lora=[None] * len(agents))


def analysis_pass(
    base: Checkpoint,
    agents: list[Checkpoint],
    tasks: list[TensorTask],
    eps: float,
    bf16: bool,
    magnitudes: MagnitudeStatistics,
    read: ReadCounter,
    allow_nonfinite: bool = False,
    progress: bool = False,
) -> dict[str, TensorAnalysis]:
    """Stream the floating tensors ``tasks`` once and measure each of them.

    Args:
        base: The base checkpoint.
        agents: The agents.
        tasks: Floating tensors to read (this rank's share).
        eps: Activity threshold.
        bf16: Also measure the bfloat16 view.
        magnitudes: Accumulates the magnitude statistics of the active deltas.
        read: Accumulates the bytes read.
        allow_nonfinite: Measure inputs holding NaN/Inf instead of refusing them.
        progress: Show a progress bar.

    Returns:
        Per tensor name, its :class:`TensorAnalysis`.
    """
    from tqdm.auto import tqdm

    records: dict[str, TensorAnalysis] = {}
    device = torch.device("cpu")
    with (
        RowReader() as reader,
        tqdm(total=len(tasks), desc="analyze", unit="tensor", disable=not progress) as bar,
    ):
        for chunk in iter_chunks(base, agents, tasks, reader, counter=read):
            name = chunk.task.name
            if name not in records:
                if records:
                    bar.update(1)
                records[name] = TensorAnalysis.zeros(len(agents), bf16)
            record = records[name]
            deltas, _ = to_deltas(chunk, device, base, agents, reader, allow_nonfinite)
            mask = active_mask(deltas, eps)
            record.eps.update(mask)
            record.exact.update(active_mask(deltas, 0.0))
            magnitudes.update(deltas, mask)
            del deltas, mask
            if record.bf16 is not None:
                rounded, _ = to_deltas(as_bf16(chunk), device, base, agents, reader, allow_nonfinite=True)
                record.bf16.update(active_mask(rounded, eps))
        if records:
            bar.update(1)
    return records


# ---------------------------------------------------------------------------------------------------------------
# The result


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_summary(checkpoint: Checkpoint) -> dict[str, int]:
    """Elements per stored dtype in a checkpoint, over every tensor (a LoRA adapter's targets count as float32).

    Args:
        checkpoint: An opened checkpoint (headers only).

    Returns:
        dtype name to elements, most elements first.
    """
    out: dict[str, int] = {}
    for meta in checkpoint.tensors.values():
        key = _dtype_name(meta.dtype)
        out[key] = out.get(key, 0) + meta.numel
    return dict(sorted(out.items(), key=lambda item: -item[1]))


def build_result(
    inputs: AnalysisInputs,
    base: Checkpoint,
    agents: list[Checkpoint],
    tasks: list[TensorTask],
    records: dict[str, TensorAnalysis],
    magnitudes: MagnitudeStatistics,
    wide: list[bool],
) -> dict[str, Any]:
    """Assemble the analysis (the content of ``analysis.json``, without timings and figures).

    Args:
        inputs: What was analysed, and eps, r, alpha.
        base: The base checkpoint.
        agents: The agents.
        tasks: The floating tensors, in plan order.
        records: Per tensor name, its statistics (every tensor of ``tasks``).
        magnitudes: Magnitude statistics of the whole model.
        wide: Per agent, whether its bf16 view was measured (:func:`bf16_view_agents`).

    Returns:
        The JSON-ready result (see :func:`analyze`).
    """
    resolved = inputs.resolved
    n = len(agents)
    ordered = [(t.name, records[t.name]) for t in tasks]
    total = TensorAnalysis.zeros(n, any(wide))
    total.tensors = 0
    for _, record in ordered:
        total = total + record
    stats = total.eps
    state = MergeState(stats=stats)
    check_densities(resolved, state, emit=True)
    lambdas_plus = stats.lambdas(inputs.r, inputs.alpha)
    lambdas_soft = stats.lambdas(inputs.r, None, soft=True)
    bound = magnitudes.relative_bin_width
    entries = []
    for t, (spec, checkpoint) in enumerate(zip(resolved.agents, agents, strict=True)):
        entry: dict[str, Any] = {
            "index": spec.index,
            "name": spec.name,
            "path": str(spec.path),
            "kind": checkpoint.kind,
        }
        entry["dtypes"] = dtype_summary(checkpoint)
        entry.update(stats.as_dict(t))
        entry["overlap_shares"] = stats.overlap_shares(t)
        entry["lambda"] = {"ram_plus": lambdas_plus[t], "ram_plus_soft": lambdas_soft[t]}
        entry["changed"] = total.exact.active(t)
        entry["density_exact"] = total.exact.density(t)
        entry["bf16_view"] = wide[t]
        use_bf16 = wide[t] and total.bf16 is not None
        entry["active_bf16"] = total.bf16.active(t) if use_bf16 else None
        entry["density_bf16"] = total.bf16.density(t) if use_bf16 else None
        entry["magnitude"] = magnitudes.summary(t, numel=stats.numel)
        entries.append(entry)
    edges, counts = magnitudes.coarse_histogram()
    result: dict[str, Any] = {
        "ram_trl_version": ram_trl.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_model": str(resolved.base_path),
        "base_dtypes": dtype_summary(base),
        "parameters": {"eps": inputs.eps, "r": inputs.r, "alpha": inputs.alpha},
        "measured_on": "tau = float32(agent) - float32(base) of the stored values, as the merge computes it",
        "num_agents": n,
        "total_elements": stats.numel,
        "tensors": len(tasks),
        "agents": entries,
        "overall": {
            "union": stats.union(),
            "density_any": stats.union() / stats.numel if stats.numel else 0.0,
            "element_counts": stats.element_counts(),
            "element_counts_exact": total.exact.element_counts(),
            "element_counts_bf16": None if total.bf16 is None else total.bf16.element_counts(),
        },
        "jaccard": stats.jaccard_matrix(),
        "magnitude_estimates": {
            "histogram_bins_per_octave": 2**magnitudes.mantissa_bits,
            "gini_max_error": bound / 4,
            "top_mass_max_relative_error": bound,
            "fourth_power_sum_max_relative_error": magnitudes.fourth_power_relative_error,
            "note": "Gini and top-k mass from a |tau| histogram: gini in [exact - gini_max_error, exact], top-k "
            "mass within a relative top_mass_max_relative_error of exact; the kurtosis takes sum tau**4 (and "
            "tau**3) at each bin's mean, sum tau**4 at most fourth_power_sum_max_relative_error below exact; "
            "count, mean |tau|, mean and standard deviation are exact",
        },
        "magnitude_histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
        "anatomy": summarize(dict(ordered), n),
        "tensors_detail": [
            {
                "name": name,
                "module": classify(name).module,
                "layer": classify(name).layer,
                "numel": record.eps.numel,
                "dtypes": {
                    "base": _dtype_name(base.tensors[name].dtype),
                    "agents": [
                        _dtype_name(a.tensors[name].dtype) if name in a.tensors else None for a in agents
                    ],
                },
                "active": [record.eps.active(t) for t in range(n)],
                "changed": [record.exact.active(t) for t in range(n)],
                "active_bf16": None if record.bf16 is None else [record.bf16.active(t) for t in range(n)],
            }
            for name, record in ordered
        ],
        "warnings": list(state.warnings) + list(resolved.notes),
    }
    return clean(result)


def clean(value: Any) -> Any:
    """A JSON-ready copy: infinite floats become ``"inf"`` (as in the merge report) and NaN becomes ``None``."""
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    return value


# ---------------------------------------------------------------------------------------------------------------
# Outputs


def write_outputs(result: dict[str, Any], out_dir: Path, figures: bool = True) -> None:
    """Write ``analysis.json``, ``analysis.md`` and the PNG figures.

    Args:
        result: The analysis; its ``figures`` entry is set to the figure files written.
        out_dir: The output directory (created if missing).
        figures: Draw the figures.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    result["figures"] = []
    if figures:
        from ram_trl.plots import write_figures

        result["figures"] = write_figures(result, out_dir)
    (out_dir / JSON_FILE).write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / MARKDOWN_FILE).write_text(markdown(result))


_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _pct(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}%}"


def _num(value: float | str | None, spec: str = ".4g") -> str:
    """A number for a table; ``None`` (undefined) as ``-`` and ``"inf"`` as is."""
    if value is None:
        return "-"
    return value if isinstance(value, str) else format(value, spec)


def sparsity_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-agent sparsity and overlap table."""
    header = [
        "agent",
        "dtype",
        "density",
        "exact",
        "bf16",
        "unique",
        "shared",
        "rho",
        "lam RAM+",
        "lam RAM+s",
    ]
    rows = []
    for a in result["agents"]:
        rows.append(
            [
                a["name"],
                "LoRA" if a["kind"] == "lora" else "/".join(_SHORT_DTYPES.get(d, d) for d in a["dtypes"]),
                _pct(a["density"]),
                _pct(a["density_exact"]),
                _pct(a["density_bf16"]),
                f"{a['unique']:,}",
                f"{a['shared']:,}",
                _num(a["rho"], ".3f"),
                _num(a["lambda"]["ram_plus"], ".4f"),
                _num(a["lambda"]["ram_plus_soft"], ".4f"),
            ]
        )
    return header, rows


def magnitude_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-agent magnitude table."""
    header = ["agent", "active", "mean abs(tau)", "Gini", "ex. kurtosis", "top 1% mass", "top 5% mass"]
    rows = []
    for a in result["agents"]:
        m = a["magnitude"]
        rows.append(
            [
                a["name"],
                f"{m['count']:,}",
                _num(m["mean_abs"], ".3g"),
                _num(m["gini"], ".4f"),
                _num(m["excess_kurtosis"], ".4g"),
                _pct(m["top_1pct_mass"], 1),
                _pct(m["top_5pct_mass"], 1),
            ]
        )
    return header, rows


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def markdown(result: dict[str, Any]) -> str:
    """The analysis as Markdown tables (``analysis.md``)."""
    names = [a["name"] for a in result["agents"]]
    p = result["parameters"]
    lines = [
        "# Task-vector sparsity analysis",
        "",
        f"Base model `{result['base_model']}` ({', '.join(result['base_dtypes'])}); {result['num_agents']} agents; "
        f"{result['total_elements']:,} elements in {result['tensors']} floating tensors. An element is active when "
        f"|tau| > eps = {p['eps']:g} (strict), tau = float32(agent) - float32(base) of the stored values; *exact*: "
        "the stored values differ; *bf16*: both sides rounded to bfloat16 first (only for inputs stored wider). "
        f"lambda_t: RAM+ with r = {p['r']:g}, alpha = {p['alpha']:g}; RAM+s with r = {p['r']:g}.",
        "",
        "## Sparsity and overlap",
        "",
        *_table(*sparsity_rows(result)),
        "### Share of each agent's active elements also updated by k other agents",
        "",
        *_table(
            ["agent", *(f"k = {k}" for k in range(len(names)))],
            [[a["name"], *(_pct(s, 1) for s in a["overlap_shares"])] for a in result["agents"]],
        ),
        f"Elements updated by any agent: {result['overall']['union']:,} "
        f"({_pct(result['overall']['density_any'])}); by exactly 0..N agents: "
        f"{', '.join(f'{c:,}' for c in result['overall']['element_counts'])}.",
        "",
        "### Pairwise Jaccard index of the active sets",
        "",
        *_table(
            ["", *names],
            [[names[s], *(_num(v, ".3f") for v in row)] for s, row in enumerate(result["jaccard"])],
        ),
        "## Magnitudes of the active deltas",
        "",
        *_table(*magnitude_rows(result)),
        f"Gini and top-k mass come from a |tau| histogram with "
        f"{result['magnitude_estimates']['histogram_bins_per_octave']} bins per octave: Gini is at most "
        f"{result['magnitude_estimates']['gini_max_error']:.2g} below the exact value, top-k mass within a relative "
        f"{result['magnitude_estimates']['top_mass_max_relative_error']:.2g}. The kurtosis takes sum tau^4 at each "
        f"bin's mean (at most a relative "
        f"{result['magnitude_estimates']['fourth_power_sum_max_relative_error']:.2g} below exact); the mean and "
        "standard deviation are exact.",
        "",
        "## Anatomy",
        "",
        "### Density by module type",
        "",
        *_table(
            ["module", "tensors", "elements", *names],
            [
                [m["module"], str(m["tensors"]), f"{m['numel']:,}", *(_pct(d) for d in m["density"])]
                for m in result["anatomy"]["modules"]
            ],
        ),
        "### Density by family",
        "",
        *_table(
            ["family", "tensors", "elements", *names],
            [
                [f["family"], str(f["tensors"]), f"{f['numel']:,}", *(_pct(d) for d in f["density"])]
                for f in result["anatomy"]["families"]
            ],
        ),
    ]
    if result["anatomy"]["layers"]:
        lines += [
            "### Density by decoder layer",
            "",
            *_table(
                ["layer", "elements", *names],
                [
                    [str(layer["layer"]), f"{layer['numel']:,}", *(_pct(d) for d in layer["density"])]
                    for layer in result["anatomy"]["layers"]
                ],
            ),
        ]
    if result.get("figures"):
        lines += ["## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in result["figures"]] + [""]
    if result["warnings"]:
        lines += ["## Warnings", ""] + [f"- {w}" for w in result["warnings"]] + [""]
    return "\n".join(lines)


def print_tables(result: dict[str, Any]) -> None:
    """Print the per-agent tables to the terminal."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"{result['num_agents']} agents, {result['total_elements']:,} elements, {result['tensors']} tensors"
    )
    for title, (header, rows) in [
        (f"Task-vector sparsity at eps = {result['parameters']['eps']:g}", sparsity_rows(result)),
        ("Magnitudes of the active deltas", magnitude_rows(result)),
    ]:
        table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for column in header:
            table.add_column(column, justify="left" if column in ("agent", "dtype") else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for warning in result["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")


__all__ = ["TensorAnalysis", "analyze", "resolve_inputs"]
