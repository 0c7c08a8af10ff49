"""Parameters that several merge methods share, defined once; a parameter only one method has stays in its file."""

from __future__ import annotations

from ram_trl import defaults
from ram_trl.methods.base import Parameter

__all__ = ["INT8_MASK", "LAMBDA", "WEIGHT", "density", "normalize", "rescale", "sparsified_parameters"]

#: The global scaling term ``lambda`` of the merged task vector.
LAMBDA = Parameter(
    "lambda",
    float,
    defaults.LAMBDA,
    "global",
    "global scaling term applied to the merged task vector",
    per_tensor=True,
)
#: Each agent's weight ``w_t``.
WEIGHT = Parameter("weight", float, defaults.WEIGHT, "agent", "per-agent weight w_t")
#: mergekit's ``int8_mask``, accepted so that mergekit YAMLs load.
INT8_MASK = Parameter("int8_mask", bool, False, "global", "accepted for mergekit compatibility; has no effect")


def normalize(default: bool, help: str) -> Parameter:
    """The global ``normalize`` switch.

    Args:
        default (`bool`): The method's default.
        help (`str`): What dividing means for the method (by the sum of weights, or by the agreeing weights).
    """
    return Parameter("normalize", bool, default, "global", help)


def rescale(default: bool, help: str) -> Parameter:
    """The global ``rescale`` switch of a method that drops task-vector elements.

    Args:
        default (`bool`): The method's default.
        help (`str`): How the survivors are rescaled.
    """
    return Parameter("rescale", bool, default, "global", help)


def density(help: str) -> Parameter:
    """The per-agent ``density`` (share of each task vector kept), between 0 and 1, default
    :data:`ram_trl.defaults.DENSITY`.

    Args:
        help (`str`): How the method chooses what it keeps.
    """
    return Parameter("density", float, defaults.DENSITY, "agent", help, minimum=0.0, maximum=1.0)


def sparsified_parameters(
    normalize_default: bool,
    normalize_help: str,
    rescale_default: bool,
    rescale_help: str,
    density_help: str,
    *extra: Parameter,
) -> tuple[Parameter, ...]:
    """The parameters of a method that drops task-vector elements, then merges (DARE, Breadcrumbs, DELLA), in the
    order they are listed: ``lambda``, ``normalize``, ``rescale``, ``weight``, ``density``, the method's own,
    ``int8_mask``.

    Args:
        normalize_default (`bool`): Default of ``normalize``.
        normalize_help (`str`): Help line of ``normalize``.
        rescale_default (`bool`): Default of ``rescale``.
        rescale_help (`str`): Help line of ``rescale``.
        density_help (`str`): Help line of ``density``.
        *extra (`Parameter`): The method's own parameters (Breadcrumbs' ``gamma``, DELLA's ``epsilon``).
    """
    return (
        LAMBDA,
        normalize(normalize_default, normalize_help),
        rescale(rescale_default, rescale_help),
        WEIGHT,
        density(density_help),
        *extra,
        INT8_MASK,
    )
