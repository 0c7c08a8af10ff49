"""Model references: a local path, or a Hugging Face Hub id (``org/name``, ``org/name@revision``) resolved through the
``huggingface_hub`` cache first, fetching only the files a merge reads (docs/merging.md)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ram_trl.errors import ConfigError
from ram_trl.io.model_dir import SAFE_INDEX

#: What a merge reads besides the weights (and all it needs to validate a config and plan a dry run).
METADATA_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "chat_template.json",
    "chat_template.jinja",
    "adapter_config.json",
)
WEIGHT_PATTERNS = ("*.safetensors",)


@dataclass(frozen=True)
class HubReference:
    """A Hub model repository, at a revision (a branch, tag or commit; ``None``: ``main``)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")

    def fetch_command(self) -> str:
        """The ``hf`` command that puts this repository in the cache."""
        return f"hf download {self.repo_id}" + (f" --revision {self.revision}" if self.revision else "")


def parse_reference(value: str | os.PathLike) -> HubReference | None:
    """A Hub reference (``org/name`` or ``org/name@revision``), or ``None`` for anything else (a local path)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    text = os.fspath(value)
    name, at, revision = text.partition("@")
    if name.count("/") != 1 or (at and (not revision or "@" in revision)):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return HubReference(name, revision or None)


def local_path(value: str | os.PathLike, config_dir: Path | None = None) -> Path:
    """A path as ram_trl reads it: from the working directory, else beside the config file when it exists there."""
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists() or config_dir is None:
        return path
    beside = config_dir / path
    return beside if beside.exists() else path


def resolve_model(
    value: str | os.PathLike, config_dir: Path | None = None, *, what: str = "model", weights: bool = True
) -> Path:
    """The local directory of a model reference."""
    local = local_path(value, config_dir)
    if local.exists():
        return local
    reference = parse_reference(value)
    if reference is None:
        return local
    return _snapshot(reference, what, weights)


def _snapshot(reference: HubReference, what: str, weights: bool, commit: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    patterns = [*METADATA_PATTERNS, *(WEIGHT_PATTERNS if weights else ())]
    revision = commit or reference.revision
    try:
        folder: Path | None = Path(
            snapshot_download(reference.repo_id, revision=revision, allow_patterns=patterns, local_files_only=True)
        )
    except Exception:  # noqa: BLE001 - not in the cache (any reason): ask the Hub below
        folder = None
    if folder is not None and not missing_files(folder, weights):
        return folder
    try:
        folder = Path(snapshot_download(reference.repo_id, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # noqa: BLE001 - offline and not cached, unknown repository, no network, gated, ...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{what}: {str(reference)!r} is not a local path and the Hub repository could not be resolved "
            f"({type(exc).__name__}: {reason[:160]}); fetch it with `{reference.fetch_command()}`"
        ) from exc
    missing = missing_files(folder, weights)
    if missing:
        raise ConfigError(
            f"{what}: the Hub repository {reference} ({folder}) lacks {', '.join(missing[:4])}; fetch it with "
            f"`{reference.fetch_command()}`"
        )
    return folder


def missing_files(folder: Path, weights: bool = True) -> list[str]:
    """The files a merge needs that a model directory lacks (a model's ``config.json`` or an adapter's config, and
    with ``weights`` every shard its index names, or some ``*.safetensors``)."""
    if (folder / "adapter_config.json").is_file():
        needed = ["adapter_model.safetensors"] if weights else []
        return [name for name in needed if not (folder / name).is_file()]
    if not (folder / "config.json").is_file():
        return ["config.json"]
    if not weights:
        return []
    index = folder / SAFE_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        except (ValueError, AttributeError):
            return []  # an unreadable index: the checkpoint reader names it
        return [name for name in shards if not (folder / name).is_file()]
    stored = [*folder.glob("*.safetensors"), *folder.glob("pytorch_model*.bin")]
    # fisher.safetensors (ram-trl fisher writes it beside an agent's weights) holds no weights
    return [] if any(p.is_file() and p.name != "fisher.safetensors" for p in stored) else ["*.safetensors"]


def cached_revision(path: str | os.PathLike) -> HubReference | None:
    """The repository and commit of a cache snapshot directory (``.../models--ORG--NAME/snapshots/COMMIT``) or None."""
    parts = Path(os.path.abspath(path)).parts
    if len(parts) < 3 or parts[-2] != "snapshots" or not parts[-3].startswith("models--"):
        return None
    repo_id = parts[-3].removeprefix("models--").replace("--", "/")
    return HubReference(repo_id, parts[-1])


def hub_name(path: Path) -> str:
    """How a saved config names a model directory: a cache snapshot by its repository id (as ``from_pretrained``
    and PEFT record a Hub model), any other directory by its absolute path."""
    reference = cached_revision(path)
    return reference.repo_id if reference is not None else str(path.resolve())


def ensure_weights(path: Path, what: str) -> Path:
    """Fetch the weights of a cache snapshot metadata was resolved from, unless cached (other paths: nothing)."""
    reference = cached_revision(path)
    if reference is None or not path.is_dir() or not missing_files(path, weights=True):
        return path
    return _snapshot(reference, what, weights=True, commit=reference.revision)


def needs_weights(path: Path) -> bool:
    """Whether ``path`` is a cache snapshot whose weights are not (all) in the cache yet."""
    return cached_revision(path) is not None and path.is_dir() and bool(missing_files(path, weights=True))


def remote_headers(path: Path, what: str) -> dict[str, dict[str, tuple[str, list[int], list[int]]]]:
    """The safetensors headers of a cache snapshot's weight files, read from the Hub by HTTP range requests (a few
    kilobytes per file, no weights): per file, each tensor's ``(dtype, shape, data_offsets)``."""
    from huggingface_hub import HfApi

    reference = cached_revision(path)
    assert reference is not None
    index = path / SAFE_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    else:
        files = ["adapter_model.safetensors" if (path / "adapter_config.json").is_file() else "model.safetensors"]
    api = HfApi()
    out: dict[str, dict[str, tuple[str, list[int], list[int]]]] = {}
    for name in files:
        try:
            meta = api.parse_safetensors_file_metadata(reference.repo_id, name, revision=reference.revision)
        except Exception as exc:  # noqa: BLE001 - offline, no network, missing file, not safetensors, ...
            raise ConfigError(
                f"{what}: the headers of {reference.repo_id}'s {name} are not in the cache and cannot be read "
                f"from the Hub ({type(exc).__name__}); fetch it with `{reference.fetch_command()}`"
            ) from exc
        out[name] = {t: (info.dtype, list(info.shape), list(info.data_offsets)) for t, info in meta.tensors.items()}
    return out


