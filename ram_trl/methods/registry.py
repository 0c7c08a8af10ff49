"""Merge methods registered by name: the built-in methods, their aliases, and :func:`register` for more.

Each built-in method is a :class:`~ram_trl.methods.base.MergeMethod` whose kernel is a thin adapter to the pure
tensor functions of its family module (:mod:`~ram_trl.methods.ram`, :mod:`~ram_trl.methods.linear`,
:mod:`~ram_trl.methods.ties`, :mod:`~ram_trl.methods.dare`, :mod:`~ram_trl.methods.fisher`); newer methods live
whole in their own file and are registered by one line at the end of this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ram_trl import defaults
from ram_trl.methods import breadcrumbs, dare, della, fisher, linear, model_stock, ram, slerp, ties
from ram_trl.methods.base import Alias, ChunkInputs, MergeMethod, Parameter, TensorView

__all__ = [
    "Alias",
    "ChunkInputs",
    "MergeMethod",
    "Parameter",
    "TensorView",
    "alias_names",
    "method_names",
    "register",
    "resolve_method",
]


_METHODS: dict[str, MergeMethod] = {}
_ALIASES: dict[str, Alias] = {}


def register(method: MergeMethod, aliases: dict[str, Alias] | None = None) -> MergeMethod:
    """Make ``method`` (and its aliases) available by name."""
    for name in [method.name, *(aliases or {})]:
        if name in _METHODS or name in _ALIASES:
            raise ValueError(f"merge method name {name!r} is already registered")
    _METHODS[method.name] = method
    _ALIASES.update(aliases or {})
    return method


def resolve_method(name: str) -> tuple[MergeMethod, dict[str, Any]]:
    """Look a method up by canonical name or alias.

    Returns:
        ``(method, default_overrides)``: the method and the parameter defaults the alias implies.

    Raises:
        KeyError: with the list of known names.
    """
    key = name.strip().lower()
    if key in _METHODS:
        return _METHODS[key], {}
    if key in _ALIASES:
        alias = _ALIASES[key]
        return _METHODS[alias.method], dict(alias.defaults)
    raise KeyError(name)


def method_names() -> list[str]:
    return sorted(_METHODS)


def alias_names() -> dict[str, Alias]:
    return dict(_ALIASES)


# ---------------------------------------------------------------------------------------------------------------
# Parameters shared by several methods

_EPS = Parameter(
    "eps",
    float,
    ram.DEFAULT_EPS,
    "global",
    "activity threshold: |tau| > eps (strict)",
    minimum=0.0,
    aliases=("epsilon",),
)
_RHO_SCOPE = Parameter(
    "rho_scope",
    str,
    "global",
    "global",
    "count shared/unique elements over the whole model (the paper) or per tensor (mergekit's ramplus_tl)",
    choices=("global", "tensor"),
)
_R = Parameter(
    "r", float, defaults.R, "global", "rescale strength r of lambda_t = 1 + r * f(rho_t)", minimum=0.0
)
_ALPHA = Parameter("alpha", float, defaults.ALPHA, "global", "clip bound alpha of rho_t", minimum=0.0)
_LAMBDA = Parameter(
    "lambda", float, defaults.LAMBDA, "global", "global scaling term applied to the merged task vector"
)
_WEIGHT = Parameter("weight", float, defaults.WEIGHT, "agent", "per-agent weight w_t")
_DENSITY = Parameter(
    "density",
    float,
    defaults.DENSITY,
    "agent",
    "fraction of each task vector kept (TIES: by magnitude; DARE: at random, 1 - p)",
    minimum=0.0,
    maximum=1.0,
)
_INT8_MASK = Parameter(
    "int8_mask", bool, False, "global", "accepted for mergekit compatibility; has no effect"
)


def _ram_lambdas(inputs: ChunkInputs) -> list[float]:
    if inputs.factors is None:
        raise RuntimeError(f"{inputs.name}: RAM needs overlap statistics before merging")
    return inputs.factors


def _merge_ram(inputs: ChunkInputs) -> torch.Tensor:
    return ram.ram_merge(inputs.deltas, _ram_lambdas(inputs), inputs.params["eps"])


def _merge_task_arithmetic(inputs: ChunkInputs) -> torch.Tensor:
    return linear.task_arithmetic(
        inputs.deltas, inputs.agent_params["weight"], inputs.params["lambda"], inputs.params["normalize"]
    )


def _merge_linear(inputs: ChunkInputs) -> torch.Tensor:
    return linear.linear(
        inputs.deltas, inputs.base, inputs.agent_params["weight"], inputs.params["normalize"]
    )


def _trim(inputs: ChunkInputs) -> None:
    if inputs.prepared is None:
        raise RuntimeError(f"{inputs.name}: TIES needs the tensor's magnitude cuts before merging")
    for t, cut in enumerate(inputs.prepared):
        _, equal = ties.magnitude_trim(inputs.deltas[t], cut, inputs.seen[t])
        inputs.seen[t] += equal


def _merge_ties(inputs: ChunkInputs) -> torch.Tensor:
    _trim(inputs)
    return ties.disjoint_merge(
        inputs.deltas, inputs.agent_params["weight"], inputs.params["lambda"], inputs.params["normalize"]
    )


def _drop(inputs: ChunkInputs) -> None:
    densities = inputs.agent_params["density"].tolist()
    for t, density in enumerate(densities):
        key = dare.dare_key(inputs.seed, inputs.name, t)
        dare.dare_drop(inputs.deltas[t], density, key, inputs.start, inputs.params["rescale"])


def _merge_dare_linear(inputs: ChunkInputs) -> torch.Tensor:
    _drop(inputs)
    return _merge_task_arithmetic(inputs)


def _merge_dare_ties(inputs: ChunkInputs) -> torch.Tensor:
    _drop(inputs)
    return ties.disjoint_merge(
        inputs.deltas, inputs.agent_params["weight"], inputs.params["lambda"], inputs.params["normalize"]
    )


RAM_REFERENCE = "https://arxiv.org/abs/2601.13572"

register(
    MergeMethod(
        name="ram",
        pretty_name="Reinforced Agent Merging (RAM)",
        description="mean of shared elements, unique elements kept at full magnitude",
        parameters=(_EPS, _RHO_SCOPE),
        merge=lambda inputs: ram.ram_merge(
            inputs.deltas, [1.0] * inputs.deltas.shape[0], inputs.params["eps"]
        ),
        reference=RAM_REFERENCE,
    )
)
register(
    MergeMethod(
        name="ram_plus",
        pretty_name="Reinforced Agent Merging Plus (RAM+)",
        description="RAM with unique elements rescaled by lambda_t = 1 + r * clip(rho_t, 0, alpha)",
        parameters=(_EPS, _R, _ALPHA, _RHO_SCOPE),
        merge=_merge_ram,
        factors=ram.clipped_factors,
        reference=RAM_REFERENCE,
    ),
    aliases={
        "ramplus": Alias("ram_plus"),
        "ram+": Alias("ram_plus"),
        "ramplus_tl": Alias(
            "ram_plus",
            {"rho_scope": "tensor", "alpha": defaults.MERGEKIT_TL_ALPHA},
            "mergekit's tensor-local RAM+: rho per tensor, alpha default 0.2",
        ),
    },
)
register(
    MergeMethod(
        name="ram_plus_soft",
        pretty_name="Reinforced Agent Merging Plus, soft saturation (RAM+s)",
        description="RAM with unique elements rescaled by lambda_t = 1 + r * rho_t / (1 + rho_t)",
        parameters=(_EPS, _R, _RHO_SCOPE),
        merge=_merge_ram,
        factors=ram.soft_factors,
        reference=RAM_REFERENCE,
    ),
    aliases={
        "ramplus_soft": Alias("ram_plus_soft"),
        "ram+s": Alias("ram_plus_soft"),
        "rams": Alias("ram_plus_soft"),
    },
)
register(
    MergeMethod(
        name="task_arithmetic",
        pretty_name="Task Arithmetic",
        description="lambda * sum_t w_t tau_t",
        parameters=(
            _LAMBDA,
            Parameter("normalize", bool, False, "global", "divide by the sum of weights"),
            _WEIGHT,
            _INT8_MASK,
        ),
        merge=_merge_task_arithmetic,
        reference="https://arxiv.org/abs/2212.04089",
    ),
    aliases={"ta": Alias("task_arithmetic")},
)
register(
    MergeMethod(
        name="ties",
        pretty_name="TIES",
        description="per-tensor magnitude trim, sign election by sum, disjoint mean",
        parameters=(
            _LAMBDA,
            Parameter("normalize", bool, True, "global", "disjoint mean (divide by the agreeing weights)"),
            _WEIGHT,
            _DENSITY,
            _INT8_MASK,
        ),
        merge=_merge_ties,
        prepare_tensor=ties.prepare_cuts,
        scan=ties.scan_ties,
        reference="https://arxiv.org/abs/2306.01708",
    ),
)
_DARE_RESCALE = Parameter("rescale", bool, True, "global", "rescale survivors by 1 / density (= 1 / (1 - p))")
register(
    MergeMethod(
        name="dare_linear",
        pretty_name="DARE + Task Arithmetic",
        description="random drop (p = 1 - density), rescale 1/(1-p), then task arithmetic",
        parameters=(
            _LAMBDA,
            Parameter("normalize", bool, False, "global", "divide by the sum of weights"),
            _DARE_RESCALE,
            _WEIGHT,
            _DENSITY,
            _INT8_MASK,
        ),
        merge=_merge_dare_linear,
        reference="https://arxiv.org/abs/2311.03099",
    ),
    aliases={"dare_ta": Alias("dare_linear")},
)
register(
    MergeMethod(
        name="dare_ties",
        pretty_name="DARE + TIES",
        description="random drop (p = 1 - density), rescale 1/(1-p), then sign election and disjoint sum/mean",
        parameters=(
            _LAMBDA,
            Parameter("normalize", bool, False, "global", "disjoint mean (divide by the agreeing weights)"),
            _DARE_RESCALE,
            _WEIGHT,
            _DENSITY,
            _INT8_MASK,
        ),
        merge=_merge_dare_ties,
        reference="https://arxiv.org/abs/2311.03099",
    ),
)
register(
    MergeMethod(
        name="linear",
        pretty_name="Linear (weighted average)",
        description="sum_t w_t theta_t / sum_t w_t",
        parameters=(Parameter("normalize", bool, True, "global", "divide by the sum of weights"), _WEIGHT),
        merge=_merge_linear,
        keeps_base_entries=True,
        divides_by_weight_sum=True,
        reference="https://arxiv.org/abs/2203.05482",
    ),
    aliases={"average": Alias("linear"), "model_soup": Alias("linear")},
)


def _merge_fisher(inputs: ChunkInputs) -> torch.Tensor:
    if inputs.fishers is None:
        raise RuntimeError(f"{inputs.name}: Fisher merging needs the agents' Fisher values")
    return fisher.fisher_merge(
        inputs.deltas,
        inputs.fishers,
        inputs.agent_params["weight"],
        inputs.params["lambda"],
        inputs.params["fisher_floor"],
    )


register(
    MergeMethod(
        name="fisher",
        pretty_name="Fisher merging",
        description="lambda * sum_t w_t F_t tau_t / sum_t w_t F_t with each agent's diagonal Fisher F_t",
        parameters=(
            _LAMBDA,
            Parameter(
                "fisher_floor",
                float,
                fisher.DEFAULT_FISHER_FLOOR,
                "global",
                "Fisher values below it are raised to it (Matena & Raffel's fisher_floor; 0: none)",
                minimum=0.0,
            ),
            Parameter("weight", float, defaults.WEIGHT, "agent", "per-agent weight w_t", minimum=0.0),
            Parameter(
                "fisher",
                Path,
                "",
                "agent",
                "the agent's Fisher file (default: fisher.safetensors in the agent's directory)",
            ),
        ),
        merge=_merge_fisher,
        needs_fisher=True,
        reference="https://arxiv.org/abs/2111.09832",
    ),
    aliases={"fisher_merging": Alias("fisher")},
)


# ---------------------------------------------------------------------------------------------------------------
# Methods that live whole in their own file (imported above): one line each

register(slerp.SLERP)
register(breadcrumbs.BREADCRUMBS)
register(breadcrumbs.BREADCRUMBS_TIES)
register(model_stock.MODEL_STOCK)
register(della.DELLA)
register(della.DELLA_LINEAR)
