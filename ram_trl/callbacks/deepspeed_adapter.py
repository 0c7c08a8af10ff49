"""Everything ram_trl reads or calls inside DeepSpeed and its transformers integration, in one place: ZeRO-3 has no
public API for a parameter's local partition or for releasing gathered parameters, so the private attributes used
are named here only, tested per release of :data:`TESTED_VERSIONS` (``tests/callbacks/test_deepspeed_adapter.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: The DeepSpeed releases (major.minor) whose internals this module is tested against.
TESTED_VERSIONS = ("0.19",)


@dataclass(frozen=True)
class Partition:
    """One process's partition of a ZeRO-3 parameter: the flat local ``values`` (padded past the parameter's end on
    the last ranks), every rank's partition ``size``, the full parameter's ``numel`` and ``shape``, its process
    ``group`` (``None``: the whole job), and whether it is ``quantized``."""

    values: torch.Tensor
    size: int
    numel: int
    shape: tuple[int, ...]
    group: Any
    quantized: bool


def is_engine(model: Any) -> bool:
    """Whether ``model`` is a ``deepspeed.DeepSpeedEngine`` (checked by name: DeepSpeed need not be importable)."""
    return type(model).__name__ == "DeepSpeedEngine" and isinstance(getattr(model, "module", None), torch.nn.Module)


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` was converted by ``deepspeed.zero.Init`` (ZeRO-3)."""
    return hasattr(param, "ds_tensor") and hasattr(param, "ds_numel")


def partition_of(param: torch.Tensor) -> Partition:
    """What this process holds of a ZeRO-3 parameter (see :func:`is_partitioned`), without a gather."""
    partition = param.ds_tensor
    return Partition(
        values=partition,
        size=int(getattr(partition, "ds_numel", partition.numel())),
        numel=int(param.ds_numel),
        shape=tuple(param.ds_shape),
        group=getattr(param, "ds_process_group", None),
        quantized=hasattr(partition, "ds_quant_scale"),
    )


def release_gathered(engine: Any) -> Callable[[], None] | None:
    """The ZeRO-3 optimizer's method that releases every gathered parameter of a ``DeepSpeedEngine`` (ZeRO-3
    gathers them again from the partitions at their next use), or ``None`` when its optimizer has none."""
    return getattr(getattr(engine.optimizer, "parameter_offload", None), "partition_all_parameters", None)


def regather_persistent(engine: Any) -> None:
    """Gather a ``DeepSpeedEngine``'s persistent parameters again (the small ones ZeRO-3 keeps whole), as DeepSpeed
    does after an optimizer step."""
    persistent = getattr(engine.optimizer, "persistent_parameters", [])
    if persistent:
        persistent[0].all_gather(persistent)


@contextlib.contextmanager
def zero3_loading_off(owners: Sequence[Any]) -> Iterator[None]:
    """Let one process load and generate on its own during a ZeRO-3 run: without it transformers' ``from_pretrained``
    partitions a model with ``deepspeed.zero.Init`` and ``generate`` syncs every step with the other processes,
    collectives they never join."""
    try:
        from transformers.integrations.deepspeed import (
            deepspeed_config,
            set_hf_deepspeed_config,
            unset_hf_deepspeed_config,
        )
    except ImportError:  # pragma: no cover - transformers without the DeepSpeed integration
        yield
        return
    config = deepspeed_config()
    if config is None:  # not a DeepSpeed run
        yield
        return
    held = (getattr(o, name, None) for o in owners for name in ("hf_deepspeed_config", "dschf"))
    current = next((h for h in held if h is not None and getattr(h, "config", None) is config), None)
    if current is None:
        raise RuntimeError(
            "transformers' DeepSpeed config is not the one of the trainer's arguments or accelerate's DeepSpeed "
            "plugin; the merge preview cannot load its reference models on one process and put it back"
        )
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(current)
