"""SLERP: hand-computed coefficients, and the engine streaming it (weights in, weights out, t per tensor)."""

from __future__ import annotations

import math

import pytest
import torch

import ram_trl
from ram_trl.errors import ConfigError
from ram_trl.methods import ChunkInputs, resolve_method
from ram_trl.methods.slerp import slerp_coefficients
from tests.helpers import EMBED, UP, config_for, load_checkpoint, make_checkpoints


def _slerp(a: list[float], b: list[float], t: float) -> list[float]:
    a_, b_ = torch.tensor(a), torch.tensor(b)
    c_a, c_b = slerp_coefficients(a_, b_, t)
    return (c_a * a_ + c_b * b_).reshape(-1).tolist()


def test_quarter_circle():
    # a ⟂ b, theta = pi/2: c_a = sin((1 - t) pi/2), c_b = sin(t pi/2)
    assert _slerp([1.0, 0.0], [0.0, 1.0], 0.5) == pytest.approx([math.sqrt(0.5)] * 2, abs=1e-7)
    assert _slerp([1.0, 0.0], [0.0, 1.0], 1 / 3) == pytest.approx([math.sqrt(3) / 2, 0.5], abs=1e-7)


def test_norms_are_not_interpolated():
    # the angle comes from the normalised tensors, the coefficients apply to the tensors as they are
    assert _slerp([3.0, 0.0], [0.0, 2.0], 0.5) == pytest.approx([3 * math.sqrt(0.5), 2 * math.sqrt(0.5)], abs=1e-6)


def test_parallel_and_antiparallel_are_linear():
    # |cos theta| > 0.9995: (1 - t) a + t b
    assert _slerp([1.0, 2.0], [2.0, 4.0], 0.25) == [1.25, 2.5]
    assert _slerp([1.0, 2.0], [-1.0, -2.0], 0.25) == [0.5, 1.0]


def test_ends_are_the_models_exactly():
    a, b = [0.3, -1.7, 2.5], [1.1, 0.4, -0.6]
    assert _slerp(a, b, 0.0) == torch.tensor(a).tolist()
    assert _slerp(a, b, 1.0) == torch.tensor(b).tolist()


def test_zero_tensor_is_not_normalised():
    # a zero norm counts as 1 (mergekit's eps): the dot is 0, theta = pi/2
    assert _slerp([0.0, 0.0], [0.0, 2.0], 0.5) == pytest.approx([0.0, 2 * math.sqrt(0.5)], abs=1e-7)


def test_kernel_needs_its_preparation():
    method, _ = resolve_method("slerp")
    inputs = ChunkInputs("t", 0, torch.zeros(1, 2), torch.zeros(2), {"t": 0.5}, {})
    with pytest.raises(RuntimeError, match="coefficients"):
        method.merge(inputs)


@pytest.mark.parametrize("chunk_budget", ["256MB", 2048])
def test_engine_streams_slerp_with_t_per_tensor(tmp_path, chunk_budget):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=1, fraction=0.5)
    t = [{"filter": "embed", "value": 0.0}, {"filter": "up_proj.weight", "value": 1.0}, {"value": 0.3}]
    config = config_for(ckpts, "slerp", parameters={"t": t})
    out = tmp_path / "out"
    ram_trl.merge(config, out, progress=False, chunk_budget=chunk_budget)
    merged = load_checkpoint(out)
    base, agent = ckpts.base_tensors, ckpts.agent_tensors[0]
    assert torch.equal(merged[EMBED], base[EMBED])  # t = 0: the base
    assert torch.equal(merged[UP], agent[UP])  # t = 1: the other model
    for name in merged:
        if name in (EMBED, UP):
            continue
        c_a, c_b = slerp_coefficients(base[name].reshape(-1), agent[name].reshape(-1), 0.3)
        expected = (c_a * base[name].reshape(-1) + c_b * agent[name].reshape(-1)).reshape(base[name].shape)
        assert torch.equal(merged[name], expected), name
        assert not torch.equal(merged[name], base[name]) and not torch.equal(merged[name], agent[name])


def test_slerp_takes_exactly_one_model_besides_the_base(tmp_path):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=2)
    with pytest.raises(ConfigError, match="slerp merges exactly 1 model"):
        ram_trl.merge(config_for(ckpts, "slerp"), tmp_path / "out", progress=False)
    # mergekit's form, the base listed in models, is one model besides the base
    config = config_for(ckpts, "slerp", agents=[ckpts.base, ckpts.agents[0]], parameters={"t": 0.5})
    report = ram_trl.merge(config, tmp_path / "out", progress=False)
    assert [a["name"] for a in report["agents"]] == ["agent0"]


def test_t_rules_and_range_are_checked(tmp_path):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=1)
    with pytest.raises(ConfigError, match="'t'"):
        ram_trl.merge(config_for(ckpts, "slerp", parameters={"t": 1.5}), tmp_path / "a", progress=False)
    with pytest.raises(ConfigError, match="'t' gradient: parameter 't' must be <= 1.0"):
        ram_trl.merge(config_for(ckpts, "slerp", parameters={"t": [0.0, 1.5]}), tmp_path / "b", progress=False)
