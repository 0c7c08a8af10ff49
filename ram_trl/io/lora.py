"""PEFT LoRA adapters as merge inputs: each target module's task vector is the dense delta ``B @ A * scaling``.
Details: docs/lora.md."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ram_trl.errors import CheckpointError
from ram_trl.io.json_files import read_json_object
from ram_trl.io.lora_product import lora_product
from ram_trl.io.safetensors_io import RowReader, TensorInfo, read_safetensors_header

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraFactors:
    """The LoRA factors of one target module."""

    target: str
    a: TensorInfo
    b: TensorInfo
    scaling: float
    layout: Literal["linear", "transposed"]

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.b.shape[0], self.a.shape[1]
        return (rows, cols) if self.layout == "linear" else (cols, rows)

    def delta_rows(self, reader: RowReader, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the dense float32 delta ``B @ A * scaling`` (transposed for that layout)."""
        if self.layout == "linear":
            return lora_delta_rows(
                reader.read_rows(self.a), reader.read_rows(self.b, start, stop), self.scaling, self.layout
            )
        return lora_delta_rows(
            reader.read_rows(self.a)[:, start:stop], reader.read_rows(self.b), self.scaling, self.layout
        )


def lora_delta_rows(
    a: torch.Tensor, b: torch.Tensor, scaling: float, layout: Literal["linear", "transposed"]
) -> torch.Tensor:
    """The dense float32 delta of LoRA factors, ``B @ A * scaling`` (``(B @ A).T * scaling`` when transposed)."""
    product = lora_product(b, a)
    if layout == "transposed":
        product = product.T
    return product.mul_(scaling)


@dataclass
class AdapterContent:
    """What an adapter holds, mapped onto base tensor names."""

    config: dict
    factors: dict[str, LoraFactors] = field(default_factory=dict)
    full: dict[str, TensorInfo] = field(default_factory=dict)
    bias_deltas: dict[str, tuple[TensorInfo, float]] = field(default_factory=dict)


def is_adapter_dir(path: Path) -> bool:
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file()


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    # PEFT's rule: the first pattern that matches the end of the module name (at a dot boundary).
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


_FACTOR = re.compile(r"^(.*)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)((?:\.[^.]+)*)$")


def _factor_key(name: str) -> tuple[str, str, str | None] | None:
    """``(module, part, adapter name)`` of a LoRA factor's key (base-model names), ``None`` for other tensors."""
    match = _FACTOR.match(name)
    if match is None:
        return None
    module, factor = match.group(1), match.group(2)
    rest = [p for p in match.group(3).split(".") if p]
    if factor.startswith("lora_embedding"):
        if len(rest) <= 1:
            return module, factor, rest[0] if rest else None
        return None
    if rest and rest[-1] in ("weight", "bias") and len(rest) <= 2:
        if rest[-1] == "bias" and factor != "lora_B":
            return None
        part = "lora_B.bias" if rest[-1] == "bias" else factor
        return module, part, rest[0] if len(rest) == 2 else None
    return None


#: The transformers model types whose modeling code builds ``transformers.pytorch_utils.Conv1D`` layers (the GPT-2
#: family); every other model type's LoRA targets are ``nn.Linear`` layers. tests/io/test_lora.py checks it against
#: the installed transformers.
CONV1D_MODEL_TYPES = frozenset(
    {"clvp", "clvp_decoder", "clvp_encoder", "decision_transformer", "gpt2", "imagegpt", "openai-gpt"}
)


def meta_model(base_dir: Path) -> torch.nn.Module:
    """The base's causal LM built on the meta device (no weights, no ``trust_remote_code``) from its ``config.json``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def conv1d_modules(base_config: Path) -> frozenset[str] | None:
    """The names of the base's transformers ``Conv1D`` modules, the layers PEFT applies LoRA to transposed."""
    try:
        config = read_json_object(base_config, "base model config")
    except CheckpointError:
        return None
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or config.get("auto_map"):
        return None
    if model_type not in CONV1D_MODEL_TYPES:
        return frozenset()
    from transformers.pytorch_utils import Conv1D

    try:
        model = meta_model(base_config.parent)
    except Exception:  # transformers raises many types for unknown or broken configs
        return None
    return frozenset(name for name, module in model.named_modules() if isinstance(module, Conv1D))


