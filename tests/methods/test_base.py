"""ram_trl/methods/base.py: what a :class:`MergeMethod` declares and the properties the engine reads from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ram_trl.methods import resolve_method
from ram_trl.methods.base import ChunkInputs, MergeMethod, Parameter
from ram_trl.statistics import OverlapStatistics

EPS = Parameter("eps", float, 1e-5, "global", "activity threshold", minimum=0.0, aliases=("epsilon",))
WEIGHT = Parameter("weight", float, 1.0, "agent", "per-agent weight")


def _sum(inputs: ChunkInputs) -> torch.Tensor:
    return inputs.deltas.sum(0)


def _method(**hooks) -> MergeMethod:
    return MergeMethod("toy", "Toy", "sums the task vectors", (EPS, WEIGHT), _sum, **hooks)


def _factors(stats: OverlapStatistics, params: dict) -> list[float]:
    return [1.0] * stats.num_agents


def test_a_bare_method_needs_nothing_more():
    method = _method()
    assert (method.needs_statistics, method.prepares_tensors) == (False, False)
    assert not method.tensor_local_statistics({"rho_scope": "tensor"})  # no factors: nothing to scope
    assert (method.scan_width, method.prepare_bytes, method.agents) == (1, 12, (1, None))


def test_hooks_switch_on_the_engine_passes():
    method = _method(factors=_factors, prepare_tensor=lambda view: None)
    assert (method.needs_statistics, method.prepares_tensors) == (True, True)
    assert method.tensor_local_statistics({"rho_scope": "tensor"})
    assert not method.tensor_local_statistics({"rho_scope": "model"})
    assert not method.tensor_local_statistics({})


def test_parameters_are_found_by_name_or_alias():
    method = _method()
    assert method.parameter("eps") is EPS
    assert method.parameter("epsilon") is EPS
    assert method.parameter("weight") is WEIGHT
    assert method.parameter("density") is None


def test_methods_and_parameters_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _method().name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        EPS.default = 0.0  # type: ignore[misc]


def test_the_kernel_sees_a_chunk():
    inputs = ChunkInputs("w", 0, torch.tensor([[1.0, -2.0], [0.5, 0.5]]), torch.zeros(2), {}, {})
    assert inputs.seen == [] and inputs.factors is None and inputs.seed == 0
    assert torch.equal(_method().merge(inputs), torch.tensor([1.5, -1.5]))


def test_registered_methods_declare_their_statistics():
    # the engine never names a method: what it does follows from these declarations
    assert resolve_method("ram_plus")[0].needs_statistics
    assert not resolve_method("task_arithmetic")[0].needs_statistics
    assert resolve_method("ties")[0].prepares_tensors
