"""Stage manifests (``ram_stage.json``): what one vertical's RL run leaves beside its agent for the merge (base and
its fingerprint, checkpoint and kind, training, final telemetry). The contract (:func:`verify_stage`: the weight files
and their SHA-256, every reader refuses a changed one) is in docs/telemetry.md and docs/bad-input.md."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ram_trl.digest import file_digest, hasher
from ram_trl.errors import ConfigError, OutputError
from ram_trl.io.checkpoint import FISHER_FILE, open_checkpoint
from ram_trl.io.hub import HubReference, parse_reference, resolve_model
from ram_trl.io.json_files import read_json_object
from ram_trl.io.safetensors_io import RowReader
from ram_trl.messages import validation_message
from ram_trl.output import atomic_file

MANIFEST_NAME = "ram_stage.json"
SCHEMA_VERSION = 3  #: 2 added ``files`` (weight files, SHA-256), 3 ``base_revision``; older manifests are still read.
FINGERPRINT_TENSORS = 4  #: Tensors hashed into a base fingerprint (spread evenly over the sorted floating names).
FINGERPRINT_ELEMENTS = 4096  #: Leading elements of each fingerprinted tensor that are hashed.


class BaseFingerprint(BaseModel):
    """A cheap identity of a base model: the SHA-256 of a few tensors' names, shapes and leading values, hashed as
    float32 (exact for bf16, fp16 and fp32), so a base trained in float32 and saved in bf16 keeps its fingerprint."""

    model_config = ConfigDict(extra="forbid")

    tensors: list[str]
    sha256: str


class StageManifest(BaseModel):
    """The manifest of one finished RL stage (``ram_stage.json``)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    stage: str
    domain: str | None = None
    base_model: str
    base_fingerprint: BaseFingerprint | None = None
    base_revision: str | None = None
    checkpoint: str
    kind: Literal["full", "lora"] = "full"
    files: dict[str, str] | None = None
    trainer: str | None = None
    steps: int = 0
    processes: int | None = None  # how many processes trained the agent (None: written before it was recorded)
    save_dtype: str | None = None
    telemetry: dict[str, float] = Field(default_factory=dict)
    rewards: dict[str, float] = Field(default_factory=dict)
    versions: dict[str, str] = Field(default_factory=dict)
    created: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    extra: dict[str, Any] = Field(default_factory=dict)


def manifest_path(path: str | os.PathLike) -> Path:
    """The manifest file for ``path``: the path itself if it is a file, else ``path/ram_stage.json``."""
    path = Path(path).expanduser()
    return path / MANIFEST_NAME if path.is_dir() else path


