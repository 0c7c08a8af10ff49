"""The agent a run leaves behind: the policy saved in its ``save_dtype`` (every element finite), written all or
nothing into the stage directory beside its manifest (:mod:`ram_trl.stage.manifest`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ram_trl.errors import NonFiniteError
from ram_trl.output import OutputDir, guard_os_errors
from ram_trl.stage.manifest import (
    MANIFEST_NAME,
    StageManifest,
    check_save_target,
    describe_files,
    manifest_path,
    weight_files,
    write_manifest,
)


def policy_of(model: torch.nn.Module) -> torch.nn.Module:
    """The policy inside a trainer's model: TRL's PPO wraps policy and value model in one module with ``.policy``."""
    policy = getattr(model, "policy", None)
    return policy if isinstance(policy, torch.nn.Module) else model


def _cast_state(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors cast to ``dtype`` on the CPU; tensors sharing storage (tied weights) stay shared."""
    out: dict[str, torch.Tensor] = {}
    memo: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        if not torch.is_floating_point(tensor):
            out[name] = tensor.cpu()
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in memo:
            memo[key] = tensor.to(device="cpu", dtype=dtype).contiguous()
        out[name] = memo[key]
    return out


def save_agent(
    trainer: Any, out_dir: Path, dtype: torch.dtype, manifest: Callable[[], StageManifest] | None = None
) -> Path | None:
    """Save the trainer's model in ``dtype`` to ``out_dir``: the full model (with the tokenizer), or the adapter of
    a PEFT model, and with ``manifest`` the stage manifest beside it.

    All or nothing, through the output-commit protocol of :mod:`ram_trl.output` (docs/telemetry.md): an existing
    ``out_dir`` (a trainer's ``output_dir``) receives the files at once, the manifest last, so a save killed half-way
    is never taken for a finished stage; a failure or signal leaves ``out_dir`` as it was. Every process must call
    this (the ZeRO-3 gather is collective); only the main process writes.

    Args:
        trainer: The trainer (its ``accelerator``, ``model`` and ``processing_class``).
        out_dir: The agent directory.
        dtype: The dtype of the saved floating tensors.
        manifest: Called on the main process for the stage manifest to write beside the agent.

    Returns:
        The manifest's path on the main process when ``manifest`` is given, else ``None``.

    Raises:
        OutputError: for file-system errors of ``out_dir`` (full, read-only, no permission).
    """
    accelerator = trainer.accelerator
    model = trainer.model_wrapped if getattr(trainer, "model_wrapped", None) is not None else trainer.model
    state_dict = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return None
    unwrapped = policy_of(accelerator.unwrap_model(trainer.model))
    if unwrapped is not accelerator.unwrap_model(trainer.model):
        prefix = "policy."
        state_dict = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    cast = _cast_state(state_dict, dtype)
    check_finite_agent(cast, dtype, out_dir)  # commit only healthy agents: nothing written otherwise
    output = agent_output(out_dir)
    tmp = output.begin()
    try:
        with guard_os_errors(f"agent directory {out_dir}"):
            unwrapped.save_pretrained(str(tmp), state_dict=cast, safe_serialization=True)
            # the weights hash while the config and tokenizer are written
            with ThreadPoolExecutor(1) as hasher:
                digests = hasher.submit(describe_files, tmp) if manifest is not None else None
                config_file = tmp / "config.json"
                # say what the weights hold (save_pretrained writes the training dtype)
                if config_file.is_file():
                    config = json.loads(config_file.read_text())
                    config["dtype"] = str(dtype).removeprefix("torch.")
                    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
                processing = getattr(trainer, "processing_class", None)
                if processing is not None and hasattr(processing, "save_pretrained"):
                    processing.save_pretrained(str(tmp))
                if manifest is not None and digests is not None:
                    stage = manifest()
                    files = digests.result()
                    if sorted(files) != weight_files(tmp):  # a weight file written since: describe all
                        files = describe_files(tmp)
                    stage.files = files  # the stage contract: exactly these files, these bytes
                    write_manifest(stage, tmp)
        # the previous save's weight files that this one does not replace go with the commit
        output.commit(remove=check_save_target(out_dir, weight_files(tmp)))
    except BaseException:
        output.abort()
        raise
    return out_dir / MANIFEST_NAME if manifest is not None else None


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN or Inf: its minimum and maximum in one pass without a temporary
    (NaN propagates into both, an Inf is one of them), an order of magnitude faster than ``isfinite`` on the CPU."""
    if tensor.numel() == 0:
        return True
    try:
        low, high = torch.aminmax(tensor)
    except (RuntimeError, NotImplementedError):  # a dtype without a min/max kernel: the elementwise test
        return bool(torch.isfinite(tensor).all())
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def check_finite_agent(tensors: dict[str, torch.Tensor], dtype: torch.dtype, out_dir: str | os.PathLike) -> None:
    """Refuse to save an agent holding NaN or Inf values (a diverged run, or trained values beyond ``dtype``)."""
    bad: list[tuple[str, int]] = []
    for name, tensor in tensors.items():
        if torch.is_floating_point(tensor) and not _all_finite(tensor):
            bad.append((name, int(tensor.numel() - torch.isfinite(tensor).sum())))
    if bad:
        total = sum(count for _, count in bad)
        name = str(dtype).removeprefix("torch.")
        raise NonFiniteError(
            f"agent directory {out_dir}: the agent holds {total} NaN/Inf values in {name} ({len(bad)} tensors, "
            f"first {bad[0][0]!r}); the run diverged or its weights overflow save_dtype={name!r}: nothing was "
            "saved (the trainer's own checkpoints are untouched). Use save_dtype='float32' or a lower learning rate"
        )


def prior_stage_reads(prior_stages: Sequence[str | os.PathLike]) -> list[tuple[str, Path]]:
    """The directories of prior stages, as inputs an agent directory must not overlap (:class:`OutputDir` reads)."""
    reads = []
    for stage in prior_stages:
        file = manifest_path(stage)
        if file.exists():
            reads.append(("prior stage", file.parent))
    return reads


def agent_output(out_dir: str | os.PathLike, reads: Sequence[tuple[str, Path]] = ()) -> OutputDir:
    """The output-commit protocol of an agent directory: files merged into an existing one, ``ram_stage.json`` last."""
    return OutputDir(out_dir, merge=True, markers=(MANIFEST_NAME,), reads=reads, what="agent directory")