def in_repo_blobs(file: Path, root: Path) -> bool:
    """Whether ``file`` is a cache snapshot's own file: named inside the snapshot directory ``root`` and resolving
    (links followed) into the same repository's ``blobs/`` (the cache's layout, ``snapshots/C/F ->
    ../../blobs/SHA``); a link anywhere else is not."""
    if cached_revision(root) is None:
        return False
    named = Path(os.path.normpath(os.path.abspath(file)))
    snapshot = Path(os.path.abspath(root))
    if not named.is_relative_to(snapshot):
        return False
    blobs = (snapshot.parent.parent / "blobs").resolve()
    return file.resolve().is_relative_to(blobs)


def describe(path: str | os.PathLike, written: str | os.PathLike | None = None) -> dict[str, str]:
    """How a report records an input: ``{"repo_id", "revision"}`` (the commit) for a cache snapshot, ``{}`` else."""
    reference = cached_revision(path)
    if reference is None:
        return {}
    out = {"repo_id": reference.repo_id, "revision": str(reference.revision)}
    asked = parse_reference(written) if written is not None else None
    if asked is not None and asked.revision:
        out["requested"] = asked.revision
    return out


__all__ = [
    "METADATA_PATTERNS",
    "WEIGHT_PATTERNS",
    "HubReference",
    "cached_revision",
    "describe",
    "ensure_weights",
    "hub_name",
    "in_repo_blobs",
    "local_path",
    "missing_files",
    "needs_weights",
    "parse_reference",
    "remote_headers",
    "resolve_model",
]
