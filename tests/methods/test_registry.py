"""ram_trl.methods.registry: names, aliases, parameters and defaults, and each method's chunk function."""

from __future__ import annotations

import pytest
import torch

from ram_trl import defaults
from ram_trl.methods import (
    ChunkInputs,
    MergeMethod,
    Parameter,
    alias_names,
    method_names,
    register,
    registry,
    resolve_method,
)
from ram_trl.methods.ties import magnitude_cut

#: name -> (needs_statistics, prepares_tensors, needs_fisher, {parameter: (default, scope)})
EXPECTED = {
    "breadcrumbs": (
        False,
        True,
        False,
        {
            "lambda": (1.0, "global"),
            "normalize": (False, "global"),
            "rescale": (False, "global"),
            "weight": (1.0, "agent"),
            "density": (1.0, "agent"),
            "gamma": (0.01, "agent"),
            "int8_mask": (False, "global"),
        },
    ),
    "breadcrumbs_ties": (
        False,
        True,
        False,
        {
            "lambda": (1.0, "global"),
            "normalize": (False, "global"),
            "rescale": (False, "global"),
            "weight": (1.0, "agent"),
            "density": (1.0, "agent"),
            "gamma": (0.01, "agent"),
            "int8_mask": (False, "global"),
        },
    ),
    "slerp": (False, True, False, {"t": (0.5, "global")}),
    "model_stock": (False, True, False, {"filter_wise": (False, "global")}),
    "sce": (False, True, False, {"select_topk": (1.0, "global"), "int8_mask": (False, "global")}),
    "della": (
        False,
        True,
        False,
        {
            "lambda": (1.0, "global"),
            "normalize": (True, "global"),
            "rescale": (True, "global"),
            "weight": (1.0, "agent"),
            "density": (1.0, "agent"),
            "epsilon": (0.15, "agent"),
            "int8_mask": (False, "global"),
        },
    ),
    "della_linear": (
        False,
        True,
        False,
        {
            "lambda": (1.0, "global"),
            "normalize": (False, "global"),
            "rescale": (True, "global"),
            "weight": (1.0, "agent"),
            "density": (1.0, "agent"),
            "epsilon": (0.15, "agent"),
            "int8_mask": (False, "global"),
        },
    ),
    "dare_linear": (
        False,
        False,
        False,
        {
            "lambda": (1.0, "global"),
            "normalize": (False, "global"),
            "rescale": (True, "global"),
            "weight": (1.0, "agent"),
            "density": (1.0, "agent"),
            "int8_mask": (False, "global"),
        },
    ),
    "dare_ties": (
        False,
        False,
        False,
        {
            "lambda": (1.0, "global"),
            "normalize": (False, "global"),
            "rescale": (True, "global"),
            "weight": (1.0, "agent"),
            "density": (1.0, "agent"),
            "int8_mask": (False, "global"),
        },
    ),
    "fisher": (
        False,
        False,
        True,
        {
            "lambda": (1.0, "global"),
            "fisher_floor": (1e-6, "global"),
            "weight": (1.0, "agent"),
            "fisher": ("", "agent"),
        },
    ),
    "linear": (False, False, False, {"normalize": (True, "global"), "weight": (1.0, "agent")}),
    "ram": (
        False,
        False,
        False,
        {"eps": (1e-5, "global"), "rho_scope": ("global", "global"), "unique_scale": (1.0, "global")},
    ),
    "ram_unique": (False, False, False, {"eps": (1e-5, "global"), "agent": ("", "global")}),
    "ram_plus": (
        True,
        False,
        False,
        {"eps": (1e-5, "global"), "r": (0.1, "global"), "alpha": (2.0, "global"), "rho_scope": ("global", "global")},
    ),
    "ram_plus_soft": (
        True,
        False,
        False,
        {"eps": (1e-5, "global"), "r": (0.1, "global"), "rho_scope": ("global", "global")},
    ),
    "task_arithmetic": (
        False,
        False,
        False,
        {
            "lambda": (1.0, "global"),
            "normalize": (False, "global"),
            "weight": (1.0, "agent"),
            "int8_mask": (False, "global"),
        },
    ),
    "ties": (
        False,
        True,
        False,
        {
            "lambda": (1.0, "global"),
            "normalize": (True, "global"),
            "weight": (1.0, "agent"),
            "density": (1.0, "agent"),
            "int8_mask": (False, "global"),
        },
    ),
}


def test_methods_flags_parameters_and_defaults():
    assert method_names() == sorted(EXPECTED)
    for name, (statistics, trims, fisher, parameters) in EXPECTED.items():
        method, overrides = resolve_method(name)
        assert (method.name, overrides) == (name, {})
        assert (method.needs_statistics, method.prepares_tensors, method.needs_fisher) == (statistics, trims, fisher)
        assert {p.name: (p.default, p.scope) for p in method.parameters} == parameters, name
        assert method.pretty_name and method.description


def test_defaults_come_from_the_defaults_module():
    ram_plus, _ = resolve_method("ram_plus")
    assert ram_plus.parameter("eps").default == defaults.EPS
    assert ram_plus.parameter("r").default == defaults.R
    assert ram_plus.parameter("alpha").default == defaults.ALPHA
    assert resolve_method("fisher")[0].parameter("fisher_floor").default == defaults.FISHER_FLOOR
    assert resolve_method("ramplus_tl")[1]["alpha"] == defaults.MERGEKIT_TL_ALPHA


