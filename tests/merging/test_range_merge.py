"""ram_trl.merging.range_merge: the merge of flat ranges of an in-memory agent equals ``ram-trl merge`` of the saved agent.

The in-memory agent's tensors are cut into flat ranges (as ZeRO-3 partitions them: not on row boundaries, uneven,
some empty) and merged with the other agents read from disk; the merged elements must be the engine's output bit for
bit, for every method that merges element by element (with and without global statistics, per-tensor factors,
random drops, bf16 rounding of the saved agent). The 2-process case runs in tests/callbacks/preview/test_partitions.py (DeepSpeed).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import ram_trl
from ram_trl.distributed import DistContext
from ram_trl.errors import ConfigError, NonFiniteError
from ram_trl.merging.config.resolve import resolve_config
from ram_trl.merging.config.schema import load_config
from ram_trl.merging.range_merge import FlatRange, check_range_method, merge_ranges
from ram_trl.methods.registry import resolve_method
from tests.helpers import (
    config_for,
    load_checkpoint,
    lora_adapter,
    make_checkpoints,
    qwen_model,
    save_base,
    save_checkpoint,
)


def _resolved(config: dict):
    return resolve_config(load_config(config)[0])


def _partitions(tensors: dict[str, torch.Tensor], parts: int, dtype: torch.dtype | None = None) -> list[FlatRange]:
    """Every tensor cut into ``parts`` flat ranges of ``ceil(numel / parts)`` elements (ZeRO-3's partitioning)."""
    ranges = []
    for name, value in tensors.items():
        flat = value.reshape(-1) if dtype is None else value.reshape(-1).to(dtype)
        size = -(-flat.numel() // parts)
        for p in range(parts):
            lo = min(p * size, flat.numel())
            ranges.append(FlatRange(name, lo, flat[lo : lo + size]))
    return ranges


def _assemble(ranges: list[FlatRange], values: list[torch.Tensor], shapes: dict) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r, merged in zip(ranges, values, strict=True):
        if r.name not in out:
            out[r.name] = torch.empty(shapes[r.name].numel(), dtype=merged.dtype)
        out[r.name][r.offset : r.offset + merged.numel()] = merged
    return {n: v.reshape(shapes[n].shape) for n, v in out.items()}


@pytest.mark.parametrize(
    ("method", "parameters"),
    [
        ("ram", {}),
        ("ram_plus", {}),
        ("ram_plus", {"r": 0.3, "alpha": 1.5, "rho_scope": "tensor"}),
        ("ram_plus_soft", {}),
        ("task_arithmetic", {"lambda": 0.7}),
        ("dare_linear", {"density": 0.6}),
        ("dare_ties", {"density": 0.6}),
    ],
)
@pytest.mark.parametrize("parts", [1, 3, 7])
def test_ranges_merge_to_the_engine_output_bit_for_bit(tmp_path, method, parameters, parts):
    ckpts = make_checkpoints(tmp_path, 3, fraction=0.3)
    config = config_for(ckpts, method, parameters=parameters or None, seed=5)
    merged_dir = tmp_path / "merged"
    ram_trl.merge(config, merged_dir, progress=False)
    expected = load_checkpoint(merged_dir)
    report = ram_trl.merge(config, tmp_path / "again", progress=False)

    current = 1
    ranges = _partitions(ckpts.agent_tensors[current], parts)
    result = merge_ranges(_resolved(config), current, ranges, DistContext())
    got = _assemble(ranges, result.values, ckpts.base_tensors)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name].view(torch.int32), value.view(torch.int32)), (method, name)
    if method.startswith("ram_plus") and parameters.get("rho_scope") != "tensor":
        assert result.factors == [a["lambda"] for a in report["agents"]]
        assert result.stats is not None and result.stats.numel == report["total_elements"]
        assert [result.stats.active(t) for t in range(3)] == [a["active"] for a in report["agents"]]
    elif parameters.get("rho_scope") == "tensor":
        assert set(result.tensor_factors) == set(expected)
    else:
        assert result.factors is None


