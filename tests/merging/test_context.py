"""ram_trl/merging/context.py: the run context's helpers (eps, input opening, byte balance, density warnings), on real
tiny safetensors checkpoints."""

from __future__ import annotations

import pytest
import torch

from ram_trl.merging.config.resolve import resolve_config
from ram_trl.merging.config.schema import load_config
from ram_trl.merging.context import (
    DENSE_AGENT_WARNING,
    MergeState,
    check_densities,
    open_inputs,
    run_eps,
    task_input_bytes,
)
from ram_trl.statistics import OverlapStatistics
from tests.helpers import BIAS, DOWN, EMBED, UP, config_for, plan_for


def _resolved(ckpts, method="task_arithmetic", **kwargs):
    return resolve_config(*load_config(config_for(ckpts, method, **kwargs)))


def test_run_eps(ckpts):
    assert run_eps(_resolved(ckpts)) == 1e-5
    assert run_eps(_resolved(ckpts, "ram", parameters={"eps": 1e-3})) == 1e-3


def test_open_inputs_reads_the_headers(ckpts):
    base, agents = open_inputs(_resolved(ckpts), allow_pickle=False)
    assert sorted(base.tensors) == sorted([BIAS, DOWN, EMBED, UP])
    assert len(agents) == 2
    assert all(sorted(a.tensors) == sorted(base.tensors) for a in agents)
    assert base.tensors[UP].shape == (24, 8)
    assert "agent 1" in agents[1].role and str(ckpts.agents[1]) in agents[1].role


def test_task_input_bytes_counts_the_base_and_every_agent(ckpts):
    base, agents = open_inputs(_resolved(ckpts), allow_pickle=False)
    plan = plan_for(base, agents)
    by_name = {task.name: task_input_bytes(task, agents) for task in plan.tasks}
    # float32 tensors, in the base and both agents
    assert by_name == {EMBED: 3 * 16 * 8 * 4, UP: 3 * 24 * 8 * 4, BIAS: 3 * 24 * 4, DOWN: 3 * 8 * 24 * 4}
    assert task_input_bytes(plan.tasks[0], []) == by_name[plan.tasks[0].name] // 3


def _state(*rows: list[bool]) -> MergeState:
    stats = OverlapStatistics.zeros(len(rows))
    stats.update(torch.tensor(rows))
    return MergeState(stats)


def test_no_warning_for_sparse_agents(ckpts):
    state = _state([True, False, False, False], [True, True, False, False])
    check_densities(_resolved(ckpts), state)
    assert state.warnings == []


def test_zero_and_dense_agents_are_warned_about(ckpts):
    resolved = _resolved(ckpts)
    zero, dense = resolved.agents
    assert DENSE_AGENT_WARNING == 0.99
    state = _state([False] * 4, [True] * 4)
    with pytest.warns(UserWarning) as caught:
        check_densities(resolved, state)
    assert state.warnings == [
        f"agent {zero.index} ({zero.name}): its task vector is zero at eps=1e-05 (identical to the base: density 0);"
        " it contributes nothing",
        f"agent {dense.index} ({dense.name}): 100.00% of its elements differ from the base; is it derived from this "
        "base model (same checkpoint, same dtype)?",
    ]
    assert [str(w.message) for w in caught] == state.warnings


def test_warnings_are_only_collected_when_not_emitted(ckpts, recwarn):
    state = _state([False] * 4, [True, True, True, False])  # 75%: not dense
    check_densities(_resolved(ckpts), state, emit=False)
    assert len(state.warnings) == 1 and "task vector is zero" in state.warnings[0]
    assert len(recwarn) == 0
