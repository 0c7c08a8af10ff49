"""The method API: what a merge method declares (:class:`MergeMethod`, :class:`Parameter`) and what its hooks see
(:class:`TensorView`, :class:`ChunkInputs`). Details: docs/write-a-method.md."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

if TYPE_CHECKING:
    from ram_trl.statistics import OverlapStatistics


@dataclass(frozen=True)
class Parameter:
    """A method parameter.

    Args:
        name: Name in the config.
        kind: Python type of the value (``float``, ``bool``, ``str``, or ``pathlib.Path`` for a file resolved
            like the config's other paths and kept as a string).
        default: Value when the config omits it.
        scope: ``"global"`` (top-level ``parameters``) or ``"agent"`` (each entry of ``models``).
        help: One line for docs and errors.
        choices: Allowed values for ``str`` parameters.
        minimum: Inclusive lower bound for numbers.
        maximum: Inclusive upper bound for numbers.
        aliases: Other accepted names (mergekit's, e.g. ``epsilon`` for ``eps``).
        per_tensor: For a ``"global"`` number: also accept mergekit filter rules
            (``[{filter: SUBSTRING, value: X}, ..., {value: DEFAULT}]``), resolved per tensor before the kernel
            sees :attr:`ChunkInputs.params` (``"agent"`` parameters always accept them).
    """

    name: str
    kind: type
    default: Any
    scope: Literal["global", "agent"]
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    aliases: tuple[str, ...] = ()
    per_tensor: bool = False


class TensorView(Protocol):
    """One whole tensor of the merge's inputs, as a method's ``prepare_tensor`` hook reads it.

    Attributes:
        name: The tensor's name.
        shape: The base's shape of the tensor.
        numel: Elements of the base's tensor.
        num_agents: Agents merged.
        params: Global parameter values for this tensor.
        seed: The merge's random seed.
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    num_agents: int
    params: dict[str, Any]
    seed: int

    def agent_value(self, t: int, parameter: str) -> float:
        """Agent ``t``'s value of a per-agent number for this tensor (filter rules resolved).

        Args:
            t (`int`): The agent's index.
            parameter (`str`): The parameter's canonical name.
        """
        ...

    def base(self) -> torch.Tensor:
        """The base's values, float32, flat (read once, then kept)."""
        ...

    def model(self, t: int) -> torch.Tensor:
        """Agent ``t``'s weights, float32, flat: its stored values, or the base plus its LoRA delta.

        Args:
            t (`int`): The agent's index.
        """
        ...

    def magnitudes(self, t: int) -> tuple[torch.Tensor, int]:
        """``|tau_t|`` of agent ``t`` (float32, flat, a new tensor the hook may modify) and how many are nonzero (NaN
        counts as nonzero).

        Args:
            t (`int`): The agent's index.
        """
        ...

    def map_blocks(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """``[fn(item) for item in items]`` (in order), on the merge's compute threads when there are some.

        Args:
            fn (`Callable`): The function.
            items (`Iterable`): Its arguments.
        """
        ...


@dataclass
class ChunkInputs:
    """Everything a method sees when merging one row chunk of one tensor.

    Args:
        name: The tensor's name.
        start: Flat index (within the tensor) of the chunk's first element.
        deltas: Float32 task vectors, shape ``(num_agents, n)``; methods may modify them in place.
        base: Float32 base values, shape ``(n,)``.
        params: Global parameter values.
        agent_params: Per-agent parameter values for this tensor, each a float32 tensor of shape ``(num_agents,)``.
        factors: Per-agent factors from the method's ``factors`` hook (RAM+'s ``lambda_t``), for this tensor.
        prepared: What the method's ``prepare_tensor`` hook returned for this tensor (TIES: the cuts).
        seen: With a ``scan`` hook: per agent, the scan's counts summed over the tensor's earlier blocks; a kernel
            that runs without them precomputed adds its own block's counts (it is the tensor's running count).
        seed: The merge's random seed.
        fishers: Float32 diagonal Fishers of the agents for this chunk, shape ``(num_agents, n)`` (methods that
            need them); methods may modify them in place.
        models: For a method with ``merges_weights``: the agents' float32 weights, shape ``(num_agents, n)``.
        agent_names: The agents' names, in merge order.
    """

    name: str
    start: int
    deltas: torch.Tensor
    base: torch.Tensor
    params: dict[str, Any]
    agent_params: dict[str, torch.Tensor]
    factors: list[float] | None = None
    prepared: Any = None
    seen: list[int] = field(default_factory=list)
    seed: int = 0
    fishers: torch.Tensor | None = None
    models: torch.Tensor | None = None
    agent_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class MergeMethod:
    """A registered merge method.

    Args:
        name: Canonical name.
        pretty_name: Name for model cards.
        description: One line.
        parameters: Accepted parameters.
        merge: The chunk kernel: the merged task vector of one chunk (the merged weights with ``merges_weights``),
            float32, shape ``(n,)``, on the chunk's device.
        factors: Global overlap statistics and the global parameters -> one factor per agent
            (:attr:`ChunkInputs.factors`). Its presence makes the engine run a statistics pass first; with the
            parameter ``rho_scope: tensor`` the factors are computed per tensor from that tensor's statistics.
        prepare_tensor: Per-tensor preparation over whole tensors, read through a :class:`TensorView` (one
            float32 task vector in memory at a time; the planner budgets for it); its result is
            :attr:`ChunkInputs.prepared` for every chunk of the tensor.
        prepare_bytes: Bytes per element of the largest tensor that ``prepare_tensor`` holds at once (the base's
            float32 copy, its own buffers and one agent's stored values being read); the planner's memory estimate.
            A function of the number of agents for a hook that holds every agent's task vector at once (SCE);
            read it through :meth:`preparation_bytes`.
        scan: ``(deltas of a block, prepared) -> counts`` (``scan_width`` per agent, agent after agent) that the
            kernel of every later block of the tensor needs summed (:attr:`ChunkInputs.seen`); lets the engine merge
            a tensor's blocks in parallel.
        scan_width: Counts per agent that ``scan`` returns.
        needs_fisher: Whether each agent's diagonal Fisher is streamed beside its task vector.
        merges_weights: Whether the kernel works on the models' weights (:attr:`ChunkInputs.models`) and returns
            merged weights, rather than returning a task vector the engine adds to the base.
        keeps_base_entries: Whether a ``models`` entry equal to the base is merged (a weighted average of models)
            rather than left out, and the base may be omitted (the first model then stands for it).
        divides_by_weight_sum: Whether, with ``normalize``, the merge divides by the plain sum of the agents'
            weights (which must then not be zero for any tensor).
        agents: The fewest and the most agents the method merges (``None``: no limit), after base entries are
            left out.
        reference: Paper URL.
        unstepped: For a method with a scaling, trimming or dropping step: the chunk's merged task vector without
            that step (its inputs are a copy it may modify); the report counts the elements whose written value the
            step changes (:mod:`ram_trl.statistics.effect`).
        step: What ``unstepped`` leaves out, for the report (e.g. ``"rescale (lambda_t)"``).
        check: ``(global parameters, agent names, where)`` -> ``None``, raising ``ConfigError`` for parameters that
            do not fit the merged agents; called before any tensor is read.
    """

    name: str
    pretty_name: str
    description: str
    parameters: tuple[Parameter, ...]
    merge: Callable[[ChunkInputs], torch.Tensor]
    factors: Callable[[OverlapStatistics, dict[str, Any]], list[float]] | None = None
    prepare_tensor: Callable[[TensorView], Any] | None = None
    scan: Callable[[torch.Tensor, Any], list[int]] | None = None
    scan_width: int = 1
    prepare_bytes: int | Callable[[int], int] = 12
    needs_fisher: bool = False
    merges_weights: bool = False
    keeps_base_entries: bool = False
    divides_by_weight_sum: bool = False
    agents: tuple[int, int | None] = (1, None)
    reference: str = ""
    unstepped: Callable[[ChunkInputs], torch.Tensor | None] | None = None
    step: str = ""
    check: Callable[[dict[str, Any], list[str], str], None] | None = None

    @property
    def needs_statistics(self) -> bool:
        """Whether global overlap statistics (a full pass over the inputs) must precede merging."""
        return self.factors is not None

    @property
    def prepares_tensors(self) -> bool:
        """Whether each tensor is prepared whole before its chunks are merged (one more read of each agent)."""
        return self.prepare_tensor is not None

    def preparation_bytes(self, num_agents: int) -> int:
        """:attr:`prepare_bytes`, evaluated at ``num_agents`` when it is a function (the planner's memory estimate).

        Args:
            num_agents (`int`): Agents merged.
        """
        return self.prepare_bytes(num_agents) if callable(self.prepare_bytes) else self.prepare_bytes

    def tensor_local_statistics(self, params: dict[str, Any]) -> bool:
        """Whether the factors come from each tensor's own statistics (``rho_scope: tensor``) or the model's.

        Args:
            params (`dict[str, Any]`): The merge's global parameters.
        """
        return self.needs_statistics and params.get("rho_scope") == "tensor"

    def parameter(self, name: str) -> Parameter | None:
        """The declared parameter called ``name`` (canonical name or alias), ``None`` when there is none.

        Args:
            name (`str`): The name as a config gives it.
        """
        for parameter in self.parameters:
            if name == parameter.name or name in parameter.aliases:
                return parameter
        return None


@dataclass(frozen=True)
class Alias:
    """Another name for a method, optionally with different parameter defaults (e.g. mergekit's ``ramplus_tl``)."""

    method: str
    defaults: dict[str, Any] = field(default_factory=dict)
    note: str = ""
