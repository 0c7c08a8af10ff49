"""The two precisions of a task vector: the one the trainer holds the parameters in (``density``), and the one the
agent is saved in (``density_saved``, what a merge sees). Details: docs/telemetry.md, "Which save dtype"."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ram_trl.errors import ConfigError
from ram_trl.messages import canonical_dtype

#: The dtypes an agent can be saved in.
SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: The ``save_dtype`` that saves in the dtype the trainer holds the trained parameters in.
AUTO = "auto"
#: Below this share of the training-precision active elements kept by the save, the callback warns at train end.
KEPT_WARNING = 0.5


def resolve_save_dtype(save_dtype: str | torch.dtype) -> torch.dtype | None:
    """The torch dtype of a ``save_dtype`` argument; ``None`` for ``"auto"`` (the training dtype, known at setup)."""
    if isinstance(save_dtype, torch.dtype) and save_dtype in SAVE_DTYPES.values():
        return save_dtype
    if str(save_dtype) == AUTO:
        return None
    key = canonical_dtype(save_dtype, SAVE_DTYPES)
    if key not in SAVE_DTYPES:
        raise ConfigError(
            f"save_dtype={save_dtype!r}: use {AUTO!r} or one of {', '.join(SAVE_DTYPES)} (or bf16, fp16, fp32)"
        )
    return SAVE_DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def training_dtypes(regions: Iterable[Any]) -> list[torch.dtype]:
    """The dtypes of the trained values among a layout's regions (dense parameters, LoRA factors), sorted by name."""
    found = set()
    for region in regions:
        if region.kind == "dense":
            found.add(region.shard.values.dtype)
        elif region.kind == "lora" and region.lora is not None:
            found.update((region.lora.a.dtype, region.lora.b.dtype))
    return sorted(found, key=dtype_name)


def auto_save_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """The save dtype ``"auto"`` resolves to: the training dtype if one of :data:`SAVE_DTYPES`, else float32."""
    if len(dtypes) == 1 and dtypes[0] in SAVE_DTYPES.values():
        return dtypes[0]
    return torch.float32


def precision_record(
    training: list[torch.dtype], saved: torch.dtype, metrics: dict[str, float], prefix: str
) -> dict[str, Any]:
    """The densities of a measurement with the dtype each was counted in, for the stage manifest."""
    out: dict[str, Any] = {
        "training_dtype": "+".join(dtype_name(d) for d in training) or None,
        "save_dtype": dtype_name(saved),
        "densities": {},
    }
    if f"{prefix}density" in metrics:
        for view, suffix, dtype in (("training", "", out["training_dtype"]), ("saved", "_saved", out["save_dtype"])):
            out["densities"][view] = {
                "dtype": dtype,
                "density": metrics[f"{prefix}density{suffix}"],
                "active": int(metrics[f"{prefix}active{suffix}"]),
            }
    return out


def rounding_warning(record: dict[str, Any]) -> str | None:
    """One line when the save keeps under :data:`KEPT_WARNING` of the elements training moved above eps."""
    densities = record["densities"]
    if not densities or not densities["training"]["active"]:
        return None
    trained, saved = densities["training"], densities["saved"]
    kept = saved["active"] / trained["active"]
    if kept >= KEPT_WARNING:
        return None
    return (
        f"save_dtype={saved['dtype']} keeps {saved['density']:.1%} of the elements above eps where training "
        f"({trained['dtype']}) moved {trained['density']:.1%}: the merge, the overlap, rho and the unique share see "
        "the saved agent; save_dtype='auto' saves the weights as trained (docs/telemetry.md, 'Which save dtype')"
    )


__all__ = [
    "AUTO",
    "KEPT_WARNING",
    "SAVE_DTYPES",
    "auto_save_dtype",
    "precision_record",
    "resolve_save_dtype",
    "rounding_warning",
]
