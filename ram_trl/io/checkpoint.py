"""Model checkpoint directories: Hugging Face layouts of single-file or sharded safetensors (or, on request, pickle).
A :class:`Checkpoint` knows every tensor's name, dtype, shape and location from the headers alone."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ram_trl.errors import CheckpointError
from ram_trl.io.hub import ensure_weights, in_repo_blobs, needs_weights, remote_headers, resolve_model
from ram_trl.io.json_files import read_json_object
from ram_trl.io.lora import AdapterContent, is_adapter_dir, read_adapter
from ram_trl.io.model_dir import PICKLE_INDEX, PICKLE_SINGLE, SAFE_INDEX, SAFE_SINGLE, check_one_model
from ram_trl.io.safetensors_io import SAFETENSORS_DTYPES, RowReader, TensorInfo, TensorMeta, read_safetensors_header

#: File name of an agent's diagonal Fisher beside its weights (:mod:`ram_trl.io.fisher_files`); never a weight file.
FISHER_FILE = "fisher.safetensors"

#: Files copied from the base (or ``tokenizer_source``) into a merged output directory when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def copy_tokenizer(source: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer files (:data:`TOKENIZER_FILES`) found in ``source`` into ``out_dir``."""
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copy2(source / name, out_dir / name)
    return copied


def write_chat_template(out_dir: Path, template: str) -> None:
    """Make ``template`` the chat template of the tokenizer in ``out_dir``, as transformers saves one: the file
    ``chat_template.jinja``, with any other copy of a template (``chat_template.json``, the ``chat_template`` entry
    of ``tokenizer_config.json``) removed so that no loader picks the old one."""
    (out_dir / "chat_template.jinja").write_text(template)
    (out_dir / "chat_template.json").unlink(missing_ok=True)
    config_path = out_dir / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        if "chat_template" in config:
            del config["chat_template"]
            config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


