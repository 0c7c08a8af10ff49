"""Per-tensor preparation of the merge-and-write pass: parameters, factors, ``prepare_tensor``, the chunks' context."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ram_trl.merging.config.settings import ResolvedConfig
from ram_trl.merging.context import RunContext
from ram_trl.merging.passes.statistics import method_factors
from ram_trl.merging.planner import TensorTask
from ram_trl.merging.streaming import fill_delta, fill_weights, read_agent_rows
from ram_trl.parallel import map_blocks
from ram_trl.statistics import OverlapStatistics, counting


class TensorInputs:
    """One whole tensor of the inputs for ``prepare_tensor`` (a :class:`~ram_trl.methods.base.TensorView`)."""

    def __init__(
        self, run: RunContext, task: TensorTask, params: dict[str, Any], pool: ThreadPoolExecutor | None
    ) -> None:
        self.name = task.name
        self.shape = tuple(task.base.shape)
        self.numel = task.base.numel
        self.num_agents = len(run.agents)
        self.params = params
        self.seed = run.resolved.seed
        self._run, self._task, self._pool = run, task, pool
        self._base: torch.Tensor | None = None

    def agent_value(self, t: int, parameter: str) -> float:
        resolved = self._run.resolved
        return resolved.agent_value(resolved.agents[t], parameter, self.name)

    def base(self) -> torch.Tensor:
        if self._base is None:
            rows = self._run.base.read_rows(self.name, self._run.require_reader())
            self._base = rows.to(device=self._run.device, dtype=torch.float32).reshape(-1)
        return self._base

    def _agent_rows(self, t: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        reader = self._run.require_reader()
        return read_agent_rows(self._run.agents[t], self._task, t, reader, 0, self._task.base_rows)

    def model(self, t: int) -> torch.Tensor:
        values, lora = self._agent_rows(t)
        out = torch.empty_like(self.base())
        fill_weights(out, values, lora, self.base())
        return out

    def magnitudes(self, t: int) -> tuple[torch.Tensor, int]:
        base_values = self.base()
        values, lora = self._agent_rows(t)
        magnitudes = torch.empty_like(base_values)
        nonzero = fill_magnitudes(magnitudes, values, lora, base_values, self._pool)
        return magnitudes, nonzero

    def map_blocks(self, fn: Callable[[Any], Any], items) -> list[Any]:
        return map_blocks(self._pool, fn, items)


def fill_magnitudes(
    out: torch.Tensor,
    values: torch.Tensor | None,
    lora: torch.Tensor | None,
    base_values: torch.Tensor,
    pool: ThreadPoolExecutor | None,
) -> int:
    """``|tau|`` of one agent's whole tensor into ``out`` (flat), in blocks on ``pool`` when there is one (the
    blocks of the TIES histograms, :data:`ram_trl.statistics.counting.HISTOGRAM_BLOCK`)."""
    numel = out.numel()
    flat_values = None if values is None else values.reshape(-1)
    flat_lora = None if lora is None else lora.reshape(-1)
    block = counting.HISTOGRAM_BLOCK if pool is not None else max(numel, 1)

    def fill(lo: int) -> int:
        hi = min(numel, lo + block)
        part = out[lo:hi]
        fill_delta(part, _flat_slice(flat_values, lo, hi), _flat_slice(flat_lora, lo, hi), base_values[lo:hi])
        return int(torch.count_nonzero(part.abs_()))

    return sum(map_blocks(pool, fill, range(0, max(numel, 1), block)))


def _flat_slice(values: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """Elements ``lo:hi`` of a flat tensor, ``None`` when it has none of them (a shorter agent tensor)."""
    if values is None or values.numel() <= lo:
        return None
    return values[lo:hi]


@dataclass
class TensorContext:
    """Per-tensor inputs of the merge pass: parameters, factors, the method's preparation, the running scan."""

    params: dict[str, Any]
    agent_params: dict[str, torch.Tensor]
    factors: list[float] | None
    prepared: Any
    ordered: bool
    seen: list[int]
    stats: OverlapStatistics | None

    def add_counts(self, counts: OverlapStatistics | None) -> None:
        """Add a block's overlap counts (methods without a statistics pass count while merging)."""
        if counts is not None:
            assert self.stats is not None
            self.stats.add(counts)


def tensor_factors(run: RunContext, task: TensorTask) -> list[float] | None:
    """The method's per-agent factors for one tensor: global, tensor-local, or none."""
    method = run.resolved.method
    if not method.needs_statistics:
        return None
    if method.tensor_local_statistics(run.resolved.params):
        return method_factors(run, run.state.tensor_stats[task.name])
    return run.state.lambdas


def tensor_context(run: RunContext, task: TensorTask, pool: ThreadPoolExecutor | None = None) -> TensorContext:
    """Prepare one tensor for the merge pass (its parameters, factors and the method's ``prepare_tensor``)."""
    resolved = run.resolved
    method = resolved.method
    agent_params = agent_parameter_values(resolved, task.name, run.device)
    params = resolved.params_for(task.name)
    prepared = None
    if method.prepare_tensor is not None and task.floating:
        view = TensorInputs(run, task, params, pool)
        prepared = method.prepare_tensor(view)
        del view
    count_inline = task.floating and not method.needs_statistics
    return TensorContext(
        params=params,
        agent_params=agent_params,
        factors=tensor_factors(run, task),
        prepared=prepared,
        ordered=method.scan is not None and prepared is not None,
        seen=[0] * (len(run.agents) * method.scan_width),
        stats=OverlapStatistics.summary(len(run.agents)) if count_inline else None,
    )


def agent_parameter_values(
    resolved: ResolvedConfig, tensor_name: str, device: torch.device
) -> dict[str, torch.Tensor]:
    """The per-agent numbers of the method for one tensor (:attr:`ChunkInputs.agent_params`): each a float32
    tensor of shape ``(num_agents,)`` on ``device``, filter rules resolved."""
    return {
        p.name: torch.tensor(
            [resolved.agent_value(a, p.name, tensor_name) for a in resolved.agents], dtype=torch.float32, device=device
        )
        for p in resolved.method.parameters
        if p.scope == "agent" and p.kind is float
    }


__all__ = [
    "TensorContext",
    "TensorInputs",
    "agent_parameter_values",
    "fill_magnitudes",
    "tensor_context",
    "tensor_factors",
]
