"""How a merged model maps onto a PEFT LoRA adapter: each tensor's owning module, from the base architecture built on
the meta device (no weights, no ``trust_remote_code``), and ``adapter_config.json``'s content with PEFT-escaped
patterns (docs/lora.md). Reads no tensor data."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ram_trl.errors import CheckpointError
from ram_trl.io.checkpoint import Checkpoint
from ram_trl.io.hub import hub_name
from ram_trl.io.lora import PEFT_PREFIX, meta_model
from ram_trl.io.safetensors_io import TensorInfo
from ram_trl.merging.lora.svd import LoraExportOptions

if TYPE_CHECKING:
    from torch import nn

#: PEFT's ``target_modules`` value for an adapter without LoRA layers (only ``modules_to_save``).
DUMMY_TARGET_MODULES = "dummy-target-modules"
#: The prefix of every tensor name in a PEFT adapter file.


# ---------------------------------------------------------------------------------------------------------------
# The base architecture: which module owns each tensor


@dataclass
class Architecture:
    name: str
    modules: dict[str, nn.Module]
    aliases: dict[str, list[str]]  # parameter name -> every name of the same Parameter (tied weights)
    input_embedding: str | None
    output_embedding: str | None

    def is_linear(self, module_name: str) -> bool:
        from torch import nn

        return isinstance(self.modules.get(module_name), nn.Linear)

    def is_leaf(self, module_name: str) -> bool:
        module = self.modules[module_name]
        return not any(next(child.parameters(), None) is not None for child in module.modules() if child is not module)

    def direct_parameters(self, module_name: str) -> list[str]:
        module = self.modules[module_name]
        return [f"{module_name}.{p}" if module_name else p for p, _ in module.named_parameters(recurse=False)]


def _module_name(module: nn.Module | None, modules: dict[str, nn.Module]) -> str | None:
    if module is None:
        return None
    return next((name for name, m in modules.items() if m is module), None)


def build_architecture(base_dir: Path) -> Architecture:
    """The base's architecture on the meta device (no weights) from its ``config.json``."""
    try:
        model = meta_model(base_dir)
    except Exception as exc:  # transformers raises many types for unknown or broken configs
        raise CheckpointError(
            f"base model {base_dir}: cannot build its architecture from config.json to find the nn.Linear weights "
            f"for the LoRA export ({type(exc).__name__}: {exc}); --output-format lora supports causal LMs that "
            "transformers builds without trust_remote_code"
        ) from exc
    modules = dict(model.named_modules())
    by_object: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(parameter), []).append(name)
    aliases = {name: names for names in by_object.values() for name in names}
    return Architecture(
        name=type(model).__name__,
        modules=modules,
        aliases=aliases,
        input_embedding=_module_name(model.get_input_embeddings(), modules),
        output_embedding=_module_name(model.get_output_embeddings(), modules),
    )


@dataclass
class AdapterPlan:
    """What goes into the adapter, decided tensor by tensor."""

    lora: list[dict[str, Any]] = field(default_factory=list)
    biases: dict[str, str] = field(default_factory=dict)  # bias tensor -> its module
    to_save: dict[str, list[str]] = field(default_factory=dict)  # module -> its changed tensors
    not_exported: list[dict[str, str]] = field(default_factory=list)
    tied: bool = False
    unchanged: int = 0
    changed_tensors: int = 0
    changed_elements: int = 0


def classify(name: str, architecture: Architecture) -> tuple[str, str]:
    """Where a changed tensor of the merged model goes in the adapter."""
    names = architecture.aliases.get(name)
    if names is None:
        return (
            "skip",
            f"{architecture.name} (built from the base's config.json) has no parameter of this name (a buffer, or a "
            "checkpoint name transformers converts on load), so PEFT cannot address it",
        )
    module, _, parameter = name.rpartition(".")
    tied = sorted(n for n in names if n != name)
    if tied:
        embeddings = {architecture.input_embedding, architecture.output_embedding}
        owners = {n.rpartition(".")[0] for n in names}
        if architecture.input_embedding is not None and owners == embeddings:
            return ("save", architecture.input_embedding)
        return (
            "skip",
            f"it is tied to {', '.join(tied)}; PEFT keeps only input/output embedding ties (ensure_weight_tying)",
        )
    if architecture.is_linear(module):
        return ("lora", module) if parameter == "weight" else ("bias", module)
    if not module:
        return ("skip", "a parameter of the top-level model, not of a submodule PEFT can save")
    if not architecture.is_leaf(module):
        kind = type(architecture.modules[module]).__name__
        return (
            "skip",
            f"it belongs to {module} ({kind}), which has submodules: modules_to_save would copy the whole subtree",
        )
    return ("save", module)


