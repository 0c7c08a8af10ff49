"""ram_trl/callbacks/telemetry/layout.py: what a model's process measures (regions of plain and PEFT models, the LoRA delta of
a live adapter, this process's share of the regions, where the chunks compute)."""

from __future__ import annotations

import pytest
import torch

from ram_trl.callbacks.telemetry import ModelBase
from ram_trl.callbacks.telemetry.layout import (
    LoraFactorsRef,
    Region,
    check_layout,
    compute_device,
    local_regions,
    model_layout,
)
from ram_trl.callbacks.telemetry.shards import LocalShard
from ram_trl.distributed import DistContext
from ram_trl.errors import CheckpointError, ConfigError
from tests.callbacks.telemetry.helpers import SHAPES, peft_model, tiny_model


def test_a_plain_model_is_one_dense_region_per_parameter():
    layout = model_layout(tiny_model())
    assert not layout.peft and layout.frozen_base is None
    assert [(r.name, r.kind, r.shard.numel) for r in layout.regions] == [
        (name, "dense", torch.Size(shape).numel()) for name, shape in SHAPES.items()
    ]


def test_layout_regions_of_a_peft_model():
    layout = model_layout(peft_model())
    kinds = {r.name: r.kind for r in layout.regions}
    assert kinds == {
        "model.embed_tokens.weight": "frozen",
        "model.layers.0.self_attn.q_proj.weight": "lora",
        "model.layers.1.mlp.up_proj.weight": "frozen",
        "model.norm.weight": "frozen",
        "lm_head.weight": "dense",
    }
    assert layout.peft and layout.frozen_base is not None
    assert set(layout.frozen_base.names()) >= set(kinds)  # the frozen base covers every region, lm_head included


def test_peft_layouts_that_are_refused():
    with pytest.raises(ConfigError, match="DoRA"):
        model_layout(peft_model(use_dora=True))
    model = peft_model()
    model.base_model.model.model.layers[1].mlp.up_proj.weight.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"up_proj.weight' is trained but is neither a LoRA factor"):
        model_layout(model)
    peft = pytest.importorskip("peft")
    ia3 = peft.get_peft_model(tiny_model(), peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]))
    with pytest.raises(ConfigError, match="supports LoRA adapters"):
        model_layout(ia3)


@pytest.mark.parametrize("layout", ["linear", "transposed"])
def test_lora_delta_rows_are_rows_of_b_at_a_times_scaling(layout):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, generator=g), torch.randn(4, 2, generator=g)  # delta (4, 5): B @ A
    if layout == "transposed":  # an embedding's factors: delta (5, 4) = (B @ A)^T
        a, b = b.T.contiguous(), a.T.contiguous()
    ref = LoraFactorsRef("m", a, b, 0.5, layout)
    full = (b @ a).T * 0.5 if layout == "transposed" else (b @ a) * 0.5
    torch.testing.assert_close(ref.delta_rows(1, 3), full[1:3], rtol=1e-6, atol=1e-7)
    rounded = LoraFactorsRef("m", a.bfloat16().float(), b.bfloat16().float(), 0.5, layout).delta_rows(0, 4)
    assert torch.equal(ref.delta_rows(0, 4, torch.bfloat16), rounded)  # factors rounded before the product
    assert not torch.equal(rounded, ref.delta_rows(0, 4))


def _region(name: str, partitioned: bool, device: str = "cpu") -> Region:
    values = torch.zeros(4, device=device)
    return Region(name, LocalShard(name, values, (4,), 0, partitioned), "dense")


def test_partitioned_regions_stay_and_replicated_ones_are_dealt_out():
    layout = model_layout(tiny_model())
    layout.regions = [_region(f"r{i}", partitioned=i in (1, 4)) for i in range(6)]
    assert local_regions(layout, DistContext()) == layout.regions  # one process measures everything
    shares = [[r.name for r in local_regions(layout, DistContext(rank=rank, world_size=2))] for rank in range(2)]
    assert shares == [["r0", "r1", "r3", "r4"], ["r1", "r2", "r4", "r5"]]  # replicated: r0 r2 r3 r5, dealt in turn


def test_the_chunks_compute_where_a_region_lives():
    assert compute_device([_region("a", False), _region("b", False)]) == torch.device("cpu")
    assert compute_device([]) == torch.device("cpu")
    assert compute_device([_region("a", False), _region("b", False, "meta")]) == torch.device("meta")


def test_the_layout_is_checked_against_the_base():
    base = ModelBase.from_model(tiny_model(), "reference model")
    check_layout(base, model_layout(tiny_model()))
    model = tiny_model()
    model.extra = torch.nn.Linear(2, 2, bias=False)
    with pytest.raises(CheckpointError, match=r"^reference model: has no tensor 'extra.weight' for the trained"):
        check_layout(base, model_layout(model))
    model = tiny_model()
    model.lm_head = torch.nn.Linear(2, 4, bias=False)
    with pytest.raises(CheckpointError, match=r"tensor 'lm_head.weight' has shape \[3, 2\], the trained .* \[4, 2\]"):
        check_layout(base, model_layout(model))
    layout = model_layout(peft_model())
    check_layout(layout.frozen_base, layout)
    lora = next(r for r in layout.regions if r.kind == "lora")
    assert lora.lora is not None
    wrong = LoraFactorsRef(lora.lora.module, lora.lora.a, torch.zeros(3, 1), 1.0, "linear")  # a (3, 2) delta
    layout.regions = [Region(lora.name, lora.shard, "lora", wrong)]
    with pytest.raises(ConfigError, match=r"factors give a delta of shape \[3, 2\], its base weight has \[2, 2\]"):
        check_layout(layout.frozen_base, layout)
