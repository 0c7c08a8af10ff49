"""Builders shared by the telemetry tests: a tiny model with hand-set task vectors, its base, stages and priors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ram_trl.stage.manifest import StageManifest, describe_files, fingerprint_checkpoint, write_manifest
from tests.helpers import TELEMETRY

S, M, L = 2.0**-20, 2.0**-10, 2.0**-6
P = TELEMETRY

#: tau per tensor (flattened), and the expected counts: (active at eps, changed, active in bf16).
TAU = {
    "model.embed_tokens.weight": [L, 0, M, S, 0, 0],
    "model.layers.0.self_attn.q_proj.weight": [L, L, M, 0],
    "model.layers.1.mlp.up_proj.weight": [0, 0, 0, 0],
    "model.norm.weight": [S, M],
    "lm_head.weight": [L, 0, 0, 0, 0, -L],
}
SHAPES = {
    "model.embed_tokens.weight": (3, 2),
    "model.layers.0.self_attn.q_proj.weight": (2, 2),
    "model.layers.1.mlp.up_proj.weight": (2, 2),
    "model.norm.weight": (2,),
    "lm_head.weight": (3, 2),
}
NUMEL = 22


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))


def tiny_model() -> nn.Module:
    """A decoder-shaped module with the parameter names of :data:`TAU`, all weights 1.0 (the base)."""
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(3, 2)
    model.model.layers = nn.ModuleList([nn.Module(), nn.Module()])
    model.model.layers[0].self_attn = nn.Module()
    model.model.layers[0].self_attn.q_proj = nn.Linear(2, 2, bias=False)
    model.model.layers[1].mlp = nn.Module()
    model.model.layers[1].mlp.up_proj = nn.Linear(2, 2, bias=False)
    model.model.norm = Norm()
    model.lm_head = nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    assert dict((n, tuple(p.shape)) for n, p in model.named_parameters()) == SHAPES
    return model


def train(model: nn.Module, tau: dict[str, list[float]] = TAU) -> nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.tensor(tau[name], dtype=torch.float32).reshape(p.shape))
    return model


def write_base(directory: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({n: torch.ones(s, dtype=dtype) for n, s in SHAPES.items()}, str(directory / "model.safetensors"))
    return directory


def write_stage(root: Path, name: str, checkpoint: Path, base: Path) -> Path:
    """The manifest of a stage: beside its checkpoint (a missing one is named from a stage directory)."""
    if checkpoint.is_dir():
        directory, target = checkpoint, "."
    else:
        directory, target = root / f"stage_{name}", checkpoint.name
    write_manifest(
        StageManifest(
            stage=name,
            base_model=str(base),
            base_fingerprint=fingerprint_checkpoint(base),
            checkpoint=target,
            kind="lora" if (checkpoint / "adapter_config.json").is_file() else "full",
            files=describe_files(checkpoint) if checkpoint.is_dir() else None,
            save_dtype="bfloat16",
        ),
        directory,
    )
    return directory


def write_lora_prior(directory: Path) -> Path:
    """A LoRA adapter on q_proj with delta ``B @ A = [[L, L], [0, 0]]``."""
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"]})
    )
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{prefix}.lora_A.weight": torch.tensor([[1.0, 1.0]]), f"{prefix}.lora_B.weight": torch.tensor([[L], [0.0]])},
        str(directory / "adapter_model.safetensors"),
    )
    return directory


def write_full_prior(directory: Path) -> Path:
    """A full bf16 agent active on embed_tokens[0], q_proj[0] and up_proj[0]."""
    directory.mkdir(parents=True)
    tensors = {n: torch.ones(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        tensors[name].view(-1)[0] += L
    tensors["model.layers.1.mlp.up_proj.weight"].view(-1)[0] -= L
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def random_model(seed: int = 0) -> nn.Module:
    """A decoder-shaped module of a few thousand random weights (more than one chunk per parameter in the tests)."""
    torch.manual_seed(seed)
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(100, 32)
    model.model.layers = nn.ModuleList([nn.Module()])
    model.model.layers[0].mlp = nn.Module()
    model.model.layers[0].mlp.up_proj = nn.Linear(32, 48, bias=False)
    model.model.norm = Norm()
    return model


def random_training(model: nn.Module, case: str) -> nn.Module:
    """Dense noise of mixed magnitudes around eps = 1e-5, some unchanged elements, and per ``case``: NaN and inf
    (``nonfinite``) or a subnormal task vector element in bin 0 of the magnitude histogram (``subnormal``)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g) * 10.0 ** torch.randint(-7, -3, p.shape, generator=g)
            p.add_(torch.where(torch.rand(p.shape, generator=g) < 0.2, 0.0, noise))
        weight = model.model.layers[0].mlp.up_proj.weight
        if case == "nonfinite":
            weight[3, 5], weight[40, 1] = math.nan, math.inf
        if case == "subnormal":
            weight[3, 5] = 1e-42  # over a base element of 0
    return model


def peft_model(**config) -> nn.Module:
    """:func:`tiny_model` with a LoRA adapter on ``q_proj`` (rank 1) and ``lm_head`` in modules_to_save; ``config``
    changes the ``LoraConfig`` (skips the test without peft)."""
    import pytest

    peft = pytest.importorskip("peft")
    settings = dict(r=1, lora_alpha=1, target_modules=["q_proj"], modules_to_save=["lm_head"])
    settings.update(config)
    return peft.get_peft_model(tiny_model(), peft.LoraConfig(**settings))