@pytest.mark.filterwarnings("ignore:.*differ from the base")  # a bf16 agent of a float32 base differs everywhere
def test_bf16_saved_agent_is_merged_as_saved(tmp_path):
    """The in-memory float32 agent, given rounded to bfloat16, merges as its bfloat16 checkpoint does."""
    ckpts = make_checkpoints(tmp_path, 2, fraction=0.5)
    g = torch.Generator().manual_seed(3)
    trained = {
        n: v + 1e-3 * torch.randn(v.shape, generator=g) * (torch.rand(v.shape, generator=g) < 0.3)
        for n, v in ckpts.agent_tensors[0].items()
    }
    saved = save_checkpoint(tmp_path / "saved_bf16", {n: v.to(torch.bfloat16) for n, v in trained.items()})
    config = config_for(ckpts, "ram_plus", agents=[saved, ckpts.agents[1]])
    ram_trl.merge(config, tmp_path / "merged", progress=False)
    expected = load_checkpoint(tmp_path / "merged")
    ranges = _partitions(trained, 2, torch.bfloat16)
    result = merge_ranges(_resolved(config), 0, ranges, DistContext())
    got = _assemble(ranges, result.values, ckpts.base_tensors)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_digest_names_the_merged_values(tmp_path):
    ckpts = make_checkpoints(tmp_path, 2)
    resolved = _resolved(config_for(ckpts, "ram_plus"))
    ranges = _partitions(ckpts.agent_tensors[0], 2)
    first = merge_ranges(resolved, 0, ranges, DistContext())
    assert merge_ranges(resolved, 0, ranges, DistContext()).digest == first.digest
    changed = [FlatRange(r.name, r.offset, r.values + (i == 0)) for i, r in enumerate(ranges)]
    assert merge_ranges(resolved, 0, changed, DistContext()).digest != first.digest


def test_small_blocks_give_the_same_values(tmp_path):
    ckpts = make_checkpoints(tmp_path, 2, fraction=0.4)
    resolved = _resolved(config_for(ckpts, "ram_plus"))
    ranges = _partitions(ckpts.agent_tensors[0], 3)
    whole = merge_ranges(resolved, 0, ranges, DistContext())
    small = merge_ranges(resolved, 0, ranges, DistContext(), block_elements=5)
    assert whole.digest == small.digest and whole.factors == small.factors


@pytest.mark.parametrize("method", ["ties", "breadcrumbs", "della", "slerp", "model_stock", "fisher"])
def test_methods_that_need_whole_tensors_are_refused(method):
    with pytest.raises(ConfigError, match=f"merge method '{method}' needs .*ram_plus"):
        check_range_method(resolve_method(method)[0])


def test_uncovered_or_foreign_tensors_are_refused(tmp_path):
    ckpts = make_checkpoints(tmp_path, 2)
    resolved = _resolved(config_for(ckpts, "ram_plus"))
    ranges = _partitions(ckpts.agent_tensors[0], 2)
    with pytest.raises(ConfigError, match="hold .* of its .* elements"):
        merge_ranges(resolved, 0, ranges[1:], DistContext())
    with pytest.raises(ConfigError, match="hold .* of its .* elements"):
        merge_ranges(resolved, 0, [*ranges, ranges[0]], DistContext())
    foreign = [*ranges, FlatRange("extra.weight", 0, torch.zeros(3))]
    with pytest.raises(ConfigError, match="'extra.weight' .* not a floating tensor of the base"):
        merge_ranges(resolved, 0, foreign, DistContext())
    name, value = next(iter(ckpts.agent_tensors[0].items()))
    past = [FlatRange(name, 1, value.reshape(-1))]
    with pytest.raises(ConfigError, match=f"'{name}': the range \\[1, .*\\) is not inside"):
        merge_ranges(resolved, 0, past, DistContext())
    with pytest.raises(ConfigError, match="agent index 2"):
        merge_ranges(resolved, 2, ranges, DistContext())


