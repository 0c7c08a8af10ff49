"""Golden values for the overlap statistics: shares, element counts, union, Jaccard, sums of parts."""

from __future__ import annotations

import pytest
import torch

from ram_trl.statistics.counting import active_mask
from ram_trl.statistics.overlap import OverlapStatistics
from tests.helpers import TAUS

# TAUS: the seven elements of tests/methods/test_ram.py with dyadic values: e0 no agent; e1 agent 0; e2 agents 0, 1;
# e3 all three; e4 agent 0 at exactly eps (inactive); e5 agent 1 (2e-5); e6 agent 0.


def _stats(taus: torch.Tensor = TAUS, eps: float = 1e-5) -> OverlapStatistics:
    stats = OverlapStatistics.zeros(taus.shape[0])
    stats.update(active_mask(taus, eps))
    return stats


# ---------------------------------------------------------------------------------------------------------------
# Overlap summaries


def test_overlap_shares_element_counts_union_and_jaccard():
    stats = _stats()
    # agent 0: e1, e6 unique; e2 with one other; e3 with two others
    assert stats.overlap_shares(0) == [0.5, 0.25, 0.25]
    assert stats.overlap_shares(1) == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    assert stats.overlap_shares(2) == [0.0, 0.0, 1.0]
    assert stats.element_counts() == [2, 3, 1, 1]  # e0, e4 | e1, e5, e6 | e2 | e3
    assert stats.union() == 5
    expected = [[1.0, 2 / 5, 1 / 4], [2 / 5, 1.0, 1 / 3], [1 / 4, 1 / 3, 1.0]]
    assert torch.allclose(torch.tensor(stats.jaccard_matrix()), torch.tensor(expected))


def test_exact_threshold_counts_every_changed_value():
    stats = _stats(eps=0.0)
    assert [stats.active(t) for t in range(3)] == [5, 3, 1]
    assert stats.element_counts() == [1, 4, 1, 1]


def test_agent_without_active_elements_has_zero_shares():
    stats = _stats(torch.zeros(2, 4))
    assert stats.overlap_shares(0) == [0.0, 0.0]
    assert stats.element_counts() == [4, 0, 0]
    assert stats.jaccard_matrix() == [[0.0, 0.0], [0.0, 0.0]]


def test_sum_of_parts_equals_whole_and_leaves_parts_unchanged():
    first, second = _stats(TAUS[:, :4]), _stats(TAUS[:, 4:])
    before = first.histogram.clone()
    total = first + second
    whole = _stats()
    assert torch.equal(total.histogram, whole.histogram)
    assert torch.equal(total.pairwise, whole.pairwise)
    assert total.numel == 7
    assert torch.equal(first.histogram, before)


