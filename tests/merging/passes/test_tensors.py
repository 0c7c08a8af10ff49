"""ram_trl/merging/passes/tensors.py: the per-tensor inputs of the merge pass (per-agent parameters, factors, magnitudes of
whole tensors) on tiny checkpoints."""

from __future__ import annotations

import pytest
import torch

from ram_trl.io.safetensors_io import RowReader
from ram_trl.merging.passes.statistics import method_factors, statistics_pass
from ram_trl.merging.passes.tensors import agent_parameter_values, fill_magnitudes, tensor_context, tensor_factors
from ram_trl.parallel import compute_pool, owned_process
from tests.helpers import DOWN, UP, make_checkpoints, run_context


def test_agent_parameters_follow_the_filter_rules(tmp_path):
    ckpts = make_checkpoints(tmp_path, num_agents=2)
    run = run_context(
        ckpts, "task_arithmetic", agent_parameters={"weight": [{"filter": "up_proj", "value": 0.25}, {"value": 0.75}]}
    )
    up = agent_parameter_values(run.resolved, UP, torch.device("cpu"))
    down = agent_parameter_values(run.resolved, DOWN, torch.device("cpu"))
    assert up["weight"].dtype == torch.float32 and up["weight"].tolist() == [0.25, 0.25]
    assert down["weight"].tolist() == [0.75, 0.75]


def test_factors_are_global_tensor_local_or_none(tmp_path):
    ckpts = make_checkpoints(tmp_path, num_agents=2, fraction=0.4)
    plain = run_context(ckpts, "task_arithmetic")
    assert tensor_factors(plain, plain.tasks[0]) is None
    for scope in ("global", "tensor"):
        run = run_context(ckpts, "ram_plus", parameters={"rho_scope": scope, "r": 0.5})
        with RowReader() as run.reader:
            statistics_pass(run)
        run.state.lambdas = method_factors(run, run.state.stats)
        task = next(t for t in run.tasks if t.name == UP)
        expected = method_factors(run, run.state.tensor_stats[UP]) if scope == "tensor" else run.state.lambdas
        assert tensor_factors(run, task) == expected
        assert tensor_context(run, task).factors == expected
    assert method_factors(run, run.state.tensor_stats[UP]) != run.state.lambdas  # the two scopes differ here


def test_methods_without_statistics_count_while_merging(tmp_path):
    ckpts = make_checkpoints(tmp_path, num_agents=2)
    counting = tensor_context(run_context(ckpts, "task_arithmetic"), run_context(ckpts).tasks[0])
    assert counting.stats is not None and counting.stats.num_agents == 2
    assert counting.prepared is None and not counting.ordered
    run = run_context(ckpts, "ram_plus")
    assert tensor_context(run, run.tasks[0]).stats is None  # counted by the statistics pass


@pytest.mark.parametrize("workers", [1, 2])
def test_fill_magnitudes_is_the_absolute_task_vector_in_any_pool(tmp_path, monkeypatch, workers):
    import ram_trl.statistics.counting

    monkeypatch.setattr(ram_trl.statistics.counting, "HISTOGRAM_BLOCK", 40)  # several blocks per tensor on the pool
    ckpts = make_checkpoints(tmp_path, num_agents=1, fraction=0.5)
    base, agent = ckpts.base_tensors[UP], ckpts.agent_tensors[0][UP]
    out = torch.empty(base.numel())
    with owned_process(), compute_pool(torch.device("cpu"), workers) as pool:
        nonzero = fill_magnitudes(out, agent, None, base.reshape(-1), pool)
    expected = (agent - base).abs().reshape(-1)
    assert torch.equal(out, expected)
    assert nonzero == int(torch.count_nonzero(expected)) > 0
    short = torch.empty(base.numel())  # an agent holding fewer elements than the base: the rest is zero
    fill_magnitudes(short, agent.reshape(-1)[:50], None, base.reshape(-1), None)
    assert torch.equal(short[:50], expected[:50]) and not short[50:].any()