def is_stage(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a stage: a manifest file, or a directory holding ``ram_stage.json``."""
    path = Path(path).expanduser()
    return (path.is_file() and path.name.endswith(".json")) or (path / MANIFEST_NAME).is_file()


def read_manifest(path: str | os.PathLike) -> StageManifest:
    """Read and validate a stage manifest."""
    file = manifest_path(path)
    if not file.is_file():
        raise ConfigError(f"stage manifest {file} does not exist (a finished stage writes {MANIFEST_NAME})")
    data = read_json_object(file, "stage manifest", ConfigError)
    version = data.get("schema_version", SCHEMA_VERSION)
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise ConfigError(
            f"stage manifest {file}: schema_version {data['schema_version']} is newer than this ram_trl "
            f"understands ({SCHEMA_VERSION}); upgrade ram_trl"
        )
    try:
        return StageManifest.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"stage manifest {file}: {validation_message(exc, StageManifest)}") from exc


def checkpoint_path(manifest: StageManifest, manifest_file: str | os.PathLike) -> Path:
    """The agent checkpoint a manifest points to (relative paths resolved against the manifest's directory)."""
    path = Path(manifest.checkpoint).expanduser()
    return path if path.is_absolute() else manifest_path(manifest_file).parent / path


def base_model_path(manifest: StageManifest, manifest_file: str | os.PathLike) -> Path | None:
    """The base model a manifest names, as a local path: a relative ``base_model`` is resolved against the manifest's
    directory, never the current directory (a stage is read from anywhere). A Hub id resolves to its cache
    snapshot at the recorded ``base_revision``; ``None`` when nothing exists there."""
    path = Path(manifest.base_model).expanduser()
    if not path.is_absolute():
        path = (manifest_path(manifest_file).parent / path).resolve()
    if path.exists():
        return path
    reference = parse_reference(manifest.base_model)
    if reference is None:
        return None
    if manifest.base_revision:  # the commit the run trained from
        reference = HubReference(reference.repo_id, manifest.base_revision)
    try:
        return resolve_model(str(reference), what=f"stage {manifest.stage!r}: base_model", weights=False)
    except ConfigError:
        return None


def write_manifest(manifest: StageManifest, directory: str | os.PathLike) -> Path:
    """Write ``directory/ram_stage.json`` atomically (temporary sibling, then rename)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / MANIFEST_NAME
    with atomic_file(target, "stage manifest") as tmp:
        tmp.write_text(manifest.model_dump_json(indent=2) + "\n")
    return target


def fingerprint_names(names: Iterable[str], count: int = FINGERPRINT_TENSORS) -> list[str]:
    """Choose the tensors of a fingerprint: ``count`` names spread evenly over the sorted ``names``."""
    ordered = sorted(set(names))
    if len(ordered) <= count:
        return ordered
    step = (len(ordered) - 1) / (count - 1)
    return sorted({ordered[round(i * step)] for i in range(count)})


def fingerprint(get_tensor: Callable[[str], torch.Tensor], names: Iterable[str]) -> BaseFingerprint:
    """Fingerprint a base from a few tensors."""

    def head(name: str) -> tuple[tuple[int, ...], torch.Tensor]:
        tensor = get_tensor(name).detach()
        return tuple(tensor.shape), tensor.reshape(-1)[:FINGERPRINT_ELEMENTS]

    return fingerprint_heads(head, names)


def fingerprint_heads(
    get_head: Callable[[str], tuple[tuple[int, ...], torch.Tensor]], names: Iterable[str]
) -> BaseFingerprint:
    """Fingerprint a base from each tensor's shape and first :data:`FINGERPRINT_ELEMENTS` flat elements only (for
    sources that hold tensors in pieces: a training run's parameters, a memory-mapped range)."""
    digest = hasher()
    chosen = list(names)
    for name in chosen:
        shape, head = get_head(name)
        head = head.detach().reshape(-1)[:FINGERPRINT_ELEMENTS].to(device="cpu", dtype=torch.float32).contiguous()
        digest.update(name.encode())
        digest.update(json.dumps(list(shape)).encode())
        digest.update(head.numpy().tobytes())
    return BaseFingerprint(tensors=chosen, sha256=digest.hexdigest())


def fingerprint_checkpoint(path: str | os.PathLike, names: Iterable[str] | None = None) -> BaseFingerprint:
    """Fingerprint a base checkpoint directory on disk (safetensors, single or sharded)."""
    checkpoint = open_checkpoint(path, "base model")
    if names is None:
        names = fingerprint_names(n for n, meta in checkpoint.tensors.items() if meta.dtype.is_floating_point)
    names = list(names)
    missing = [n for n in names if n not in checkpoint.tensors]
    if missing:
        raise ConfigError(f"base model {path}: has no tensor {missing[0]!r} of the stage's base fingerprint")
    with RowReader() as reader:
        return fingerprint(lambda name: checkpoint.read_rows(name, reader), names)


def unchecked_base(
    manifest: StageManifest, manifest_file: str | os.PathLike, base_path: str | os.PathLike | None
) -> str | None:
    """The warning for a stage without a base fingerprint that names another base than ``base_path``, else ``None``."""
    if manifest.base_fingerprint is not None:
        return None
    named = base_model_path(manifest, manifest_file)
    if named is not None and base_path is not None and named.resolve() == Path(base_path).resolve():
        return None
    ours = "this base" if base_path is None else f"the base {base_path}"
    return (
        f"stage {manifest.stage!r} ({manifest_path(manifest_file)}) has no base fingerprint and names base "
        f"{manifest.base_model!r}: whether it was trained from {ours} cannot be checked (a stage saved by this "
        "ram_trl records one)"
    )


def check_base(manifest: StageManifest, manifest_file: str | os.PathLike, base_path: str | os.PathLike) -> None:
    """Check that a stage was trained from ``base_path`` (without a fingerprint: :func:`unchecked_base` warns)."""
    if manifest.base_fingerprint is None:
        warning = unchecked_base(manifest, manifest_file, base_path)
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=2)
        return
    try:
        found = fingerprint_checkpoint(base_path, manifest.base_fingerprint.tensors)
    except ConfigError as exc:
        raise ConfigError(
            f"stage {manifest.stage!r} ({manifest_path(manifest_file)}) was trained from {manifest.base_model!r}, "
            f"not from the merge's base {base_path}: {exc}"
        ) from None
    if found.sha256 != manifest.base_fingerprint.sha256:
        raise ConfigError(
            f"stage {manifest.stage!r} ({manifest_path(manifest_file)}) was trained from {manifest.base_model!r}, "
            f"not from the merge's base {base_path}: the base fingerprints differ "
            f"(tensors {', '.join(manifest.base_fingerprint.tensors)}). Use the stage's base model as base_model."
        )


# ---------------------------------------------------------------------------------------------------------------
# The stage contract: the manifest names exactly the weight files it describes, with their digests

#: The adapter files of a PEFT LoRA checkpoint.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def is_weight_file(name: str) -> bool:
    """Whether a file name is one a reader of a checkpoint directory may load weights (or LoRA settings) from."""
    if name in ADAPTER_FILES:
        return True
    if name.endswith(".safetensors"):
        return name != FISHER_FILE
    if name.endswith(".safetensors.index.json"):
        return True
    return name.startswith("pytorch_model") and (name.endswith(".bin") or name.endswith(".bin.index.json"))


def weight_files(directory: str | os.PathLike) -> list[str]:
    """The weight files (:func:`is_weight_file`) directly inside a checkpoint directory, sorted."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if is_weight_file(p.name) and p.is_file())


def describe_files(directory: str | os.PathLike) -> dict[str, str]:
    """The ``files`` of a manifest: every weight file of ``directory`` with its SHA-256."""
    names = weight_files(directory)
    workers = min(len(names), os.cpu_count() or 1, 8)
    if workers <= 1:
        return {name: file_digest(Path(directory) / name) for name in names}
    with ThreadPoolExecutor(workers) as pool:  # the shards of a large model hash side by side (no GIL held)
        digests = list(pool.map(lambda name: file_digest(Path(directory) / name), names))
    return dict(zip(names, digests, strict=True))


def _check_kind(manifest: StageManifest, directory: Path, where: str) -> None:
    names = weight_files(directory)
    adapter = [n for n in names if n in ADAPTER_FILES]
    full = [n for n in names if n not in ADAPTER_FILES]
    if manifest.kind == "lora" and full:
        raise ConfigError(
            f"{where}: the manifest says kind 'lora' but {directory / full[0]} holds a full model's weights "
            "(left by another save into the same directory?); remove it or save the stage elsewhere"
        )
    if manifest.kind == "full" and adapter and not full:
        raise ConfigError(
            f"{where}: the manifest says kind 'full' but {directory} holds only a LoRA adapter "
            f"({', '.join(adapter)}); save the stage again"
        )
    if manifest.kind == "full" and adapter:
        raise ConfigError(
            f"{where}: the manifest says kind 'full' but {directory / adapter[0]} is a LoRA adapter file that "
            "readers would load instead (left by another save into the same directory?); remove it"
        )


def verify_stage(manifest: StageManifest, manifest_file: str | os.PathLike, *, allow_external: bool = False) -> Path:
    """Check that a stage's checkpoint directory holds exactly what its manifest describes; return the directory."""
    file = manifest_path(manifest_file)
    where = f"stage {manifest.stage!r} ({file})"
    directory = checkpoint_path(manifest, manifest_file)
    home = file.parent.resolve()
    if not allow_external and not directory.resolve().is_relative_to(home):
        raise ConfigError(
            f"{where}: checkpoint {manifest.checkpoint!r} resolves outside the manifest's directory {file.parent}; "
            "keep the manifest beside its agent (checkpoint '.'), or accept it with --allow-external-shards "
            "(allow_external_shards=True)"
        )
    if not directory.is_dir():
        return directory  # the readers name a missing checkpoint themselves
    if manifest.files is not None and not manifest.files:
        raise ConfigError(
            f"{where}: the manifest describes no saved agent (the run used save_agent=False), so the weights in "
            f"{directory} are not the stage's; name the model directory with model: instead, or save the agent"
        )
    if manifest.files is not None:
        present = weight_files(directory)
        for name in sorted(manifest.files):
            if name not in present:
                raise ConfigError(f"{where}: {directory / name} is missing (the manifest names it)")
        added = [n for n in present if n not in manifest.files]
        if added:
            raise ConfigError(
                f"{where}: {directory / added[0]} is not one of the files the manifest describes "
                f"({', '.join(sorted(manifest.files))}): it was written after the stage was saved (e.g. by "
                "trainer.save_model into the same directory); remove it or save one of them elsewhere"
            )
        for name, digest in sorted(manifest.files.items()):
            if file_digest(directory / name) != digest:
                raise ConfigError(
                    f"{where}: {directory / name} no longer matches the manifest's SHA-256: it was written over "
                    "after the stage was saved (e.g. by trainer.save_model into the same directory); train the "
                    "stage again, or save other models elsewhere"
                )
    _check_kind(manifest, directory, where)
    return directory


def previous_save(directory: str | os.PathLike) -> tuple[list[str], list[str]]:
    """The weight files an agent save into ``directory`` finds: those a previous save owns (named by the
    ``ram_stage.json`` there; every weight file for a manifest older than schema version 2) and the others."""
    directory = Path(directory)
    present = weight_files(directory)
    try:
        manifest = read_manifest(directory / MANIFEST_NAME) if (directory / MANIFEST_NAME).is_file() else None
    except ConfigError:
        manifest = None
    if manifest is None:
        return [], present
    if manifest.files is None:
        return present, []
    return [n for n in present if n in manifest.files], [n for n in present if n not in manifest.files]


def check_save_target(directory: str | os.PathLike, writes: Iterable[str] | None = None) -> list[str]:
    """Refuse a save that would leave weight files it does not own beside the agent; the previous save's to remove."""
    owned, foreign = previous_save(directory)
    written = None if writes is None else set(writes)
    left = [n for n in foreign if written is None or n not in written]
    if left:
        raise OutputError(
            f"agent directory {directory} holds {Path(directory) / left[0]}, which no ram_stage.json there "
            "describes (a model saved by another tool or by trainer.save_model?); the agent would be saved beside "
            "it and readers could load either. Remove it or choose another output_dir"
        )
    return [n for n in owned if written is None or n not in written]