def _layout(
    module: str,
    a: TensorInfo,
    b: TensorInfo,
    fan_in_fan_out: bool,
    base_shapes: Mapping[str, tuple[int, ...]] | None,
    conv1d: Callable[[], frozenset[str] | None],
) -> Literal["linear", "transposed"]:
    """How PEFT applies a ``lora_A``/``lora_B`` pair: by the module's class, not by the config's flag (PEFT resets
    ``fan_in_fan_out`` to False on ``nn.Linear`` and to True on GPT-2's ``Conv1D``). The class shows in the base
    tensor's shape, ``(out, in)`` for a Linear and ``(in, out)`` for a Conv1D; where the shape is square or unknown,
    the base's architecture names its ``Conv1D`` modules (:func:`conv1d_modules`); the flag decides only where the
    architecture is unknown too."""
    shape = None if base_shapes is None else base_shapes.get(f"{module}.weight")
    if shape is not None and len(a.shape) == 2 and len(b.shape) == 2:
        linear, transposed = (b.shape[0], a.shape[1]), (a.shape[1], b.shape[0])
        if linear != transposed and tuple(shape) == linear:
            return "linear"
        if linear != transposed and tuple(shape) == transposed:
            return "transposed"
    known = conv1d()
    if known is not None:
        return "transposed" if module in known else "linear"
    return "transposed" if fan_in_fan_out else "linear"


def read_adapter(
    path: Path, role: str, base_shapes: Mapping[str, tuple[int, ...]] | None = None, base_config: Path | None = None
) -> AdapterContent:
    """Read and validate a PEFT adapter directory."""
    config_path = path / ADAPTER_CONFIG
    config = read_json_object(config_path, f"{role}: adapter config")
    method = str(config.get("peft_type", "LORA")).upper()
    if method != "LORA":
        raise CheckpointError(
            f"{role}: {path} is a PEFT {method} adapter; only LoRA adapters can be merged (their task vector is "
            "B @ A * scaling). Merge it into its base (PeftModel.merge_and_unload) and pass the full model instead"
        )
    if config.get("use_dora"):
        raise CheckpointError(
            f"{role}: {path} is a DoRA adapter (use_dora: true); its task vector is not B @ A * scaling and ram_trl "
            "does not merge DoRA adapters directly. Merge it into its base (PeftModel.merge_and_unload) and pass "
            "the full model instead"
        )
    for feature in ("layer_replication", "trainable_token_indices", "target_parameters"):
        if config.get(feature):
            raise CheckpointError(f"{role}: {path} uses the LoRA option {feature!r}, which ram_trl does not support")
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        if (path / "adapter_model.bin").is_file():
            raise CheckpointError(
                f"{role}: {path} stores its adapter as a pickle (adapter_model.bin); save it with safetensors "
                "(save_pretrained(..., safe_serialization=True))"
            )
        raise CheckpointError(f"{role}: {path} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    try:
        tensors, _ = read_safetensors_header(weights)
    except CheckpointError as exc:
        raise CheckpointError(f"{role}: {exc}") from exc

    settings = check_lora_config(config, config_path, role)
    rank, alpha = settings.rank, settings.alpha
    rank_pattern, alpha_pattern = settings.rank_pattern, settings.alpha_pattern
    rslora, fan_in_fan_out = settings.rslora, settings.fan_in_fan_out
    content = AdapterContent(config=config)
    kinds: list[frozenset[str] | None] = []

    def conv1d() -> frozenset[str] | None:  # read once, and only for a target its shape cannot place
        if not kinds:
            kinds.append(None if base_config is None else conv1d_modules(base_config))
        return kinds[0]

    pairs: dict[str, dict[str, TensorInfo]] = {}
    adapter_names: dict[str | None, str] = {}
    for key, info in tensors.items():
        name = key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key
        name = name.replace(".base_layer.", ".")
        factor = _factor_key(name)
        if factor is not None:
            module, part, adapter_name = factor
            adapter_names.setdefault(adapter_name, key)
            if len(adapter_names) > 1:
                break
            if part in pairs.get(module, {}):
                raise CheckpointError(f"{role}: {path}: tensor {key!r} repeats the {part} of module {module!r}")
            pairs.setdefault(module, {})[part] = info
            continue
        if "lora_magnitude_vector" in name:
            raise CheckpointError(f"{role}: {path} holds DoRA magnitude vectors ({key}); DoRA is not supported")
        if re.search(r"\.lora_[A-Za-z_]+", name):
            raise CheckpointError(f"{role}: {path}: tensor {key!r} is a LoRA variant ram_trl does not understand")
        name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)
        content.full[name] = info
    if len(adapter_names) > 1:
        named = sorted(repr(n) if n else "unnamed" for n in adapter_names)
        raise CheckpointError(
            f"{role}: {path}: {ADAPTER_WEIGHTS} holds the factors of several adapters ({', '.join(named)}, e.g. "
            f"{sorted(adapter_names.values())[-1]!r}); save one adapter per directory "
            "(PeftModel.save_pretrained(..., selected_adapters=[NAME]))"
        )
    for module, parts in pairs.items():
        r = int(_pattern_value(rank_pattern, module, rank))
        module_alpha = _pattern_value(alpha_pattern, module, alpha)
        scaling = module_alpha / math.sqrt(r) if rslora else module_alpha / r
        if "lora_A" in parts and "lora_B" in parts:
            a, b = parts["lora_A"], parts["lora_B"]
            layout: Literal["linear", "transposed"] = _layout(module, a, b, fan_in_fan_out, base_shapes, conv1d)
        elif "lora_embedding_A" in parts and "lora_embedding_B" in parts:
            a, b = parts["lora_embedding_A"], parts["lora_embedding_B"]
            layout = "transposed"
        else:
            raise CheckpointError(f"{role}: {path}: module {module!r} has {sorted(parts)} but not both LoRA factors")
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise CheckpointError(
                f"{role}: {path}: module {module!r} has LoRA factors of shapes {list(a.shape)} and {list(b.shape)}, "
                "which do not multiply (conv and other non-2-D LoRA layers are not supported)"
            )
        if a.shape[0] != r:
            raise CheckpointError(
                f"{role}: {path}: module {module!r} has rank {a.shape[0]} but the config (r / rank_pattern) says {r}"
            )
        content.factors[f"{module}.weight"] = LoraFactors(f"{module}.weight", a, b, scaling, layout)
        if "lora_B.bias" in parts:
            content.bias_deltas[f"{module}.bias"] = (parts["lora_B.bias"], scaling)
    return content