def peft_wrapped(modules_to_save: list[str], architecture: Architecture) -> set[str]:
    """The modules PEFT wraps for ``modules_to_save`` (its rule: the module name ends with an entry)."""
    wrapped = {key for key in architecture.modules if any(key.endswith(m) for m in modules_to_save)}
    if (
        architecture.input_embedding in wrapped
        and architecture.output_embedding is not None
        and len(architecture.aliases.get(f"{architecture.output_embedding}.weight", [])) > 1
    ):
        wrapped.add(architecture.output_embedding)  # ensure_weight_tying wraps the tied output embedding too
    return wrapped


def save_conflict(module: str, targets: set[str], architecture: Architecture) -> str | None:
    """Why PEFT would not restore ``module`` as a modules_to_save entry beside these LoRA targets, if it would not."""
    for key in peft_wrapped([module], architecture):
        if key in targets or any(t.startswith(f"{key}.") for t in targets):
            return f"PEFT's modules_to_save entry {module!r} would also wrap {key!r}, which holds LoRA layers"
        if not architecture.is_leaf(key):
            return f"PEFT's modules_to_save entry {module!r} would also wrap {key!r}, which has submodules"
    excluded = [t for t in targets if re.match(rf"(^|.*\.){module}($|\..*)", t)]
    if excluded:
        return f"PEFT's modules_to_save entry {module!r} would exclude the LoRA module {excluded[0]!r}"
    return None


def exact_list(names: list[str], candidates: list[str]) -> bool:
    """Whether PEFT's list rule for ``target_modules`` (equal, or ends with ``.name``) selects exactly ``names``."""
    chosen = set(names)
    for key in candidates:
        parts = key.split(".")
        hit = any(".".join(parts[i:]) in chosen for i in range(len(parts)))
        if hit != (key in chosen):
            return False
    return True


def pattern_keys(pattern: dict[str, int], targets: list[str]) -> dict[str, int]:
    """``rank_pattern``/``alpha_pattern`` keyed by module name, escaped and anchored if PEFT's regex rule (first key
    matching the end of the module name) would give a module another module's value."""
    compiled = [(key, re.compile(rf"(.*\.)?({key})$")) for key in pattern]

    def first(module: str) -> str | None:
        return next((key for key, rule in compiled if rule.match(module)), None)

    if all(first(t) == (t if t in pattern else None) for t in targets):
        return pattern
    return {f"^{re.escape(k)}": v for k, v in pattern.items()}


def adapter_layout(
    plan: AdapterPlan,
    architecture: Architecture,
    merged: Checkpoint,
    options: LoraExportOptions,
    base_dir: Path,
    staged: dict[str, TensorInfo],
) -> tuple[dict[str, Any], dict[str, TensorInfo | str]]:
    """The adapter config and every tensor of the adapter file: a staged factor, or a merged tensor's name."""
    targets = {item["module"] for item in plan.lora}
    # a modules_to_save entry PEFT would resolve to other modules too is left out (rare: suffix-sharing names)
    for module in sorted(plan.to_save):
        reason = save_conflict(module, targets, architecture)
        if reason is not None:
            for name in plan.to_save.pop(module):
                plan.not_exported.append({"tensor": name, "reason": reason})
    modules_to_save = sorted(plan.to_save)
    entries: dict[str, TensorInfo | str] = dict(staged)
    for key in sorted(peft_wrapped(modules_to_save, architecture)):
        for parameter in architecture.direct_parameters(key):
            source = next((n for n in architecture.aliases[parameter] if n in merged.tensors), None)
            if source is None:
                raise CheckpointError(
                    f"merged model {merged.path}: no tensor holds {parameter!r}, which the adapter must save in full "
                    f"(module {key} is in modules_to_save)"
                )
            entries[f"{PEFT_PREFIX}{parameter}"] = source
    lora_only = True
    for name, module in plan.biases.items():
        if module in targets:
            entries[f"{PEFT_PREFIX}{module}.base_layer.bias"] = name
        else:
            entries[f"{PEFT_PREFIX}{name}"] = name
            lora_only = False
    ranks = {item["module"]: item["rank"] for item in plan.lora}
    cap = options.cap
    pattern = {m: r for m, r in sorted(ranks.items()) if options.mode == "energy" or r != cap}
    target_list = sorted(targets)
    pattern = pattern_keys(pattern, target_list)
    if not target_list:
        target_modules: list[str] | str = DUMMY_TARGET_MODULES
    elif exact_list(target_list, list(architecture.modules)):
        target_modules = target_list
    else:
        target_modules = "(?:" + "|".join(re.escape(t) for t in target_list) + ")"
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": hub_name(base_dir),
        "r": cap,
        "lora_alpha": cap,
        "rank_pattern": pattern,
        "alpha_pattern": dict(pattern),
        "target_modules": target_modules,
        "modules_to_save": modules_to_save or None,
        "bias": "none" if not plan.biases else ("lora_only" if lora_only else "all"),
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    if plan.tied and any(architecture.input_embedding == m for m in modules_to_save):
        config["ensure_weight_tying"] = True
    return config, entries


__all__ = ["AdapterPlan", "Architecture", "adapter_layout", "build_architecture", "classify"]
