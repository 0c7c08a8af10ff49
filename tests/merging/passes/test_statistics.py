"""ram_trl/merging/passes/statistics.py: the statistics pass counts what a brute-force count of the agents' task vectors
finds, whatever the chunking and the compute pool, and the method's factors come from those counts."""

from __future__ import annotations

import pytest
import torch

from ram_trl.io.safetensors_io import RowReader
from ram_trl.merging.passes.statistics import method_factors, progress_bar, statistics_pass
from tests.helpers import make_checkpoints, run_context


def _brute_force(ckpts, eps: float) -> tuple[list[int], list[int]]:
    """Per agent: active elements (``|tau| > eps`` in float32) and unique ones (no other agent active there)."""
    masks = []
    for tensors in ckpts.agent_tensors:
        flags = [(tensors[n].float() - ckpts.base_tensors[n].float()).abs() > eps for n in ckpts.base_tensors]
        masks.append(torch.cat([f.reshape(-1) for f in flags]))
    stacked = torch.stack(masks)
    agents_per_element = stacked.sum(dim=0)
    active = [int(m.sum()) for m in masks]
    unique = [int((m & (agents_per_element == 1)).sum()) for m in masks]
    return active, unique


@pytest.mark.parametrize("chunk_budget", [None, 2048])
def test_statistics_pass_counts_every_agents_active_and_unique_elements(tmp_path, chunk_budget):
    ckpts = make_checkpoints(tmp_path, num_agents=3, fraction=0.4)
    run = run_context(ckpts, "ram_plus", chunk_budget=chunk_budget)
    if chunk_budget is not None:
        assert sum(len(list(t.chunks())) for t in run.tasks) > len(run.tasks)  # several chunks per tensor
    with RowReader() as run.reader:
        statistics_pass(run)
    active, unique = _brute_force(ckpts, run.eps)
    stats = run.state.stats
    assert [stats.active(t) for t in range(3)] == active
    assert [stats.unique(t) for t in range(3)] == unique
    assert [stats.shared(t) for t in range(3)] == [a - u for a, u in zip(active, unique, strict=True)]
    assert run.state.tensor_stats == {}  # global statistics only


def test_tensor_local_statistics_are_kept_per_tensor(tmp_path):
    ckpts = make_checkpoints(tmp_path, num_agents=2, fraction=0.4)
    run = run_context(ckpts, "ram_plus", parameters={"rho_scope": "tensor"})
    with RowReader() as run.reader:
        statistics_pass(run)
    assert set(run.state.tensor_stats) == set(ckpts.base_tensors)
    for t in range(2):
        per_tensor = sum(s.active(t) for s in run.state.tensor_stats.values())
        assert per_tensor == run.state.stats.active(t) > 0


def test_method_factors_are_the_methods_hook_on_the_counts(tmp_path):
    ckpts = make_checkpoints(tmp_path, num_agents=3, fraction=0.4)
    run = run_context(ckpts, "ram_plus", parameters={"r": 0.5, "alpha": 1.5})
    with RowReader() as run.reader:
        statistics_pass(run)
    stats = run.state.stats
    assert method_factors(run, stats) == stats.lambdas(0.5, 1.5)
    assert method_factors(run, stats) != [1.0, 1.0, 1.0]  # the counts reach the factors


def test_progress_bar_only_when_enabled():
    assert progress_bar(3, "statistics", False) is None
    bar = progress_bar(3, "statistics", True)
    assert bar is not None and bar.total == 3
    bar.close()
