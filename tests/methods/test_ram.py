"""Hand-computed golden cases for RAM, RAM+ and RAM+s (Algorithm 1 and appendix E of the RAM paper)."""

from __future__ import annotations

import math

import pytest
import torch

from ram_trl.errors import ConfigError
from ram_trl.methods.base import ChunkInputs
from ram_trl.methods.ram import check_agent, merge_plain, merge_unique, merge_unscaled, ram_merge
from ram_trl.statistics import OverlapStatistics
from ram_trl.statistics.counting import active_mask, float32_threshold, overlap_counts

F = torch.float32

# Seven elements, three agents. Per element: e0 no agent; e1 only agent 0; e2 agents 0 and 1; e3 all three;
# e4 agent 0 at exactly eps (inactive: the threshold is strict); e5 only agent 1 (2e-5 > eps); e6 only agent 0.
TAUS = torch.tensor(
    [[0.0, 0.5, 0.2, 0.3, 1e-5, 0.0, 0.1], [0.0, 0.0, 0.4, -0.3, 0.0, 2e-5, 0.0], [0.0, 0.0, 0.0, 0.6, 0.0, 0.0, 0.0]],
    dtype=F,
)


def test_mask_is_strict_and_counts_agents():
    mask = active_mask(TAUS, 1e-5)
    assert mask[0].tolist() == [False, True, True, True, False, False, True]
    assert overlap_counts(mask).tolist() == [0, 1, 2, 3, 0, 1, 1]


def test_statistics_histogram():
    stats = OverlapStatistics.zeros(3)
    stats.update(active_mask(TAUS, 1e-5))
    # agent 0: e1, e6 unique; e2 (c=2), e3 (c=3) shared
    assert stats.histogram.tolist() == [[0, 2, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1]]
    assert [stats.unique(t) for t in range(3)] == [2, 1, 0]
    assert [stats.shared(t) for t in range(3)] == [2, 2, 1]
    assert [stats.active(t) for t in range(3)] == [4, 3, 1]
    assert stats.numel == 7
    assert stats.density(0) == pytest.approx(4 / 7)
    assert [stats.rho(t) for t in range(3)] == [1.0, 2.0, math.inf]


def test_threshold_is_exact_when_eps_rounds_up_in_float32():
    # float32(0.1) = 0.100000001490116... > 0.1: that element IS active at eps = 0.1, although it is not greater
    # than float32(0.1), which a naive float32 comparison would use.
    x = torch.tensor([[0.1, -0.1, 0.099999994]], dtype=F)
    assert float32_threshold(0.1) < 0.1
    assert active_mask(x, 0.1).tolist() == [[True, True, False]]
    assert ram_merge(x.clone(), [1.0], 0.1).tolist() == pytest.approx([0.1, -0.1, 0.0])


def test_statistics_accumulate_over_chunks_like_one_pass():
    whole = OverlapStatistics.zeros(3)
    whole.update(active_mask(TAUS, 1e-5))
    parts = OverlapStatistics.zeros(3)
    for chunk in (TAUS[:, :3], TAUS[:, 3:5], TAUS[:, 5:]):
        parts.update(active_mask(chunk, 1e-5))
    assert torch.equal(whole.histogram, parts.histogram)
    assert whole.numel == parts.numel


def _expected(lambdas):
    t = TAUS
    expected = torch.zeros(7, dtype=F)
    expected[1] = torch.tensor(lambdas[0], dtype=F) * t[0, 1]  # c = 1 (agent 0)
    expected[2] = (t[0, 2] + t[1, 2]) / 2  # c = 2: mean
    expected[3] = (t[0, 3] + t[1, 3] + t[2, 3]) / 3  # c = 3: mean
    expected[5] = torch.tensor(lambdas[1], dtype=F) * t[1, 5]  # c = 1 (agent 1)
    expected[6] = torch.tensor(lambdas[0], dtype=F) * t[0, 6]
    return expected  # e0 (c = 0) and e4 (|tau| == eps) stay 0


@pytest.mark.parametrize(
    "lambdas",
    [
        [1.0, 1.0, 1.0],  # RAM
        [1.1, 1.15, 1.15],  # RAM+ r=0.1 alpha=1.5: rho = 1, 2 (clipped), inf (clipped)
        [1.05, 1 + 0.1 * 2 / 3, 1.1],  # RAM+s r=0.1
    ],
)
def test_ram_merge_every_branch(lambdas):
    merged = ram_merge(TAUS.clone(), lambdas, 1e-5)
    assert torch.equal(merged, _expected(lambdas))
    # spot-check the hand values
    assert merged[0] == 0 and merged[4] == 0
    assert merged[2].item() == pytest.approx(0.3)
    assert merged[3].item() == pytest.approx(0.2)
    assert merged[1].item() == pytest.approx(0.5 * lambdas[0])


def test_ram_merge_single_agent_keeps_its_vector_scaled():
    tau = torch.tensor([[0.0, 0.3, -2e-5, 1e-6]], dtype=F)
    merged = ram_merge(tau.clone(), [1.2], 1e-5)
    assert torch.equal(merged, torch.tensor([0.0, 0.3 * 1.2, -2e-5 * 1.2, 0.0], dtype=F))


