"""Merged models exported as PEFT LoRA adapters: the SVD of each merged task vector (docs/lora.md)."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ram_trl.errors import CheckpointError
from ram_trl.io.checkpoint import Checkpoint, copy_tokenizer, open_checkpoint
from ram_trl.io.hub import resolve_model
from ram_trl.io.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX
from ram_trl.io.safetensors_io import PlannedTensor, RowReader, ShardFile, TensorInfo, dtype_itemsize
from ram_trl.merging.lora.peft_layout import AdapterPlan, Architecture, adapter_layout, build_architecture, classify
from ram_trl.merging.lora.svd import LoraExportOptions, factorize, lora_options
from ram_trl.merging.report import REPORT_FILE, adapter_card, write_report
from ram_trl.output import OutputDir
from ram_trl.sizes import format_bytes

_COPY_CHUNK_BYTES = 64 * 1024 * 1024  #: Rows of a tensor copied into the adapter at a time: about this many bytes.


# ---------------------------------------------------------------------------------------------------------------
# Export


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
        self.infos[key] = TensorInfo(key, torch.float32, tuple(tensor.shape), self.path, begin, begin + data.size)

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
    """Write the difference between a merged full model and its base as a PEFT LoRA adapter directory."""
    options = lora_options("lora", rank, max_rank, energy)
    assert options is not None
    base_dir, merged_dir, output_dir = (resolve_model(base_dir, what="base model"), Path(merged_dir), Path(output_dir))
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
    merge_report = dict(report)

    def fill(temp_dir: Path) -> dict[str, Any]:
        staged = _StagedTensors(temp_dir / ".lora-factors.staging")
        try:
            with RowReader() as reader:
                plan = _factorize_all(
                    base,
                    merged,
                    architecture=architecture,
                    options=options,
                    staged=staged,
                    reader=reader,
                    progress=progress,
                )
                staged.close()
                config, entries = adapter_layout(plan, architecture, merged, options, base_dir, staged.infos)
                adapter_bytes = _write_adapter(temp_dir / ADAPTER_WEIGHTS, entries, merged, reader)
        finally:
            staged.close()
            staged.path.unlink(missing_ok=True)
        (temp_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copied = copy_tokenizer(merged_dir, temp_dir)
        section = _section(plan, options, config, entries, adapter_bytes)
        written = _adapter_report(
            merge_report,
            section,
            config=config,
            adapter_bytes=adapter_bytes,
            output_dir=output_dir,
            base_dir=base_dir,
            tokenizer_files=copied,
        )
        write_report(temp_dir, written, adapter_card(written))
        return written

    report = output.write(fill, what=f"LoRA adapter directory {output_dir}")
    section = report["lora_export"]
    for item in section["not_exported"]:
        warnings.warn(f"LoRA export: {item['tensor']} is not exported: {item['reason']}", stacklevel=2)
    return report


def _factorize_all(
    base: Checkpoint,
    merged: Checkpoint,
    *,
    architecture: Architecture,
    options: LoraExportOptions,
    staged: _StagedTensors,
    reader: RowReader,
    progress: bool,
) -> AdapterPlan:
    plan = AdapterPlan()
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
        where = classify(name, architecture)
        if where[0] == "lora":
            delta = after.to(torch.float64) - before.to(torch.float64)
            del before, after
            result = factorize(delta, options)
            module = where[1]
            staged.add(f"{PEFT_PREFIX}{module}.lora_A.weight", result.a)
            staged.add(f"{PEFT_PREFIX}{module}.lora_B.weight", result.b)
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


def _write_adapter(path: Path, entries: dict[str, TensorInfo | str], merged: Checkpoint, reader: RowReader) -> int:
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
    plan: AdapterPlan,
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
    *,
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
    found += [f"LoRA export: {item['tensor']} is not exported: {item['reason']}" for item in section["not_exported"]]
    if not tokenizer_files and not any("tokenizer files" in w for w in found):
        found.append("no tokenizer files found beside the merged model; the adapter has none")
    report["warnings"] = found
    return report


# ---------------------------------------------------------------------------------------------------------------
# Terminal


def print_export(report: dict[str, Any]) -> None:
    """Print a one-line summary of an export (and what was not exported) to the terminal."""
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
    )  # what was not exported is among the report's warnings, printed with the summary


__all__ = ["export_lora", "print_export"]