def test_replicated_ranges_count_once(tmp_path):
    """A range every process holds (``counted=False`` on all but one) is merged but not counted again."""
    ckpts = make_checkpoints(tmp_path, 2, fraction=0.3)
    resolved = _resolved(config_for(ckpts, "ram_plus"))
    ranges = _partitions(ckpts.agent_tensors[0], 1)
    copies = [FlatRange(r.name, r.offset, r.values, counted=False) for r in ranges]
    once = merge_ranges(resolved, 0, ranges, DistContext())
    both = merge_ranges(resolved, 0, ranges + copies, DistContext())
    assert both.factors == once.factors
    assert all(torch.equal(a, b) for a, b in zip(once.values, both.values[: len(ranges)], strict=True))


def test_nonfinite_policy_is_named(tmp_path):
    ckpts = make_checkpoints(tmp_path, 2)
    resolved = _resolved(config_for(ckpts, "ram_plus"))
    ranges = _partitions(ckpts.agent_tensors[1], 2)
    bad = ranges[3].values.clone()
    bad[0] = float("nan")
    ranges[3] = FlatRange(ranges[3].name, ranges[3].offset, bad)
    with pytest.raises(NonFiniteError, match=f"agent 1 .*in-memory policy.*'{ranges[3].name}'"):
        merge_ranges(resolved, 1, ranges, DistContext())


def test_a_lora_prior_and_a_scalar_tensor(tmp_path):
    """A prior agent that is a PEFT LoRA adapter (its delta rows computed from the factors for ranges that start
    mid-row) and a 0-d tensor in the checkpoints merge as the engine merges them."""
    model = qwen_model()
    base_dir = save_base(model, tmp_path / "base")
    lora_adapter(qwen_model(), tmp_path / "adapter", r=4, target_modules=["q_proj", "down_proj"])
    base = load_file(str(base_dir / "model.safetensors"))
    base["scale"] = torch.tensor(0.5)
    save_file(base, str(base_dir / "model.safetensors"), metadata={"format": "pt"})
    g = torch.Generator().manual_seed(4)
    trained = {
        n: v + 1e-3 * torch.randn(v.shape, generator=g) * (torch.rand(v.shape, generator=g) < 0.2)
        for n, v in base.items()
    }
    trained["scale"] = torch.tensor(0.75)
    agent = tmp_path / "agent"
    agent.mkdir()
    save_file(trained, str(agent / "model.safetensors"), metadata={"format": "pt"})
    (agent / "config.json").write_text((base_dir / "config.json").read_text())
    config = {
        "merge_method": "ram_plus",
        "base_model": str(base_dir),
        "models": [{"model": str(tmp_path / "adapter")}, {"model": str(agent)}],
    }
    ram_trl.merge(config, tmp_path / "merged", progress=False)
    expected = load_file(str(tmp_path / "merged" / "model.safetensors"))
    ranges = _partitions(trained, 3)
    result = merge_ranges(_resolved(config), 1, ranges, DistContext(), block_elements=100)
    got = _assemble(ranges, result.values, base)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name].view(torch.int32), value.view(torch.int32)), name


@pytest.mark.parametrize("agents", [3, 13])
def test_ranges_merge_on_the_device_like_on_the_cpu(tmp_path, monkeypatch, agents):
    """merge_ranges(device="cuda"), with the in-memory agent's ranges on the (fake) device: the CPU values, bit for
    bit, returned on the host (13 agents: the overlap statistics' path beyond subset codes)."""
    from tests.fake_cuda import fake_cuda_device

    ckpts = make_checkpoints(tmp_path, agents, fraction=0.4)
    resolved = _resolved(config_for(ckpts, "ram_plus"))
    ranges = _partitions(ckpts.agent_tensors[1], 2)
    expected = merge_ranges(resolved, 1, ranges, DistContext())
    with fake_cuda_device(monkeypatch):
        on_device = [FlatRange(r.name, r.offset, r.values.to("cuda")) for r in ranges]
        got = merge_ranges(resolved, 1, on_device, DistContext(), device="cuda")
        values = [v.cpu() for v in got.values]
    assert got.digest == expected.digest and got.factors == expected.factors
    for value, reference_value in zip(values, expected.values, strict=True):
        assert torch.equal(value.view(torch.int32), reference_value.view(torch.int32))