def test_lambdas_from_statistics():
    stats = OverlapStatistics.zeros(3)
    stats.update(active_mask(TAUS, 1e-5))
    assert stats.lambdas(0.1, 1.5) == pytest.approx([1.1, 1.15, 1.15])
    assert stats.lambdas(0.1, None, soft=True) == pytest.approx([1.05, 1 + 0.1 * 2 / 3, 1.1])


def _eq7(taus: torch.Tensor, lambdas: list[float], eps: float) -> torch.Tensor:
    """Eq. 7 element by element, in plain Python loops over float32 scalars."""
    out = torch.zeros(taus.shape[1], dtype=F)
    for i in range(taus.shape[1]):
        active = [t for t in range(taus.shape[0]) if abs(float(taus[t, i])) > eps]
        if len(active) == 1:
            out[i] = torch.tensor(lambdas[active[0]], dtype=F) * taus[active[0], i]
        elif len(active) >= 2:
            total = torch.tensor(0.0, dtype=F)
            for t in active:
                total = total + taus[t, i]
            out[i] = total / len(active)
    return out


@pytest.mark.parametrize("num_agents", [2, 5, 13, 40])
def test_ram_merge_matches_elementwise_eq7(num_agents, monkeypatch):
    generator = torch.Generator().manual_seed(num_agents)
    density = torch.linspace(0.05, 0.6, num_agents).unsqueeze(1)
    taus = torch.randn(num_agents, 300, generator=generator) * (
        torch.rand(num_agents, 300, generator=generator) < density
    )
    lambdas = [1.0 + 0.05 * t for t in range(num_agents)]
    expected = _eq7(taus, lambdas, 1e-5)
    assert torch.equal(ram_merge(taus.clone(), lambdas, 1e-5), expected)
    # factors whose excess over 1 is not exact in float32 take the torch.where path
    monkeypatch.setattr("ram_trl.methods.ram._unique_excess", lambda factors, device: None)
    assert torch.equal(ram_merge(taus.clone(), lambdas, 1e-5), expected)


def test_ram_merge_factors_below_one_take_the_exact_path():
    # float32(0.1) - 1 rounds, so 1 + (0.1 - 1) != 0.1: the where path must give lambda * tau exactly
    taus = torch.tensor([[0.3, 0.0, 0.2, 1e-3], [0.0, -0.7, 0.4, 0.0]], dtype=F)
    lambdas = [0.1, 0.3]
    assert torch.equal(ram_merge(taus.clone(), lambdas, 1e-5), _eq7(taus, lambdas, 1e-5))


def test_ram_merge_large_factors_stay_exact():
    generator = torch.Generator().manual_seed(7)
    taus = torch.randn(3, 500, generator=generator) * (torch.rand(3, 500, generator=generator) < 0.4)
    lambdas = [1.0, 3.7, 1234.567]
    assert torch.equal(ram_merge(taus.clone(), lambdas, 1e-5), _eq7(taus, lambdas, 1e-5))


# ---------------------------------------------------------------------------------------------------------------
# The mechanism merges: RAM with its unique region scaled, and one agent's unique region alone


def _kernel_inputs(params: dict, names: tuple[str, ...] = ("coder", "tools", "memory")) -> ChunkInputs:
    return ChunkInputs(
        name="w",
        start=0,
        deltas=TAUS.clone(),
        base=torch.zeros(7),
        params={"eps": 1e-5, **params},
        agent_params={},
        agent_names=names,
    )


def test_unique_scale_scales_only_unique_elements():
    merged = merge_plain(_kernel_inputs({"unique_scale": 0.5}))
    t = TAUS
    # e1, e5, e6 unique (halved); e2, e3 the mean of the active values as in RAM; e0, e4 nothing active
    expected = [0.0, 0.25, float((t[0, 2] + t[1, 2]) / 2), float((t[0, 3] + t[1, 3] + t[2, 3]) / 3)]
    expected += [0.0, float(t[1, 5] * 0.5), float(t[0, 6] * 0.5)]
    assert merged.tolist() == pytest.approx(expected, rel=0, abs=0)
    assert torch.equal(merge_plain(_kernel_inputs({})), ram_merge(TAUS.clone(), [1.0] * 3))


def test_unscaled_hook_is_plain_ram_and_absent_at_scale_one():
    assert merge_unscaled(_kernel_inputs({})) is None
    assert torch.equal(merge_unscaled(_kernel_inputs({"unique_scale": 0.5})), ram_merge(TAUS.clone(), [1.0] * 3))


@pytest.mark.parametrize(
    ("agent", "expected"),
    [
        ("coder", [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, float(TAUS[0, 6])]),
        ("1", [0.0, 0.0, 0.0, 0.0, 0.0, float(TAUS[1, 5]), 0.0]),
        ("memory", [0.0] * 7),  # agent 2 is active only on e3, shared by all three
    ],
)
def test_ram_unique_keeps_one_agents_unique_region(agent, expected):
    assert merge_unique(_kernel_inputs({"agent": agent})).tolist() == expected


@pytest.mark.parametrize("agent", ["", "writer", "3"])
def test_ram_unique_refuses_an_agent_it_does_not_merge(agent):
    with pytest.raises(ConfigError, match=r"recipe.yaml: parameters.agent: agent '.*' is not one of the merged"):
        check_agent({"agent": agent}, ["coder", "tools", "memory"], "recipe.yaml")