def test_subset_encoding_equals_direct_counts(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    mask = torch.rand(5, 4000, generator=generator) < torch.tensor([[0.05], [0.3], [0.5], [0.7], [0.9]])
    fast = OverlapStatistics.zeros(5)
    fast.update(mask)
    monkeypatch.setattr("ram_trl.statistics.overlap.MAX_SUBSET_AGENTS", 0)
    slow = OverlapStatistics.zeros(5)
    slow.update(mask)
    assert torch.equal(fast.histogram, slow.histogram)
    assert torch.equal(fast.pairwise, slow.pairwise)
    counts = mask.sum(0)
    for t in range(5):
        for k in range(1, 6):
            assert fast.histogram[t, k] == int((mask[t] & (counts == k)).sum())
        for s in range(5):
            assert fast.pairwise[s, t] == int((mask[s] & mask[t]).sum())
    assert fast.jaccard(1, 2) == pytest.approx(int((mask[1] & mask[2]).sum()) / int((mask[1] | mask[2]).sum()))


@pytest.mark.parametrize("num_agents", [3, 20])  # the subset path, and the bincount path beyond 12 agents
def test_the_merge_counts_no_pairs_and_the_same_histogram(num_agents):
    mask = torch.rand(num_agents, 500, generator=torch.Generator().manual_seed(1)) < 0.3
    full = OverlapStatistics.zeros(num_agents)
    full.update(mask)
    merge = OverlapStatistics.zeros(num_agents, pairwise=False)  # the merge's: no N x N work
    merge.update(mask)
    merge.add(merge + merge)
    assert merge.pairwise.numel() == 0 and not merge.counts_pairs and full.counts_pairs
    assert torch.equal(merge.histogram, 3 * full.histogram) and merge.numel == 3 * 500
    assert int(full.pairwise[0, 1]) == int((mask[0] & mask[1]).sum())
    assert [merge.as_dict(t) for t in range(num_agents)] == [
        (full + full + full).as_dict(t) for t in range(num_agents)
    ]


def test_a_merge_holds_no_pairwise_counts(tmp_path):
    import ram_trl
    from ram_trl.merging import report
    from tests.helpers import config_for, make_checkpoints

    seen = []
    original = report.build_report

    def spy(resolved, plan, state, *args):
        seen.append(state.stats.pairwise.numel())
        return original(resolved, plan, state, *args)

    ckpts = make_checkpoints(tmp_path, num_agents=3)
    for method in ("task_arithmetic", "ram_plus"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(report, "build_report", spy)
            ram_trl.merge(config_for(ckpts, method), tmp_path / method, progress=False)
    assert seen == [0, 0]


@pytest.mark.parametrize("num_agents", [3, 20])
def test_the_merges_summary_counts_active_unique_and_shared_alone_beyond_12_agents(num_agents):
    """Beyond 12 agents the merge keeps three bins per agent (none, unique, shared), not N + 1: N x 3 counts."""
    mask = torch.rand(num_agents, 500, generator=torch.Generator().manual_seed(2)) < 0.3
    full = OverlapStatistics.zeros(num_agents)
    full.update(mask)
    summary = OverlapStatistics.summary(num_agents)
    summary.update(mask[:, :200])
    summary.add(OverlapStatistics.summary(num_agents) + full)  # a whole histogram added is binned
    part = OverlapStatistics.summary(num_agents)
    part.update(mask[:, 200:])
    summary.add(part)
    counts = mask.sum(0)
    for t in range(num_agents):
        unique, active = int((mask[t] & (counts == 1)).sum()), int(mask[t].sum())
        assert (summary.unique(t), summary.shared(t)) == (2 * unique, 2 * (active - unique))
        assert summary.rho(t) == full.rho(t) and summary.density(t) == full.density(t)
    if num_agents <= 12:  # the subset path: the whole histogram comes free
        assert torch.equal(summary.histogram, 2 * full.histogram)
    else:
        assert summary.histogram.shape == (num_agents, 3) and summary.as_dict(0)["overlap_histogram"] is None
        assert {k: v for k, v in summary.as_dict(0).items() if k != "overlap_histogram"} == {
            k: v for k, v in (full + full).as_dict(0).items() if k != "overlap_histogram"
        }
        with pytest.raises(ValueError, match="no whole overlap histogram"):
            summary.element_counts()


def test_a_merge_of_many_agents_counts_linear_statistics(tmp_path):
    """13 agents: the merge's counts are N x 3 (the overlap histogram is left out of the report), and RAM+'s
    unique / shared counts and lambdas are those of the whole histogram."""
    import ram_trl
    from ram_trl.merging import report
    from tests.helpers import config_for, make_checkpoints

    shapes = []
    original = report.build_report

    def spy(resolved, plan, state, *args):
        shapes.append(tuple(state.stats.histogram.shape))
        return original(resolved, plan, state, *args)

    ckpts = make_checkpoints(tmp_path, num_agents=13, fraction=0.3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report, "build_report", spy)
        merged = ram_trl.merge(config_for(ckpts, "ram_plus"), tmp_path / "out", progress=False)
    assert shapes == [(13, 3)]
    full = OverlapStatistics.zeros(13)
    for name, base in ckpts.base_tensors.items():
        if base.is_floating_point():
            taus = torch.stack([agent[name].float() - base.float() for agent in ckpts.agent_tensors])
            full.update(active_mask(taus.reshape(13, -1), 1e-5))
    for t, agent in enumerate(merged["agents"]):
        assert (agent["unique"], agent["shared"]) == (full.unique(t), full.shared(t))
        lambdas = full.lambdas(merged["parameters"]["r"], merged["parameters"]["alpha"])
        assert agent["overlap_histogram"] is None and agent["lambda"] == lambdas[t]
