"""Merged models exported as PEFT LoRA adapters: the SVD of each merged task vector.

:func:`export_lora` compares a merged full model with its base one tensor at a time and writes a LoRA adapter that
``PeftModel.from_pretrained(base, adapter_dir)`` loads:

- the weight delta of every ``nn.Linear`` module is factorised with a float64 SVD, ``delta ~ B @ A`` with
  ``B = U_r sqrt(S_r)`` (out x r) and ``A = sqrt(S_r) Vh_r`` (r x in), ``lora_alpha = r`` (scaling 1). The rank is
  fixed (``rank``), or per tensor the smallest rank whose share of the squared singular values reaches ``energy``,
  at most ``max_rank`` (``rank_pattern`` / ``alpha_pattern`` hold every module's rank in energy mode, the capped
  ones with a fixed rank);
- a changed bias of an ``nn.Linear`` is stored with its full merged value (PEFT's ``bias="lora_only"`` or ``"all"``
  layout), so it is exact;
- every other changed parameter (norms, embeddings, ``Conv1D``, ...) puts its module in ``modules_to_save``: all of
  the module's parameters are stored with their merged values, which PEFT restores exactly (tied input/output
  embeddings use PEFT's ``ensure_weight_tying``);
- a changed tensor that an adapter cannot express (a resized vocabulary, a buffer, a tensor transformers renames on
  load, a tie PEFT cannot keep) is left out and reported with the reason.

Which module owns a tensor is read from the base architecture built on the meta device from the base's
``config.json`` (no weights, no ``trust_remote_code``). Memory is bounded by one tensor: its base and merged values
in float32, the float64 delta and its SVD (about 28 bytes per element of the largest changed 2-D weight). The
factors are staged on disk and the adapter file is assembled at the end. Output goes to a temporary sibling of the
output directory, renamed into place when complete.

:func:`run_lora_merge` is ``ram_trl.merge(..., output_format="lora")``: a float32 merge into a temporary full model,
the export, and the removal of the temporary model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ram_trl.distributed import DistContext
from ram_trl.errors import CheckpointError, ConfigError
from ram_trl.io.checkpoint import TOKENIZER_FILES, Checkpoint, open_checkpoint
from ram_trl.io.safetensors_io import PlannedTensor, RowReader, ShardFile, TensorInfo, dtype_itemsize
from ram_trl.output import OUTPUT_ERRNOS, OutputDir, as_output_error, temp_name
from ram_trl.planner import format_bytes
from ram_trl.report import adapter_card, json_default

if TYPE_CHECKING:
    from torch import nn

    from ram_trl.config import ResolvedConfig
    from ram_trl.engine import MergeOptions

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
REPORT_FILE = "ram_merge_report.json"
OUTPUT_FORMATS = ("full", "lora")
#: PEFT's ``target_modules`` value for an adapter without LoRA layers (only ``modules_to_save``).
DUMMY_TARGET_MODULES = "dummy-target-modules"
_PREFIX = "base_model.model."
_COPY_CHUNK_BYTES = 64 * 1024 * 1024


# ---------------------------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class LoraExportOptions:
    """How the rank of each LoRA factorisation is chosen.

    Args:
        rank: Fixed rank ``r`` of every LoRA module (capped by the weight's smaller dimension).
        max_rank: Largest rank in energy mode.
        energy: Energy mode: per tensor, the smallest rank whose cumulative share of ``sigma**2`` reaches it.
    """

    rank: int | None = None
    max_rank: int | None = None
    energy: float | None = None

    @property
    def mode(self) -> str:
        return "rank" if self.rank is not None else "energy"

    @property
    def cap(self) -> int:
        """The config's ``r``: the fixed rank, or the largest rank allowed."""
        value = self.rank if self.rank is not None else self.max_rank
        assert value is not None
        return value

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "rank": self.rank, "max_rank": self.max_rank, "energy": self.energy}


