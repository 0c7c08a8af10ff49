"""One reading of a model directory for every reader (merge, analyze, eval, fisher, preview, the recipes' scoring):
a directory that two readers would read as two different models (transformers prefers ``model.safetensors`` to an
index and a full model to an adapter; other readers did not) is refused, naming the files."""

from __future__ import annotations

from pathlib import Path

from ram_trl.errors import CheckpointError

__all__ = ["PICKLE_INDEX", "PICKLE_SINGLE", "SAFE_INDEX", "SAFE_SINGLE", "check_one_model"]

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"
_FULL = (SAFE_SINGLE, SAFE_INDEX, PICKLE_SINGLE, PICKLE_INDEX)


def check_one_model(path: str | Path, role: str) -> None:
    """Refuse a directory holding two models: ``model.safetensors`` and a shard index, or a full model's weights
    and a PEFT adapter. ``role`` names the input in the message (``"agent 'coding'"``)."""
    directory = Path(path)
    if not directory.is_dir():
        return
    if (directory / SAFE_SINGLE).is_file() and (directory / SAFE_INDEX).is_file():
        raise CheckpointError(
            f"{role}: {directory} holds both {SAFE_SINGLE} and a shard index {SAFE_INDEX}; transformers reads the "
            "first, a merge would read the shards: remove the stale one"
        )
    full = [name for name in _FULL if (directory / name).is_file()]
    if full and (directory / "adapter_config.json").is_file():
        raise CheckpointError(
            f"{role}: {directory} holds both a full model ({full[0]}) and a PEFT adapter (adapter_config.json); "
            "readers would disagree on which is the model: move one of them into its own directory"
        )
