"""Layer anatomy of a checkpoint: each tensor's module type and decoder layer from its name alone
(``<prefix>.layers.<i>.<block>.<module>.weight``, or GPT-2's ``<prefix>.h.<i>....``), summed into the anatomy tables
of ``ram-trl analyze`` and the telemetry. Imports no torch."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from ram_trl.statistics import TensorAnalysis

#: Module types, in report order, and the family each belongs to.
MODULE_FAMILIES: dict[str, str] = {
    "attn_q": "attention",
    "attn_k": "attention",
    "attn_v": "attention",
    "attn_o": "attention",
    "attn_qkv": "attention",
    "mlp_gate": "mlp",
    "mlp_up": "mlp",
    "mlp_down": "mlp",
    "mlp_gate_up": "mlp",
    "norm": "norm",
    "embedding": "embedding",
    "lm_head": "lm_head",
    "other": "other",
}

FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(MODULE_FAMILIES.values()))  #: Families, in report order.

#: Module names (one component of a tensor name) and their module type.
MODULE_ALIASES: dict[str, str] = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_o",
    "out_proj": "attn_o",
    "qkv_proj": "attn_qkv",
    "query_key_value": "attn_qkv",
    "W_pack": "attn_qkv",
    "gate_proj": "mlp_gate",
    "up_proj": "mlp_up",
    "down_proj": "mlp_down",
    "gate_up_proj": "mlp_gate_up",
    "embed_tokens": "embedding",
    "wte": "embedding",
    "wpe": "embedding",
    "word_embeddings": "embedding",
    "lm_head": "lm_head",
}

_NORM = re.compile(r"(norm|^ln_(\d+|f)$)", re.IGNORECASE)
_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)(?:\.|$)")

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class TensorPlace:
    """Where a tensor sits in the architecture."""

    module: str
    layer: int | None

    @property
    def family(self) -> str:
        return MODULE_FAMILIES[self.module]


def module_type(name: str) -> str:
    """The module type of a tensor name: the last name component that is a known module (:data:`MODULE_ALIASES`) or
    a normalisation layer (a component containing ``norm``, or GPT-2's ``ln_1`` / ``ln_f``); else ``"other"``."""
    for part in reversed(name.split(".")):
        if part in MODULE_ALIASES:
            return MODULE_ALIASES[part]
        if _NORM.search(part):
            return "norm"
    return "other"


def layer_index(name: str) -> int | None:
    """The decoder layer of a tensor name (``...layers.<i>...`` or ``...h.<i>...``), or ``None``."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def with_layer(name: str, index: int) -> str:
    """``name`` renumbered to decoder layer ``index`` (the first ``layers.<i>`` / ``h.<i>`` component)."""
    match = _LAYER.search(name)
    assert match is not None, name
    return name[: match.start(1)] + str(index) + name[match.end(1) :]


def classify(name: str) -> TensorPlace:
    """Module type and layer of a tensor name, e.g. ``model.layers.3.self_attn.q_proj.weight`` -> ``(attn_q, 3)``."""
    return TensorPlace(module_type(name), layer_index(name))


def aggregate(items: Iterable[tuple[str, T]], key: Callable[[str], K], add: Callable[[T, T], T]) -> dict[K, T]:
    """Combine per-tensor values by bucket."""
    buckets: dict[K, T] = {}
    for name, value in items:
        bucket = key(name)
        if bucket is None:
            continue
        buckets[bucket] = add(buckets[bucket], value) if bucket in buckets else value
    return buckets


def _bucket(record: TensorAnalysis, num_agents: int) -> dict[str, Any]:
    stats = record.eps
    return {
        "tensors": record.tensors,
        "numel": stats.numel,
        "density": [stats.density(t) for t in range(num_agents)],
        "density_exact": [record.exact.density(t) for t in range(num_agents)],
        "density_bf16": None if record.bf16 is None else [record.bf16.density(t) for t in range(num_agents)],
        "density_any": stats.union() / stats.numel if stats.numel else 0.0,
    }


def summarize(records: dict[str, TensorAnalysis], num_agents: int) -> dict[str, Any]:
    """Densities per module type, per family and per decoder layer, from per-tensor statistics."""
    items = list(records.items())
    modules = aggregate(items, lambda n: classify(n).module, operator.add)
    families = aggregate(items, lambda n: classify(n).family, operator.add)
    layers = aggregate(items, lambda n: classify(n).layer, operator.add)
    layer_modules = aggregate(
        items, lambda n: None if classify(n).layer is None else (classify(n).layer, classify(n).module), operator.add
    )
    return {
        "modules": [
            {"module": m, "family": MODULE_FAMILIES[m], **_bucket(modules[m], num_agents)}
            for m in MODULE_FAMILIES
            if m in modules
        ],
        "families": [{"family": f, **_bucket(families[f], num_agents)} for f in FAMILIES if f in families],
        "layers": [
            {
                "layer": layer,
                **_bucket(layers[layer], num_agents),
                "modules": {
                    m: [layer_modules[(layer, m)].eps.density(t) for t in range(num_agents)]
                    for m in MODULE_FAMILIES
                    if (layer, m) in layer_modules
                },
            }
            for layer in sorted(layers)
        ],
    }
