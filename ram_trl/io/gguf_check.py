"""The check that a model transformers built from a GGUF file holds the GGUF's tensors and nothing invented
(transformers silently initialises at random every parameter it cannot map from the file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ram_trl.errors import ConfigError

__all__ = ["check_gguf_parameters"]

#: GGUF tensors transformers recomputes instead of reading (rotary frequencies).
_RECOMPUTED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _names(items: list[str], limit: int = 4) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _tensor_map(model: Any, architecture: str) -> dict[str, str]:
    """GGUF tensor name to the model's parameter name, as transformers maps them."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    return get_gguf_hf_weights_map(model, processor)


def check_gguf_parameters(file: Path, label: str, model: Any, architecture: str) -> int:
    """How many parameters of ``model`` (float32, before any cast) were checked against the GGUF tensors; refused:
    a parameter no GGUF tensor provides, a GGUF tensor unused, values or sizes that differ, a NaN/Inf."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(file))
    tensors = {t.name: t for t in reader.tensors}
    to_model = _tensor_map(model, architecture)
    parameters = dict(model.named_parameters())
    provided = {to_model[name]: name for name in tensors if name in to_model}
    missing = [f"{p} (GGUF {_gguf_name(to_model, p)})" for p in parameters if p not in provided]
    if missing:
        raise ConfigError(
            f"GGUF source {label} ({architecture}) has no tensor for {len(missing)} of the model's "
            f"{len(parameters)} parameters: {_names(missing)}; transformers would initialise them at random. "
            "Check that general.architecture matches the tensors and that the file is complete"
        )
    unused = [n for n in tensors if n not in to_model and n not in _RECOMPUTED]
    if unused:
        raise ConfigError(
            f"GGUF source {label} ({architecture}) holds {len(unused)} tensors the {architecture} model does not "
            f"use: {_names(unused)}; check that general.architecture matches the tensors"
        )
    state = model.state_dict()  # tied weights under each of their names
    for gguf_name, tensor in tensors.items():
        if to_model.get(gguf_name) not in state:
            continue  # recomputed by transformers
        values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)
        bad = int((~np.isfinite(values)).sum())
        if bad:
            raise ConfigError(
                f"GGUF source {label}: tensor {gguf_name} holds {bad} NaN/Inf values; the file is corrupt "
                "(download or convert it again)"
            )
        name = to_model[gguf_name]
        built = state[name].detach().float().reshape(-1)
        if built.numel() != values.size:
            raise ConfigError(
                f"GGUF source {label}: tensor {gguf_name} has {values.size} values but parameter {name} has "
                f"shape {list(state[name].shape)}; the file does not match its own metadata"
            )
        # sorted values: the row permutations transformers applies (llama's query and key heads) do not matter
        if not torch.equal(torch.sort(built).values, torch.sort(torch.from_numpy(values)).values):
            raise ConfigError(
                f"GGUF source {label}: parameter {name} does not hold the values of GGUF tensor {gguf_name}"
            )
    return len(parameters)


def _gguf_name(to_model: dict[str, str], parameter: str) -> str:
    for gguf_name, name in to_model.items():
        if name == parameter:
            return gguf_name
    return "unmapped"
