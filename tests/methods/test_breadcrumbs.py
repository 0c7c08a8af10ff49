"""Model Breadcrumbs: hand-computed cuts (outliers and small magnitudes), ties, rescale, and the engine streaming
breadcrumbs and breadcrumbs_ties in row chunks."""

from __future__ import annotations

import pytest
import torch

import ram_trl
from ram_trl.methods import ChunkInputs, resolve_method
from ram_trl.methods.breadcrumbs import floor_count, outlier_cut, trim
from tests.helpers import config_for, load_checkpoint, make_checkpoints


def _cut(tau: list[float], density: float, gamma: float, rescale: bool = False) -> list[float]:
    delta = torch.tensor(tau)
    cut = outlier_cut(delta.abs(), density, gamma, rescale)
    out, _, _ = trim(delta, cut.keep, cut.drop, 0, 0)
    if cut.scale is not None:
        out.mul_(cut.scale)
    return out.tolist()


def test_floor_count_exact_decimal():
    assert [floor_count(100, 0.29), floor_count(16, 0.01), floor_count(10, 1.0), floor_count(10, 0.0)] == [
        29,
        0,
        10,
        0,
    ]


def test_drops_outliers_and_small_magnitudes():
    # n = 10, density 0.5: k = 5; gamma 0.2: the 2 largest (0.9, 0.8) go, the next 5 stay, the 3 smallest go
    tau = [0.1, -0.5, 0.3, -0.9, 0.2, 0.7, -0.4, 0.05, 0.6, -0.8]
    expected = [0.0, -0.5, 0.3, 0.0, 0.0, 0.7, -0.4, 0.0, 0.6, 0.0]
    assert _cut(tau, 0.5, 0.2) == pytest.approx(expected)
    # gamma 0: plain magnitude trimming (TIES' cut)
    assert _cut(tau, 0.3, 0.0) == pytest.approx([0, 0, 0, -0.9, 0, 0.7, 0, 0, 0, -0.8])


def test_fewer_outliers_when_density_needs_them():
    # density 0.8 keeps 8 of 10: gamma 0.5 would drop 5 outliers, only the 2 largest can go
    tau = [float(i) for i in range(1, 11)]
    assert _cut(tau, 0.8, 0.5) == [float(i) for i in range(1, 9)] + [0.0, 0.0]


def test_ties_ranked_lowest_flat_index_first():
    # four equal magnitudes, k = 2, top = 1: the first is the outlier, the next two are kept
    assert _cut([0.5, -0.5, 0.5, -0.5], 0.5, 0.25) == [0.0, -0.5, 0.5, 0.0]


def test_l1_rescale():
    # kept {2, 3} of |tau| summing to 10: times 10 / 5
    assert _cut([1.0, 2.0, 3.0, 4.0], 0.5, 0.25, rescale=True) == [0.0, 4.0, 6.0, 0.0]


def _inputs(method: str, tau: list[list[float]], density: float, gamma: float, weights: list[float]) -> ChunkInputs:
    meth, _ = resolve_method(method)
    deltas = torch.tensor(tau)
    params = {p.name: p.default for p in meth.parameters if p.scope == "global"}
    prepared = [outlier_cut(row.abs(), density, gamma, False) for row in deltas]
    agent = {"weight": torch.tensor(weights), "density": torch.full((2,), density), "gamma": torch.full((2,), gamma)}
    return ChunkInputs("t", 0, deltas, torch.zeros(deltas.shape[1]), params, agent, prepared=prepared, seen=[0] * 4)


def test_kernels_on_hand_computed_inputs():
    tau = [[4.0, -1.0, 2.0, -3.0], [-2.0, 5.0, 1.0, -0.5]]
    # density 0.5, gamma 0.25 (k = 2, one outlier): agent 0 drops 4, keeps -3 and 2; agent 1 drops 5, keeps -2, 1
    breadcrumbs = resolve_method("breadcrumbs")[0].merge(_inputs("breadcrumbs", tau, 0.5, 0.25, [1.0, 0.5]))
    assert breadcrumbs.tolist() == [-1.0, 0.0, 2.5, -3.0]  # 0 + 0.5*-2, 0, 2 + 0.5*1, -3
    ties = resolve_method("breadcrumbs_ties")[0].merge(_inputs("breadcrumbs_ties", tau, 0.5, 0.25, [1.0, 0.5]))
    # weighted kept: [0, 0, 2, -3] and [-1, 0, 0.5, 0]; elected signs -, +, +, -: sums -1, 0, 2.5, -3
    assert ties.tolist() == [-1.0, 0.0, 2.5, -3.0]


def test_kernel_needs_its_preparation():
    inputs = _inputs("breadcrumbs", [[1.0], [2.0]], 1.0, 0.0, [1.0, 1.0])
    inputs.prepared = None
    with pytest.raises(RuntimeError, match="cuts"):
        resolve_method("breadcrumbs")[0].merge(inputs)


def _reference(tau: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """mergekit's magnitude_outliers on a tensor without magnitude ties: a sort, then a slice of ranks."""
    n = tau.numel()
    k, top = int(density * n), int(gamma * n)
    bottom = max(0, n - k - top)
    mask = torch.zeros(n)
    mask[torch.sort(tau.abs().reshape(-1)).indices[bottom : bottom + k]] = 1
    return tau * mask.reshape(tau.shape)


@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs_ties"])
def test_engine_streams_in_row_chunks(tmp_path, method):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=2, fraction=0.6)
    config = config_for(ckpts, method, agent_parameters={"density": 0.25, "gamma": 0.125, "weight": 0.5})
    whole, chunked = tmp_path / "whole", tmp_path / "chunked"
    ram_trl.merge(config, whole, progress=False)
    ram_trl.merge(config, chunked, progress=False, chunk_budget=512)
    a, b = load_checkpoint(whole), load_checkpoint(chunked)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    if method == "breadcrumbs":  # against a sort-based reference of the whole tensors
        for name, base in ckpts.base_tensors.items():
            taus = [agent[name] - base for agent in ckpts.agent_tensors]
            expected = base + sum(0.5 * _reference(t, 0.25, 0.125) for t in taus)
            torch.testing.assert_close(a[name], expected, rtol=0, atol=1e-6, msg=name)