@dataclass
class Checkpoint:
    """A model checkpoint on disk, opened lazily."""

    path: Path
    role: str
    tensors: dict[str, TensorMeta]
    format: str
    files: list[Path] = field(default_factory=list)
    _safetensors: dict[str, TensorInfo] = field(default_factory=dict, repr=False)
    _pickle_files: dict[str, Path] = field(default_factory=dict, repr=False)
    _pickle_cache: dict[Path, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    adapter: AdapterContent | None = field(default=None, repr=False)

    @property
    def kind(self) -> str:
        """``"full"`` for model checkpoints, ``"lora"`` for PEFT LoRA adapters."""
        return "lora" if self.adapter is not None else "full"

    def has_values(self, name: str) -> bool:
        """Whether the checkpoint stores values of ``name`` (an adapter stores only modules_to_save and biases)."""
        if self.adapter is not None:
            return name in self.adapter.full
        return name in self.tensors

    def lora_delta_rows(self, name: str, reader: RowReader, start: int, stop: int) -> torch.Tensor | None:
        """Rows ``start:stop`` of the float32 LoRA delta of ``name``, or ``None`` when no LoRA factor touches it."""
        if self.adapter is None:
            return None
        factors = self.adapter.factors.get(name)
        if factors is not None:
            return factors.delta_rows(reader, start, stop)
        bias = self.adapter.bias_deltas.get(name)
        if bias is not None:
            return reader.read_rows(bias[0], start, stop).to(torch.float32).mul_(bias[1])
        return None

    @property
    def config_path(self) -> Path | None:
        candidate = self.path / "config.json" if self.path.is_dir() else None
        return candidate if candidate is not None and candidate.is_file() else None

    @property
    def total_bytes(self) -> int:
        return sum(self._safetensors[n].nbytes for n in self._safetensors) if self._safetensors else 0

    def location(self, name: str) -> TensorInfo | None:
        """The safetensors location of ``name`` (``None`` for pickle checkpoints)."""
        return self._safetensors.get(name)

    def read_rows(self, name: str, reader: RowReader, start: int | None = None, stop: int | None = None):
        """Read rows ``start:stop`` of tensor ``name`` in its stored dtype."""
        if self.adapter is not None:
            return reader.read_rows(self.adapter.full[name], start, stop)
        if self.format == "safetensors":
            return reader.read_rows(self._safetensors[name], start, stop)
        file = self._pickle_files[name]
        if file not in self._pickle_cache:
            self._pickle_cache.clear()
            self._pickle_cache[file] = _load_pickle(file, self.role)
        tensor = self._pickle_cache[file][name]
        if tensor.dim() == 0:
            return tensor.clone()
        return tensor[start:stop].clone()


def open_checkpoint(
    path: str | Path,
    role: str,
    *,
    allow_pickle: bool = False,
    allow_external_shards: bool = False,
    base_shapes: Mapping[str, tuple[int, ...]] | None = None,
    base_config: Path | None = None,
    fetch: bool = True,
) -> Checkpoint:
    """Open a checkpoint directory and read every tensor's metadata; for a Hub model whose weights are not cached,
    fetch them (``fetch=True``) or read only their headers from the Hub (a dry run)."""
    path = resolve_model(path, what=role, weights=fetch)
    if not fetch and needs_weights(path) and not is_adapter_dir(path):
        return _from_remote_headers(path, role)
    path = ensure_weights(path, role)
    if not path.exists():
        raise CheckpointError(f"{role}: {path} does not exist (not a local path, nor a Hub id ORG/NAME)")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{role}: {path} is a file but not a .safetensors file")
        return _from_safetensors_files(path.parent, role, [path])
    check_one_model(path, role)
    index = path / SAFE_INDEX
    if index.is_file():
        return _from_index(path, role, index, allow_external_shards)
    single = path / SAFE_SINGLE
    if single.is_file():
        return _from_safetensors_files(path, role, [single])
    if is_adapter_dir(path):
        return _from_adapter(path, role, base_shapes, base_config)
    pickles = [path / PICKLE_INDEX, path / PICKLE_SINGLE]
    if any(p.is_file() for p in pickles):
        if not allow_pickle:
            raise CheckpointError(
                f"{role}: {path} holds only pickle checkpoints (pytorch_model*.bin). Pickle files can run "
                "arbitrary code when loaded; convert the model to safetensors (save_pretrained with "
                "safe_serialization=True), or pass --allow-pickle (allow_pickle=True) to load it with "
                "torch.load(weights_only=True)"
            )
        return _from_pickle(path, role, allow_external_shards)
    others = [p for p in sorted(path.glob("*.safetensors")) if p.name != FISHER_FILE]
    if others:
        return _from_safetensors_files(path, role, others)
    raise CheckpointError(
        f"{role}: {path} is not a checkpoint directory (no {SAFE_SINGLE}, {SAFE_INDEX} or *.safetensors files)"
    )


def _from_adapter(
    path: Path, role: str, base_shapes: Mapping[str, tuple[int, ...]] | None = None, base_config: Path | None = None
) -> Checkpoint:
    content = read_adapter(path, role, base_shapes, base_config)
    metas: dict[str, TensorMeta] = {}
    for name, info in content.full.items():
        metas[name] = TensorMeta(name, info.dtype, info.shape)
    for name, factors in content.factors.items():
        existing = metas.get(name)
        if existing is not None and existing.shape != factors.shape:
            raise CheckpointError(
                f"{role}: {path}: the LoRA delta of {name!r} has shape {list(factors.shape)}, the stored "
                f"{name!r} has {list(existing.shape)}"
            )
        metas[name] = TensorMeta(name, existing.dtype if existing else torch.float32, factors.shape)
    for name, (info, _) in content.bias_deltas.items():
        metas.setdefault(name, TensorMeta(name, torch.float32, info.shape))
    files = [path / "adapter_model.safetensors"]
    return Checkpoint(path=path, role=role, tensors=metas, format="safetensors", files=files, adapter=content)


def _from_index(path: Path, role: str, index: Path, allow_external: bool = False) -> Checkpoint:
    data = read_json_object(index, f"{role}: safetensors index")
    file_of = check_weight_map(data, index, path, role, allow_external)
    files = sorted(set(file_of.values()))
    headers: dict[Path, dict[str, TensorInfo]] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{role}: shard {file} listed in {index.name} is missing")
        headers[file] = _read_header(file, role)
    infos: dict[str, TensorInfo] = {}
    for name, file in file_of.items():
        if name not in headers[file]:
            raise CheckpointError(f"{role}: {index.name} maps tensor {name!r} to {file}, which does not hold it")
        infos[name] = headers[file][name]
    return _checkpoint(path, role, infos, files)


def _from_remote_headers(path: Path, role: str) -> Checkpoint:
    infos: dict[str, TensorInfo] = {}
    for file, tensors in remote_headers(path, role).items():
        for name, (dtype, shape, (begin, end)) in tensors.items():
            infos[name] = TensorInfo(name, SAFETENSORS_DTYPES[dtype], tuple(shape), path / file, begin, end)
    return _checkpoint(path, role, infos, sorted({info.file for info in infos.values()}))


def _from_safetensors_files(path: Path, role: str, files: list[Path]) -> Checkpoint:
    infos: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in _read_header(file, role).items():
            if name in infos:
                raise CheckpointError(f"{role}: tensor {name!r} appears in both {infos[name].file} and {file}")
            infos[name] = info
    return _checkpoint(path, role, infos, files)


def _read_header(file: Path, role: str) -> dict[str, TensorInfo]:
    try:
        tensors, _ = read_safetensors_header(file)
    except CheckpointError as exc:
        raise CheckpointError(f"{role}: {exc}") from exc
    return tensors


def _checkpoint(path: Path, role: str, infos: dict[str, TensorInfo], files: list[Path]) -> Checkpoint:
    metas = {n: TensorMeta(n, i.dtype, i.shape) for n, i in infos.items()}
    return Checkpoint(path=path, role=role, tensors=metas, format="safetensors", files=files, _safetensors=infos)


def _load_pickle(file: Path, role: str) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for corrupt pickles
        raise CheckpointError(f"{role}: cannot load pickle checkpoint {file} with weights_only=True ({exc})") from exc
    return check_pickle_state(state, file, role)


def _from_pickle(path: Path, role: str, allow_external: bool = False) -> Checkpoint:
    warnings.warn(
        f"{role}: loading pickle checkpoint {path} (--allow-pickle); memory is bounded by one .bin file, not by "
        "one tensor",
        stacklevel=3,
    )
    index = path / PICKLE_INDEX
    if index.is_file():
        file_of = check_weight_map(
            read_json_object(index, f"{role}: checkpoint index"), index, path, role, allow_external
        )
    else:
        file_of = None
    files = sorted(set(file_of.values())) if file_of else [path / PICKLE_SINGLE]
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{role}: pickle shard {file} listed in {PICKLE_INDEX} is missing")
    metas: dict[str, TensorMeta] = {}
    pickle_files: dict[str, Path] = {}
    for file in files:
        state = _load_pickle(file, role)
        for name, tensor in state.items():
            metas[name] = TensorMeta(name, tensor.dtype, tuple(tensor.shape))
            pickle_files[name] = file
        del state
    return Checkpoint(path=path, role=role, tensors=metas, format="pickle", files=files, _pickle_files=pickle_files)


def confine(path: Path, root: Path, what: str, allow_external: bool = False) -> Path:
    """``path`` if it resolves (symlinks followed) inside ``root``, or, for a Hugging Face cache snapshot, into the
    same repository's ``blobs/``; else a :class:`CheckpointError`."""
    if allow_external:
        return path
    resolved, inside = path.resolve(), root.resolve()
    if resolved != inside and not resolved.is_relative_to(inside) and not in_repo_blobs(path, root):
        raise CheckpointError(
            f"{what} names {path}, which resolves to {resolved}, outside the checkpoint directory {root}; move the "
            "shard into the directory, or pass --allow-external-shards (allow_external_shards=True) if it is meant"
        )
    return path


def check_weight_map(data: Any, index: Path, root: Path, role: str, allow_external: bool = False) -> dict[str, Path]:
    """The ``weight_map`` of a checkpoint index: tensor name to a shard file inside ``root``."""
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{role}: {index} is not a valid checkpoint index: 'weight_map' must be an object mapping tensor names "
            f"to shard files, got {type(weight_map).__name__}"
        )
    files: dict[str, Path] = {}
    for name, file_name in weight_map.items():
        if not isinstance(file_name, str) or not file_name:
            raise CheckpointError(
                f"{role}: {index}: weight_map entry {name!r} must be a shard file name, got {file_name!r}"
            )
        files[name] = confine(root / file_name, root, f"{role}: {index.name} entry {name!r}", allow_external)
    return files


def check_pickle_state(state: Any, file: Path, role: str) -> dict[str, torch.Tensor]:
    """A loaded pickle checkpoint: a mapping of tensor names to tensors (nothing else)."""
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"{role}: {file} holds a {type(state).__name__}, not a state dict of tensors; save the model's "
            "state_dict (better: with safetensors)"
        )
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{role}: {file}: entry {name!r} is a {type(value).__name__}, not a tensor; save only the "
                "state_dict's tensors (better: with safetensors)"
            )
    return dict(state)