def _positive_int(value: Any, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{flag} must be an integer >= 1, got {value!r}")
    return value


def lora_options(
    output_format: str = "full",
    rank: int | None = None,
    max_rank: int | None = None,
    energy: float | None = None,
) -> LoraExportOptions | None:
    """Validate the output options of :func:`ram_trl.merge` before any work starts.

    Returns:
        The LoRA export options, or ``None`` for a full-model output.

    Raises:
        ConfigError: naming the option to change.
    """
    if output_format not in OUTPUT_FORMATS:
        raise ConfigError(f"--output-format must be one of {list(OUTPUT_FORMATS)}, got {output_format!r}")
    given = {"--rank": rank, "--max-rank": max_rank, "--energy": energy}
    if output_format == "full":
        used = [flag for flag, value in given.items() if value is not None]
        if used:
            raise ConfigError(
                f"{', '.join(used)} only apply to --output-format lora (output_format='lora'); the output format "
                "is 'full'"
            )
        return None
    if rank is not None and (max_rank is not None or energy is not None):
        raise ConfigError(
            "--output-format lora takes either --rank R (one rank for every module) or --max-rank R --energy E "
            "(per-module rank by singular-value energy), not both"
        )
    if rank is not None:
        return LoraExportOptions(rank=_positive_int(rank, "--rank"))
    if max_rank is None and energy is None:
        raise ConfigError(
            "--output-format lora needs --rank R, or --max-rank R with --energy E (the smallest rank keeping the "
            "share E of each delta's squared singular values, at most R)"
        )
    if max_rank is None:
        raise ConfigError("--energy needs --max-rank R (the largest rank a module may get)")
    max_rank = _positive_int(max_rank, "--max-rank")
    if energy is None:
        raise ConfigError("--max-rank needs --energy E, 0 < E <= 1 (or use --rank R for a fixed rank)")
    if isinstance(energy, bool) or not isinstance(energy, int | float) or not 0.0 < float(energy) <= 1.0:
        raise ConfigError(f"--energy must be a number in (0, 1], got {energy!r}")
    return LoraExportOptions(max_rank=max_rank, energy=float(energy))


# ---------------------------------------------------------------------------------------------------------------
# The SVD


def choose_rank(singular_values: torch.Tensor, options: LoraExportOptions) -> int:
    """The rank kept for a delta with these singular values (descending).

    Fixed mode: ``min(rank, len(S))``. Energy mode: the smallest ``k`` with ``sum(S[:k]**2) >= energy * sum(S**2)``,
    at most ``max_rank`` and ``len(S)``, at least 1.
    """
    n = singular_values.numel()
    if options.rank is not None:
        return max(1, min(options.rank, n))
    assert options.energy is not None and options.max_rank is not None
    cumulative = singular_values.to(torch.float64).square().cumsum(0)
    total = float(cumulative[-1]) if n else 0.0
    if total <= 0.0:
        return 1
    target = torch.tensor([options.energy * total], dtype=torch.float64)
    k = int(torch.searchsorted(cumulative, target)) + 1
    return max(1, min(k, options.max_rank, n))


@dataclass
class Factorization:
    """``delta ~ b @ a`` in float32, with the rank, the share of ``sigma**2`` kept and the relative error."""

    a: torch.Tensor
    b: torch.Tensor
    rank: int
    energy_kept: float
    relative_error: float


def factorize(delta: torch.Tensor, options: LoraExportOptions) -> Factorization:
    """Truncated float64 SVD of a 2-D delta into float32 LoRA factors (scaling 1).

    The SVD runs as a Householder QR of the delta (of its transpose when wide) followed by the SVD of the small
    triangular factor, which is how LAPACK itself reduces tall matrices but several times faster than
    ``torch.linalg.svd`` of the whole delta; only the ``k`` kept singular vectors are formed. The relative error
    ``||delta - b @ a||_F / ||delta||_F`` is measured with the float32 factors as stored.
    """
    d = delta.to(torch.float64)
    wide = d.shape[0] < d.shape[1]
    q, r = torch.linalg.qr(d.T if wide else d)  # tall = q @ r, r square
    u_r, s, vh = torch.linalg.svd(r)  # tall = (q @ u_r) diag(s) vh
    del r
    k = choose_rank(s, options)
    left = q @ u_r[:, :k]
    del q, u_r
    u, v = (vh[:k].T, left) if wide else (left, vh[:k].T)  # delta = u diag(s) v.T
    root = s[:k].sqrt()
    b = (u * root).to(torch.float32)
    a = (root[:, None] * v.T).to(torch.float32)
    del u, v, left
    squares = s.square()
    total = float(squares.sum())
    kept = float(squares[:k].sum()) / total if total > 0 else 1.0
    return Factorization(a, b, k, kept, relative_error(d, b, a))


def relative_error(delta: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> float:
    """``||delta - b @ a||_F / ||delta||_F`` in float64, a block of rows at a time."""
    a64 = a.to(torch.float64)
    rows, cols = delta.shape
    block = max(1, _COPY_CHUNK_BYTES // max(1, cols * 8))
    residual = 0.0
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        diff = delta[start:stop].to(torch.float64) - b[start:stop].to(torch.float64) @ a64
        residual += float(diff.square().sum())
    norm = float(delta.to(torch.float64).square().sum())
    return math.sqrt(residual / norm) if norm > 0 else 0.0


# ---------------------------------------------------------------------------------------------------------------
# The base architecture: which module owns each tensor


@dataclass
class _Architecture:
    name: str
    modules: dict[str, nn.Module]
    aliases: dict[str, list[str]]  # parameter name -> every name of the same Parameter (tied weights)
    input_embedding: str | None
    output_embedding: str | None

    def is_linear(self, module_name: str) -> bool:
        from torch import nn

        return isinstance(self.modules.get(module_name), nn.Linear)

    def is_leaf(self, module_name: str) -> bool:
        module = self.modules[module_name]
        return not any(True for child in module.modules() if child is not module and any(child.parameters()))

    def direct_parameters(self, module_name: str) -> list[str]:
        module = self.modules[module_name]
        return [f"{module_name}.{p}" if module_name else p for p, _ in module.named_parameters(recurse=False)]


def _module_name(module: nn.Module | None, modules: dict[str, nn.Module]) -> str | None:
    if module is None:
        return None
    return next((name for name, m in modules.items() if m is module), None)


def build_architecture(base_dir: Path) -> _Architecture:
    """The base's architecture on the meta device (no weights) from its ``config.json``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(base_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # transformers raises many types for unknown or broken configs
        raise CheckpointError(
            f"base model {base_dir}: cannot build its architecture from config.json to find the nn.Linear weights "
            f"for the LoRA export ({type(exc).__name__}: {exc}); --output-format lora supports causal LMs that "
            "transformers builds without trust_remote_code"
        ) from exc
    modules = dict(model.named_modules())
    by_object: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(parameter), []).append(name)
    aliases = {name: names for names in by_object.values() for name in names}
    return _Architecture(
        name=type(model).__name__,
        modules=modules,
        aliases=aliases,
        input_embedding=_module_name(model.get_input_embeddings(), modules),
        output_embedding=_module_name(model.get_output_embeddings(), modules),
    )


# ---------------------------------------------------------------------------------------------------------------
# Export


@dataclass
class _Plan:
    """What goes into the adapter, decided tensor by tensor."""

    lora: list[dict[str, Any]] = field(default_factory=list)
    biases: dict[str, str] = field(default_factory=dict)  # bias tensor -> its module
    to_save: dict[str, list[str]] = field(default_factory=dict)  # module -> its changed tensors
    not_exported: list[dict[str, str]] = field(default_factory=list)
    tied: bool = False
    unchanged: int = 0
    changed_tensors: int = 0
    changed_elements: int = 0


class _StagedTensors:
    """LoRA factors appended to a scratch file as they are computed (so the export never holds them all)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.infos: dict[str, TensorInfo] = {}

    def add(self, key: str, tensor: torch.Tensor) -> None:
        data = tensor.detach().to(torch.float32).contiguous().reshape(-1).view(torch.uint8).numpy()
        begin = self._handle.tell()
        self._handle.write(memoryview(data))
        self.infos[key] = TensorInfo(
            key, torch.float32, tuple(tensor.shape), self.path, begin, begin + data.size
        )

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.close()


def _read_float(checkpoint: Checkpoint, name: str, reader: RowReader) -> torch.Tensor:
    return checkpoint.read_rows(name, reader).to(torch.float32)


def export_lora(
    base_dir: str | os.PathLike,
    merged_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    rank: int | None = None,
    max_rank: int | None = None,
    energy: float | None = None,
    report: dict[str, Any] | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Write the difference between a merged full model and its base as a PEFT LoRA adapter directory.

    Args:
        base_dir: The base checkpoint (with ``config.json``).
        merged_dir: The merged full model (float32 keeps the deltas exact), same tensor names as the base.
        output_dir: The adapter directory to create (``adapter_config.json``, ``adapter_model.safetensors``, tokenizer
            files from ``merged_dir``, ``README.md``, ``ram_merge_report.json``).
        rank: Fixed LoRA rank; or ``max_rank`` and ``energy`` (see :class:`LoraExportOptions`).
        report: The merge report to extend (default: ``merged_dir/ram_merge_report.json`` when present).
        overwrite: Replace an existing ``output_dir`` (once the new one is complete).
        allow_pickle: Accept a pickle base checkpoint.
        progress: Show a progress bar.

    Returns:
        The report, with a ``lora_export`` section: per LoRA tensor its rank, share of ``sigma**2`` kept and relative
        reconstruction error; the Linear biases and ``modules_to_save`` stored in full; the tensors not exported
        and why.

    Raises:
        ConfigError: for invalid rank options. CheckpointError: for unreadable or mismatched inputs.
    """
    options = lora_options("lora", rank, max_rank, energy)
    assert options is not None
    base_dir, merged_dir, output_dir = Path(base_dir), Path(merged_dir), Path(output_dir)
    output = OutputDir(
        output_dir,
        overwrite=overwrite,
        reads=[("base model", base_dir), ("merged model", merged_dir)],
        markers=(REPORT_FILE,),
    )
    output.check()
    base = open_checkpoint(base_dir, f"base model ({base_dir})", allow_pickle=allow_pickle)
    merged = open_checkpoint(merged_dir, f"merged model ({merged_dir})")
    missing = [name for name in base.tensors if name not in merged.tensors]
    if missing:
        raise CheckpointError(
            f"merged model {merged_dir} lacks {len(missing)} tensor(s) of the base, e.g. {missing[0]!r}; is it a "
            f"merge of {base_dir}?"
        )
    architecture = build_architecture(base_dir if base_dir.is_dir() else base_dir.parent)
    if report is None:
        saved = merged_dir / REPORT_FILE
        report = json.loads(saved.read_text()) if saved.is_file() else {}
    report = dict(report)

    temp_dir = output.begin()
    try:
        staged = _StagedTensors(temp_dir / ".lora-factors.staging")
        try:
            with RowReader() as reader:
                plan = _factorize_all(base, merged, architecture, options, staged, reader, progress)
                staged.close()
                config, entries = _adapter_layout(plan, architecture, merged, options, base_dir, staged)
                adapter_bytes = _write_adapter(temp_dir / ADAPTER_WEIGHTS, entries, merged, reader)
        finally:
            staged.close()
            staged.path.unlink(missing_ok=True)
        (temp_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copied = [name for name in TOKENIZER_FILES if (merged_dir / name).is_file()]
        for name in copied:
            shutil.copy2(merged_dir / name, temp_dir / name)
        section = _section(plan, options, config, entries, adapter_bytes)
        report = _adapter_report(report, section, config, adapter_bytes, output_dir, base_dir, copied)
        (temp_dir / REPORT_FILE).write_text(json.dumps(report, indent=2, default=json_default) + "\n")
        (temp_dir / "README.md").write_text(adapter_card(report))
        output.commit()
    except OSError as exc:
        output.abort()
        if exc.errno in OUTPUT_ERRNOS:
            raise as_output_error(exc, f"LoRA adapter directory {output_dir}") from exc
        raise
    except BaseException:
        output.abort()
        raise
    for item in section["not_exported"]:
        warnings.warn(f"LoRA export: {item['tensor']} is not exported: {item['reason']}", stacklevel=2)
    return report


def _factorize_all(
    base: Checkpoint,
    merged: Checkpoint,
    architecture: _Architecture,
    options: LoraExportOptions,
    staged: _StagedTensors,
    reader: RowReader,
    progress: bool,
) -> _Plan:
    plan = _Plan()
    names = list(base.tensors)
    iterator: Any = names
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(names, desc="LoRA export", unit="tensor", dynamic_ncols=True)
    for name in iterator:
        meta, out = base.tensors[name], merged.tensors[name]
        if not meta.dtype.is_floating_point:
            continue
        if out.shape != meta.shape:
            plan.not_exported.append(
                {
                    "tensor": name,
                    "reason": f"its shape {list(out.shape)} differs from the base's {list(meta.shape)} (a resized "
                    "vocabulary?); an adapter applies to the base's shapes: resize the base's embeddings first, or "
                    "use --output-format full",
                }
            )
            continue
        before, after = _read_float(base, name, reader), _read_float(merged, name, reader)
        if torch.equal(before, after):
            plan.unchanged += 1
            continue
        plan.changed_tensors += 1
        plan.changed_elements += after.numel()
        if not bool(torch.isfinite(after).all()):
            plan.not_exported.append({"tensor": name, "reason": "the merged tensor holds NaN/Inf values"})
            continue
        where = _classify(name, architecture)
        if where[0] == "lora":
            delta = after.to(torch.float64) - before.to(torch.float64)
            del before, after
            result = factorize(delta, options)
            module = where[1]
            staged.add(f"{_PREFIX}{module}.lora_A.weight", result.a)
            staged.add(f"{_PREFIX}{module}.lora_B.weight", result.b)
            plan.lora.append(
                {
                    "tensor": name,
                    "module": module,
                    "shape": list(delta.shape),
                    "rank": result.rank,
                    "energy_kept": result.energy_kept,
                    "relative_error": result.relative_error,
                }
            )
            del delta, result
        elif where[0] == "bias":
            plan.biases[name] = where[1]
        elif where[0] == "save":
            plan.to_save.setdefault(where[1], []).append(name)
            plan.tied = plan.tied or len(architecture.aliases.get(name, [])) > 1
        else:
            plan.not_exported.append({"tensor": name, "reason": where[1]})
    return plan


def _classify(name: str, architecture: _Architecture) -> tuple[str, str]:
    """``("lora", module)``, ``("bias", module)``, ``("save", module)`` or ``("skip", reason)``."""
    names = architecture.aliases.get(name)
    if names is None:
        return (
            "skip",
            f"{architecture.name} (built from the base's config.json) has no parameter of this name (a buffer, or a "
            "checkpoint name transformers converts on load), so PEFT cannot address it",
        )
    module, _, parameter = name.rpartition(".")
    tied = sorted(n for n in names if n != name)
    if tied:
        embeddings = {architecture.input_embedding, architecture.output_embedding}
        owners = {n.rpartition(".")[0] for n in names}
        if architecture.input_embedding is not None and owners == embeddings:
            return ("save", architecture.input_embedding)
        return (
            "skip",
            f"it is tied to {', '.join(tied)}; PEFT keeps only input/output embedding ties (ensure_weight_tying)",
        )
    if architecture.is_linear(module):
        return ("lora", module) if parameter == "weight" else ("bias", module)
    if not module:
        return ("skip", "a parameter of the top-level model, not of a submodule PEFT can save")
    if not architecture.is_leaf(module):
        kind = type(architecture.modules[module]).__name__
        return (
            "skip",
            f"it belongs to {module} ({kind}), which has submodules: modules_to_save would copy the whole subtree",
        )
    return ("save", module)


def _peft_wrapped(modules_to_save: list[str], architecture: _Architecture) -> set[str]:
    """The modules PEFT wraps for ``modules_to_save`` (its rule: the module name ends with an entry)."""
    wrapped = {key for key in architecture.modules if any(key.endswith(m) for m in modules_to_save)}
    if (
        architecture.input_embedding in wrapped
        and architecture.output_embedding is not None
        and len(architecture.aliases.get(f"{architecture.output_embedding}.weight", [])) > 1
    ):
        wrapped.add(architecture.output_embedding)  # ensure_weight_tying wraps the tied output embedding too
    return wrapped


def _save_conflict(module: str, targets: set[str], architecture: _Architecture) -> str | None:
    """Why PEFT would not restore ``module`` as a modules_to_save entry beside these LoRA targets, if it would not."""
    for key in _peft_wrapped([module], architecture):
        if key in targets or any(t.startswith(f"{key}.") for t in targets):
            return f"PEFT's modules_to_save entry {module!r} would also wrap {key!r}, which holds LoRA layers"
        if not architecture.is_leaf(key):
            return f"PEFT's modules_to_save entry {module!r} would also wrap {key!r}, which has submodules"
    excluded = [t for t in targets if re.match(rf"(^|.*\.){module}($|\..*)", t)]
    if excluded:
        return f"PEFT's modules_to_save entry {module!r} would exclude the LoRA module {excluded[0]!r}"
    return None


def _exact_list(names: list[str], candidates: list[str]) -> bool:
    """Whether PEFT's list rule for ``target_modules`` (equal, or ends with ``.name``) selects exactly ``names``."""
    chosen = set(names)
    for key in candidates:
        parts = key.split(".")
        hit = any(".".join(parts[i:]) in chosen for i in range(len(parts)))
        if hit != (key in chosen):
            return False
    return True


def _pattern_keys(pattern: dict[str, int], targets: list[str]) -> dict[str, int]:
    """``rank_pattern``/``alpha_pattern`` keyed by module name, escaped and anchored if PEFT's regex rule (first key
    matching the end of the module name) would give a module another module's value."""
    compiled = [(key, re.compile(rf"(.*\.)?({key})$")) for key in pattern]

    def first(module: str) -> str | None:
        return next((key for key, rule in compiled if rule.match(module)), None)

    if all(first(t) == (t if t in pattern else None) for t in targets):
        return pattern
    return {f"^{re.escape(k)}": v for k, v in pattern.items()}


def _adapter_layout(
    plan: _Plan,
    architecture: _Architecture,
    merged: Checkpoint,
    options: LoraExportOptions,
    base_dir: Path,
    staged: _StagedTensors,
) -> tuple[dict[str, Any], dict[str, TensorInfo | str]]:
    """The adapter config and every tensor of the adapter file: a staged factor, or a merged tensor's name."""
    targets = {item["module"] for item in plan.lora}
    # a modules_to_save entry PEFT would resolve to other modules too is left out (rare: suffix-sharing names)
    for module in sorted(plan.to_save):
        reason = _save_conflict(module, targets, architecture)
        if reason is not None:
            for name in plan.to_save.pop(module):
                plan.not_exported.append({"tensor": name, "reason": reason})
    modules_to_save = sorted(plan.to_save)
    entries: dict[str, TensorInfo | str] = dict(staged.infos)
    for key in sorted(_peft_wrapped(modules_to_save, architecture)):
        for parameter in architecture.direct_parameters(key):
            source = next((n for n in architecture.aliases[parameter] if n in merged.tensors), None)
            if source is None:
                raise CheckpointError(
                    f"merged model {merged.path}: no tensor holds {parameter!r}, which the adapter must save in full "
                    f"(module {key} is in modules_to_save)"
                )
            entries[f"{_PREFIX}{parameter}"] = source
    lora_only = True
    for name, module in plan.biases.items():
        if module in targets:
            entries[f"{_PREFIX}{module}.base_layer.bias"] = name
        else:
            entries[f"{_PREFIX}{name}"] = name
            lora_only = False
    ranks = {item["module"]: item["rank"] for item in plan.lora}
    cap = options.cap
    pattern = {m: r for m, r in sorted(ranks.items()) if options.mode == "energy" or r != cap}
    target_list = sorted(targets)
    pattern = _pattern_keys(pattern, target_list)
    if not target_list:
        target_modules: list[str] | str = DUMMY_TARGET_MODULES
    elif _exact_list(target_list, list(architecture.modules)):
        target_modules = target_list
    else:
        target_modules = "(?:" + "|".join(re.escape(t) for t in target_list) + ")"
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_dir.resolve()),
        "r": cap,
        "lora_alpha": cap,
        "rank_pattern": pattern,
        "alpha_pattern": dict(pattern),
        "target_modules": target_modules,
        "modules_to_save": modules_to_save or None,
        "bias": "none" if not plan.biases else ("lora_only" if lora_only else "all"),
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    if plan.tied and any(architecture.input_embedding == m for m in modules_to_save):
        config["ensure_weight_tying"] = True
    return config, entries


def _write_adapter(
    path: Path, entries: dict[str, TensorInfo | str], merged: Checkpoint, reader: RowReader
) -> int:
    """Assemble ``adapter_model.safetensors`` from staged factors and merged tensors, a row chunk at a time."""
    sources: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key, entry in entries.items():
        meta = entry if isinstance(entry, TensorInfo) else merged.tensors[entry]
        sources[key] = (meta.dtype, tuple(meta.shape))
    planned = [PlannedTensor(key, *sources[key]) for key in sorted(entries)]
    ShardFile.create(path, planned)
    file = ShardFile(path, planned)
    try:
        for tensor in planned:
            entry = entries[tensor.name]
            rows = tensor.shape[0] if tensor.shape else 1
            row_numel = math.prod(tensor.shape[1:]) if len(tensor.shape) > 1 else 1
            step = max(1, _COPY_CHUNK_BYTES // max(1, row_numel * dtype_itemsize(tensor.dtype)))
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                if isinstance(entry, TensorInfo):
                    chunk = reader.read_rows(entry, start, stop)
                else:
                    chunk = merged.read_rows(entry, reader, start, stop)
                file.write_rows(tensor.name, start, chunk)
        file.close()
    except BaseException:
        file.abort()
        raise
    return path.stat().st_size


# ---------------------------------------------------------------------------------------------------------------
# Report and model card


def _section(
    plan: _Plan,
    options: LoraExportOptions,
    config: dict[str, Any],
    entries: dict[str, TensorInfo | str],
    adapter_bytes: int,
) -> dict[str, Any]:
    errors = [item["relative_error"] for item in plan.lora]
    ranks = [item["rank"] for item in plan.lora]
    return {
        **options.as_dict(),
        "r": config["r"],
        "lora_alpha": config["lora_alpha"],
        "scaling": 1.0,
        "lora_modules": len(plan.lora),
        "rank_min": min(ranks) if ranks else None,
        "rank_max": max(ranks) if ranks else None,
        "relative_error_max": max(errors) if errors else None,
        "relative_error_mean": sum(errors) / len(errors) if errors else None,
        "tensors": plan.lora,
        "biases": sorted(plan.biases),
        "bias": config["bias"],
        "modules_to_save": [
            {"module": module, "tensors": tensors, "reason": "not an nn.Linear weight: saved in full (exact)"}
            for module, tensors in sorted(plan.to_save.items())
        ],
        "ensure_weight_tying": bool(config.get("ensure_weight_tying")),
        "not_exported": plan.not_exported,
        "unchanged_tensors": plan.unchanged,
        "changed_tensors": plan.changed_tensors,
        "elements_in_changed_tensors": plan.changed_elements,
        "adapter_tensors": len(entries),
        "adapter_bytes": adapter_bytes,
    }


def _adapter_report(
    report: dict[str, Any],
    section: dict[str, Any],
    config: dict[str, Any],
    adapter_bytes: int,
    output_dir: Path,
    base_dir: Path,
    tokenizer_files: list[str],
) -> dict[str, Any]:
    report["output_dir"] = str(output_dir)
    report.setdefault("base_model", str(base_dir))
    report["output"] = {
        "format": "lora",
        "dtype": "float32",
        "files": [ADAPTER_WEIGHTS],
        "bytes": adapter_bytes,
        "tensors": section["adapter_tensors"],
        "resized_tensors": (report.get("output") or {}).get("resized_tensors", []),
    }
    report["lora_export"] = section
    found = list(report.get("warnings", []))
    found += [
        f"LoRA export: {item['tensor']} is not exported: {item['reason']}" for item in section["not_exported"]
    ]
    if not tokenizer_files and not any("tokenizer files" in w for w in found):
        found.append("no tokenizer files found beside the merged model; the adapter has none")
    report["warnings"] = found
    return report


# ---------------------------------------------------------------------------------------------------------------
# ram_trl.merge(..., output_format="lora")


def run_lora_merge(
    resolved: ResolvedConfig, output_dir: Path, options: MergeOptions, lora: LoraExportOptions
) -> dict[str, Any]:
    """Merge in float32 into a temporary full model beside ``output_dir``, export it as LoRA, remove it.

    Under ``torchrun``/``accelerate launch`` every rank merges its share; rank 0 exports, and a failure anywhere
    fails every rank.
    """
    from ram_trl.engine import run_merge

    resolved.out_dtype = torch.float32  # exact deltas for the SVD
    merge_options = dataclasses.replace(options, overwrite=False)
    if options.dry_run:
        summary = run_merge(resolved, output_dir, merge_options)
        summary["output_format"] = "lora"
        summary["lora_export"] = lora.as_dict()
        return summary
    ctx = DistContext.from_env(options.device)
    try:
        output = OutputDir(
            output_dir, overwrite=options.overwrite, reads=resolved.inputs(), markers=(REPORT_FILE,)
        )
        ctx.guarded(lambda: output.check() if ctx.is_main else None)
        name = temp_name(output_dir, "full").name if ctx.is_main else None
        full_dir = output_dir.parent / ctx.broadcast_object(name)
        try:
            merged_report = run_merge(resolved, full_dir, merge_options)

            def export() -> dict[str, Any] | None:
                if not ctx.is_main:
                    return None
                report = export_lora(
                    resolved.base_path,
                    full_dir,
                    output_dir,
                    rank=lora.rank,
                    max_rank=lora.max_rank,
                    energy=lora.energy,
                    report=merged_report,
                    overwrite=options.overwrite,
                    allow_pickle=options.allow_pickle,
                    progress=options.progress,
                )
                _print_export(report)
                return report

            return ctx.broadcast_object(ctx.guarded(export))
        finally:
            if ctx.is_main:
                shutil.rmtree(full_dir, ignore_errors=True)
    finally:
        ctx.close()


def _print_export(report: dict[str, Any]) -> None:
    from rich.console import Console

    section = report["lora_export"]
    console = Console(stderr=True)
    error = section["relative_error_max"]
    console.print(
        f"LoRA adapter -> {report['output_dir']}: {section['lora_modules']} LoRA modules"
        + (
            f" (rank {section['rank_min']}-{section['rank_max']}, max relative error {error:.3g})"
            if error is not None
            else ""
        )
        + f", {len(section['modules_to_save'])} modules_to_save, {len(section['biases'])} biases, "
        f"{format_bytes(section['adapter_bytes'])}"
    )
    for item in section["not_exported"]:
        console.print(f"[yellow]not exported:[/yellow] {item['tensor']}: {item['reason']}")
