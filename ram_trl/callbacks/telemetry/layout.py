"""Layout discovery of the telemetry: which flat ranges of which base tensors a training model's process measures
(:class:`Region`: ``dense``, ``lora`` or ``frozen``), for a plain, DDP, ZeRO-3, FSDP2 or PEFT LoRA model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ram_trl.callbacks.telemetry.base_weights import BaseSource, ModelBase, base_name
from ram_trl.callbacks.telemetry.shards import LocalShard, iter_local_shards
from ram_trl.distributed import DistContext
from ram_trl.errors import CheckpointError, ConfigError
from ram_trl.io.lora import lora_delta_rows


@dataclass(frozen=True)
class LoraFactorsRef:
    """A live PEFT LoRA layer's factors for one adapter (the base weight's task vector is ``B @ A * scaling``)."""

    module: str
    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    layout: Literal["linear", "transposed"]

    def delta_rows(self, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of the float32 delta; with ``dtype``, of the factors rounded to ``dtype`` first."""
        a, b = self.a.detach(), self.b.detach()
        if dtype is not None:
            a, b = a.to(dtype), b.to(dtype)
        if self.layout == "linear":
            return lora_delta_rows(a.cpu(), b[start:stop].cpu(), self.scaling, self.layout)
        return lora_delta_rows(a[:, start:stop].cpu(), b.cpu(), self.scaling, self.layout)


@dataclass(frozen=True)
class Region:
    """One flat range of one base tensor that this process measures."""

    name: str
    shard: LocalShard
    kind: Literal["dense", "lora", "frozen"]
    lora: LoraFactorsRef | None = None


@dataclass
class ModelLayout:
    """The regions of a model and where its base comes from."""

    regions: list[Region]
    peft: bool
    frozen_base: ModelBase | None = None


def _peft_classes() -> tuple[type, type] | None:
    try:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return None
    return LoraLayer, BaseTunerLayer


def _lora_ref(name: str, module: torch.nn.Module) -> LoraFactorsRef | None:
    """The factors of a PEFT LoRA layer's active adapter (``None`` when no adapter is active on it)."""
    active = [a for a in module.active_adapters if a in module.lora_A or a in module.lora_embedding_A]
    if not active:
        return None
    if len(active) > 1:
        raise ConfigError(
            f"LoRA layer {name!r}: {len(active)} active adapters {active}; the telemetry measures one adapter"
        )
    adapter = active[0]
    if getattr(module, "merged_adapters", None):
        raise ConfigError(
            f"LoRA layer {name!r}: adapters {module.merged_adapters} are merged into the base weight; "
            "unmerge them (model.unmerge_adapter()) before measuring"
        )
    if module.use_dora.get(adapter, False):
        raise ConfigError(f"LoRA layer {name!r}: DoRA (use_dora) is not supported; its delta is not B @ A")
    if getattr(module, "lora_bias", {}).get(adapter, False):
        raise ConfigError(f"LoRA layer {name!r}: lora_bias adapters are not supported")
    scaling = float(module.scaling[adapter])
    if adapter in module.lora_embedding_A:
        return LoraFactorsRef(
            name, module.lora_embedding_A[adapter], module.lora_embedding_B[adapter], scaling, "transposed"
        )
    a, b = module.lora_A[adapter], module.lora_B[adapter]
    if not isinstance(a, torch.nn.Linear) or not isinstance(b, torch.nn.Linear):
        raise ConfigError(
            f"LoRA layer {name!r}: factors of type {type(a).__name__} (conv or other non-linear LoRA layers) "
            "are not supported"
        )
    layout: Literal["linear", "transposed"] = "transposed" if module.fan_in_fan_out else "linear"
    return LoraFactorsRef(name, a.weight, b.weight, scaling, layout)