@dataclass(frozen=True)
class LoraSettings:
    """The numbers of an ``adapter_config.json`` a LoRA delta needs, validated."""

    rank: int
    alpha: float
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    rslora: bool
    fan_in_fan_out: bool


def _pattern(value: Any, where: str, field: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: {field} must be an object of regex -> value, got {value!r}")
    for pattern in value:
        try:
            re.compile(rf"(.*\.)?({pattern})$")
        except re.error as exc:
            raise CheckpointError(
                f"{where}: {field} key {pattern!r} is not a valid regular expression ({exc})"
            ) from exc
    return value


def check_lora_config(config: Any, path: Path, role: str) -> LoraSettings:
    """Validate the LoRA numbers of an adapter config: ranks positive integers, alphas finite, patterns valid regexes."""
    where = f"{role}: {path}"
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: an adapter config must be a JSON object")

    def rank(value: Any, field: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int | float) or not float(value).is_integer() or value < 1:
            raise CheckpointError(f"{where}: {field} must be a positive integer rank, got {value!r}")
        return int(value)

    def alpha(value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise CheckpointError(f"{where}: {field} must be a finite number, got {value!r}")
        return float(value)

    rank_pattern = _pattern(config.get("rank_pattern"), where, "rank_pattern")
    alpha_pattern = _pattern(config.get("alpha_pattern"), where, "alpha_pattern")
    return LoraSettings(
        rank=rank(config.get("r", 8), "r"),
        alpha=alpha(config.get("lora_alpha", 8), "lora_alpha"),
        rank_pattern={k: rank(v, f"rank_pattern[{k!r}]") for k, v in rank_pattern.items()},
        alpha_pattern={k: alpha(v, f"alpha_pattern[{k!r}]") for k, v in alpha_pattern.items()},
        rslora=bool(config.get("use_rslora")),
        fan_in_fan_out=bool(config.get("fan_in_fan_out")),
    )
