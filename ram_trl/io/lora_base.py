"""``MODEL+ADAPTER`` where a full model is needed (a base, or an adapter on another model than the base): the adapter
merged into the model as mergekit 0.1.5 does it (transformers loads the model, PEFT's ``merge_and_unload``,
``save_pretrained``), written once under the temporary directory, keyed by the inputs' content, and reused."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ram_trl.digest import hasher
from ram_trl.errors import ConfigError
from ram_trl.io.hub import METADATA_PATTERNS

#: Where merged ``MODEL+ADAPTER`` models are kept (under the system's temporary directory).
CACHE_NAME = "ram_trl-lora-merged"
_DONE = ".complete"
#: The model's files copied beside the merged weights (not its config, index or weights: those are written anew).
_TRAVEL = [p for p in METADATA_PATTERNS if p not in ("config.json", "*.safetensors.index.json", "adapter_config.json")]


def _fingerprint(model: Path, adapter: Path) -> str:
    """The key of a merged model: the model's files (name, size, modification time) and the adapter's bytes."""
    digest = hasher()
    for file in sorted(p for p in model.iterdir() if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    digest.update(str(model.resolve()).encode())
    for file in sorted(p for p in adapter.iterdir() if p.is_file() and not p.name.startswith(".")):
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:24]


def merged_model(model: Path, adapter: Path, what: str) -> Path:
    """The directory of ``model`` with the LoRA ``adapter`` merged in, as mergekit builds it."""
    target = Path(tempfile.gettempdir()) / CACHE_NAME / _fingerprint(model, adapter)
    if (target / _DONE).is_file():
        return target
    import peft
    from transformers import AutoModelForCausalLM

    from ram_trl.io.quiet import progress_bars_off

    target.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with progress_bars_off():
            loaded = AutoModelForCausalLM.from_pretrained(model, low_cpu_mem_usage=True)
            merged = peft.PeftModel.from_pretrained(loaded, adapter, is_trainable=False).merge_and_unload()
            merged.save_pretrained(temp, safe_serialization=True)
        for file in model.iterdir():  # the tokenizer and generation config travel with the model
            if file.is_file() and any(file.match(p) for p in _TRAVEL) and not (temp / file.name).exists():
                shutil.copyfile(file, temp / file.name)
        (temp / _DONE).write_text(f"{model}\n{adapter}\n")
        try:
            os.rename(temp, target)
        except OSError:  # another process finished it first
            shutil.rmtree(temp, ignore_errors=True)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        shutil.rmtree(temp, ignore_errors=True)
        raise ConfigError(f"{what}: cannot merge the adapter {adapter} into {model} ({exc})") from exc
    return target


__all__ = ["CACHE_NAME", "merged_model"]