def test_aliases():
    assert {name: (a.method, a.defaults) for name, a in alias_names().items()} == {
        "ramplus": ("ram_plus", {}),
        "ram+": ("ram_plus", {}),
        "ramplus_tl": ("ram_plus", {"rho_scope": "tensor", "alpha": 0.2}),
        "ramplus_soft": ("ram_plus_soft", {}),
        "ram+s": ("ram_plus_soft", {}),
        "rams": ("ram_plus_soft", {}),
        "ta": ("task_arithmetic", {}),
        "dare_ta": ("dare_linear", {}),
        "average": ("linear", {}),
        "model_soup": ("linear", {}),
        "fisher_merging": ("fisher", {}),
    }
    method, overrides = resolve_method("  RamPlus_TL ")  # case and surrounding spaces do not matter
    assert method.name == "ram_plus" and overrides == {"rho_scope": "tensor", "alpha": 0.2}


def test_parameter_lookup_by_name_or_alias():
    ram, _ = resolve_method("ram")
    assert ram.parameter("epsilon") is ram.parameter("eps")
    assert ram.parameter("eps").minimum == 0.0
    assert ram.parameter("rho_scope").choices == ("global", "tensor")
    assert ram.parameter("r") is None
    density = resolve_method("ties")[0].parameter("density")
    assert (density.minimum, density.maximum) == (0.0, 1.0)


def test_unknown_method():
    with pytest.raises(KeyError):
        resolve_method("nuslerp")


def test_register_refuses_taken_names(monkeypatch):
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    monkeypatch.setattr(registry, "_ALIASES", dict(registry._ALIASES))
    mine = MergeMethod(
        name="keep_first",
        pretty_name="Keep first",
        description="the first agent's task vector",
        parameters=(Parameter("weight", float, 1.0, "agent", "unused"),),
        merge=lambda inputs: inputs.deltas[0].clone(),
    )
    register(mine, aliases={"first": registry.Alias("keep_first")})
    assert resolve_method("first") == (mine, {})
    assert "keep_first" in method_names()
    for name, aliases in (("ram", None), ("keep_first", None), ("other", {"ta": registry.Alias("other")})):
        taken = MergeMethod(name, "x", "x", (), merge=lambda inputs: inputs.deltas[0])
        with pytest.raises(ValueError, match="already registered"):
            register(taken, aliases=aliases)


def _inputs(method: str, deltas, weights=None, **params) -> ChunkInputs:
    meth, overrides = resolve_method(method)
    values = {p.name: p.default for p in meth.parameters if p.scope == "global"} | overrides | params
    deltas = torch.tensor(deltas, dtype=torch.float32)
    agent = {
        p.name: torch.full((len(deltas),), float(p.default))
        for p in meth.parameters
        if p.scope == "agent" and p.kind is float
    }
    if weights is not None:
        agent["weight"] = torch.tensor(weights, dtype=torch.float32)
    return ChunkInputs(
        name="t", start=0, deltas=deltas, base=torch.zeros(deltas.shape[1]), params=values, agent_params=agent
    )


def test_chunk_functions_on_hand_computed_inputs():
    merge = {name: resolve_method(name)[0].merge for name in method_names()}
    tau = [[1.0, 2.0, 0.0, -1.0], [3.0, 4.0, 0.0, 1.0]]
    # task arithmetic: lambda * sum_t w_t tau_t
    out = merge["task_arithmetic"](_inputs("task_arithmetic", tau, [1.0, 0.5], **{"lambda": 2.0}))
    assert out.tolist() == [5.0, 8.0, 0.0, -1.0]
    # linear (normalized): sum_t w_t tau_t / sum_t w_t (the models' weighted mean, as a task vector)
    out = merge["linear"](_inputs("linear", tau, [1.0, 3.0]))
    assert out.tolist() == [2.5, 3.5, 0.0, 0.5]
    # RAM: unique elements times lambda_t, shared ones averaged, inactive ones 0
    inputs = _inputs("ram_plus", [[0.5, 0.0, 0.25, 1e-5], [0.0, 0.0, 0.75, 0.0]])
    inputs.factors = [1.25, 1.0]
    assert merge["ram_plus"](inputs).tolist() == [0.625, 0.0, 0.5, 0.0]
    with pytest.raises(RuntimeError, match="needs overlap statistics"):
        merge["ram_plus"](_inputs("ram_plus", tau))
    with pytest.raises(RuntimeError, match="needs the agents' Fisher values"):
        merge["fisher"](_inputs("fisher", tau))


def test_ties_chunk_function_with_a_cut():
    # density 0.5 keeps the 2 largest magnitudes per agent; the elected sign is that of the kept sum
    tau = [[4.0, -1.0, 2.0, -3.0], [-2.0, 5.0, 1.0, -0.5]]
    inputs = _inputs("ties", tau)
    inputs.prepared = [magnitude_cut(torch.tensor(row).abs(), 2) for row in tau]
    inputs.seen = [0, 0]
    # kept: agent 0 {4, -3}, agent 1 {-2, 5}; sums 2, 5, 0, -3 -> signs +, +, +, -; disjoint means 4, 5, 0, -3
    assert resolve_method("ties")[0].merge(inputs).tolist() == [4.0, 5.0, 0.0, -3.0]