def model_layout(model: torch.nn.Module) -> ModelLayout:
    """Describe what to measure in ``model``: one region per locally held floating parameter range."""
    classes = _peft_classes()
    lora_refs: dict[str, LoraFactorsRef] = {}
    peft = False
    if classes is not None:
        lora_cls, tuner_cls = classes
        for name, module in model.named_modules():
            if isinstance(module, tuner_cls):
                if not isinstance(module, lora_cls):
                    raise ConfigError(
                        f"PEFT layer {name!r} is a {type(module).__name__}; the telemetry supports LoRA adapters "
                        "(for other PEFT methods, merge the adapter and measure the full model)"
                    )
                peft = True
                ref = _lora_ref(name, module)
                if ref is not None:
                    lora_refs[base_name(f"{name}.weight")] = ref
        if not peft and any(".modules_to_save." in n for n, _ in model.named_parameters()):
            peft = True
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    regions: list[Region] = []
    base_shards: dict[str, LocalShard] = {}
    for shard in iter_local_shards(model):
        if not torch.is_floating_point(shard.values):
            continue
        name = base_name(shard.name)
        components = shard.name.split(".")
        if not peft:
            regions.append(Region(name, shard, "dense"))
            continue
        if any(c.startswith("lora_") for c in components):
            continue
        if "modules_to_save" in components:
            regions.append(Region(name, shard, "dense"))
            continue
        base_shards[name] = shard
        if "original_module" in components:
            continue
        if name in lora_refs:
            regions.append(Region(name, shard, "lora", lora_refs[name]))
        elif shard.name in trainable:
            raise ConfigError(
                f"PEFT model: parameter {shard.name!r} is trained but is neither a LoRA factor nor in "
                "modules_to_save; the telemetry cannot measure it without a base (add its module to "
                "modules_to_save, or freeze it)"
            )
        else:
            regions.append(Region(name, shard, "frozen"))
    seen: dict[str, str] = {}
    for region in regions:
        if region.shard.offset == 0 and region.name in seen:
            raise ConfigError(
                f"parameters {seen[region.name]!r} and {region.shard.name!r} both map to the base tensor "
                f"{region.name!r}; unsupported model layout"
            )
        seen[region.name] = region.shard.name
    frozen = ModelBase(base_shards, "frozen base weights of the PEFT model") if peft else None
    return ModelLayout(regions, peft, frozen)


def check_layout(source: BaseSource, layout: ModelLayout) -> None:
    """Check a model's layout against its base: every ``dense`` region names a base tensor of its shape, every
    ``lora`` region's factors give a delta of its base weight's shape."""
    available = set(source.names())
    for region in layout.regions:
        if region.kind == "dense":
            if region.name not in available:
                raise CheckpointError(
                    f"{source.description}: has no tensor {region.name!r} for the trained parameter "
                    f"{region.shard.name!r} (unsupported model layout, or not this model's base)"
                )
            shape = tuple(source.shape(region.name))
            if shape != tuple(region.shard.shape):
                raise CheckpointError(
                    f"{source.description}: tensor {region.name!r} has shape {list(shape)}, the trained "
                    f"parameter {region.shard.name!r} has {list(region.shard.shape)}"
                )
        if region.kind == "lora":
            assert region.lora is not None
            expected = tuple(region.shard.shape)
            rows, cols = region.lora.b.shape[0], region.lora.a.shape[1]
            got = (rows, cols) if region.lora.layout == "linear" else (cols, rows)
            if got != expected:
                raise ConfigError(
                    f"LoRA layer {region.lora.module!r}: factors give a delta of shape {list(got)}, its base "
                    f"weight has {list(expected)} (partitioned LoRA factors are not supported yet)"
                )


def local_regions(layout: ModelLayout, ctx: DistContext) -> list[Region]:
    """The regions this process measures: all partitioned ones, and its share of the replicated ones."""
    regions: list[Region] = []
    replicated = 0
    for region in layout.regions:
        if ctx.enabled and not region.shard.partitioned:
            replicated += 1
            if (replicated - 1) % ctx.world_size != ctx.rank:
                continue
        regions.append(region)
    return regions


def compute_device(regions: list[Region]) -> torch.device:
    """Where the chunks compute: an accelerator if any region's values live on one, else the CPU."""
    for region in regions:
        if region.shard.values.device.type != "cpu":
            return region.shard.values.device
    return torch.device("cpu")


__all__ = [
    "LoraFactorsRef",
    "ModelLayout",
    "Region",
    "check_layout",
    "compute_device",
    "local_regions",
    "model_layout",
]
