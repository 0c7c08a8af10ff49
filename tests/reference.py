"""Straightforward in-memory reference implementations of every merge method, for tests only.

Whole models are loaded into memory and each method is written the way its paper states it, with no chunking, no
registry and no shared code with the streaming engine (except DARE's random stream, which is part of the method's
definition in ram_trl and is imported from :mod:`ram_trl.methods.dare`).
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from pathlib import Path

import torch
from safetensors.torch import load_file

from ram_trl.methods.dare import dare_key, hashed_uniform
from ram_trl.statistics.counting import keep_count


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (single file or sharded with an index)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(path / file))
        return state
    return load_file(path / "model.safetensors")


def task_vectors(base: dict, agents: list[dict]) -> dict[str, list[torch.Tensor]]:
    return {
        name: [agent[name].float() - base[name].float() for agent in agents]
        for name in base
        if base[name].is_floating_point()
    }


def ram_reference(
    base: dict,
    agents: list[dict],
    *,
    eps: float = 1e-5,
    r: float = 0.0,
    alpha: float = 2.0,
    soft: bool = False,
    scope: str = "global",
    unique_scale: float | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Algorithm 1 of the RAM paper. Returns (merged float32 weights, statistics). ``unique_scale`` replaces every
    lambda_t (RAM with its unique region scaled, the shared mean unchanged)."""
    return ram_from_task_vectors(
        base, task_vectors(base, agents), eps=eps, r=r, alpha=alpha, soft=soft, scope=scope, unique_scale=unique_scale
    )


def ram_from_task_vectors(
    base: dict,
    taus: dict[str, list[torch.Tensor]],
    *,
    eps: float = 1e-5,
    r: float = 0.0,
    alpha: float = 2.0,
    soft: bool = False,
    scope: str = "global",
    unique_scale: float | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Algorithm 1 on given float32 task vectors (``name -> [tau_agent_0, ...]``)."""
    n_agents = len(next(iter(taus.values())))
    # |tau| > eps compared exactly (in float64, where every float32 value and eps are represented exactly)
    masks = {name: [tau.double().abs() > eps for tau in tv] for name, tv in taus.items()}
    counts = {name: sum(m.to(torch.int64) for m in ms) for name, ms in masks.items()}

    def lambdas_for(names: list[str]) -> tuple[list[float], list[int], list[int]]:
        shared = [sum(int((masks[n][t] & (counts[n] >= 2)).sum()) for n in names) for t in range(n_agents)]
        unique = [sum(int((masks[n][t] & (counts[n] == 1)).sum()) for n in names) for t in range(n_agents)]
        lambdas = []
        if unique_scale is not None:
            return [unique_scale] * n_agents, shared, unique
        for s, u in zip(shared, unique, strict=True):
            rho = s / u if u > 0 else (math.inf if s > 0 else 0.0)
            if soft:  # noqa: SIM108 (the reference spells both branches out)
                lam = 1 + r * (1.0 if math.isinf(rho) else rho / (1 + rho))
            else:
                lam = 1 + r * min(max(rho, 0.0), alpha)
            lambdas.append(lam)
        return lambdas, shared, unique

    global_lambdas, shared, unique = lambdas_for(list(taus))
    merged = {}
    for name, tv in taus.items():
        lambdas = global_lambdas if scope == "global" else lambdas_for([name])[0]
        count = counts[name]
        out = torch.zeros_like(tv[0])
        for t in range(n_agents):
            only_t = masks[name][t] & (count == 1)
            out = torch.where(only_t, torch.tensor(lambdas[t], dtype=torch.float32) * tv[t], out)
        shared_sum = torch.zeros_like(tv[0])
        for t in range(n_agents):
            shared_sum = shared_sum + torch.where(masks[name][t], tv[t], torch.zeros_like(tv[t]))
        out = torch.where(count >= 2, shared_sum / count.clamp(min=1).float(), out)
        merged[name] = base[name].float() + out
    stats = {"shared": shared, "unique": unique, "lambdas": global_lambdas}
    return merged, stats


def ram_unique_reference(base: dict, agents: list[dict], agent: int, eps: float = 1e-5) -> dict[str, torch.Tensor]:
    """One agent's unique region: base + tau_agent where that agent alone has |tau| > eps, the base elsewhere."""
    merged = {}
    for name, tv in task_vectors(base, agents).items():
        active = [tau.double().abs() > eps for tau in tv]
        alone = active[agent]
        for t, other in enumerate(active):
            if t != agent:
                alone = alone & ~other
        merged[name] = base[name].float() + torch.where(alone, tv[agent], torch.zeros_like(tv[agent]))
    return merged


def reference_keep_count(numel: int, density: float) -> int:
    if density >= 1:
        return numel
    if density <= 0:
        return 0
    return max(1, int(Decimal(repr(density)) * numel))


def ties_reference(
    base: dict,
    agents: list[dict],
    weights: list[float],
    densities: list[float],
    lam: float = 1.0,
    normalize: bool = True,
) -> dict[str, torch.Tensor]:
    """TIES: per-tensor top-k by magnitude (ties: lowest flat index first), sign election by sum, disjoint mean."""
    merged = {}
    for name, tv in task_vectors(base, agents).items():
        trimmed = []
        for tau, density in zip(tv, densities, strict=True):
            flat = tau.reshape(-1)
            k = reference_keep_count(flat.numel(), density)
            order = torch.sort(flat.abs(), descending=True, stable=True).indices
            keep = torch.zeros(flat.numel(), dtype=torch.bool)
            keep[order[:k]] = True
            trimmed.append(torch.where(keep, flat, torch.zeros_like(flat)).reshape(tau.shape))
        merged[name] = base[name].float() + _disjoint(trimmed, weights, lam, normalize)
    return merged


def _disjoint(deltas: list[torch.Tensor], weights: list[float], lam: float, normalize: bool) -> torch.Tensor:
    weighted = [d * w for d, w in zip(deltas, weights, strict=True)]
    total = torch.zeros_like(weighted[0])
    for w in weighted:
        total = total + w
    elected = torch.where(total >= 0, 1.0, -1.0)
    numerator = torch.zeros_like(total)
    divisor = torch.zeros_like(total)
    for wd, w in zip(weighted, weights, strict=True):
        agrees = torch.sign(wd) == elected
        numerator = numerator + torch.where(agrees, wd, torch.zeros_like(wd))
        divisor = divisor + torch.where(agrees, torch.tensor(w), torch.tensor(0.0))
    if normalize:
        divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)
        numerator = numerator / divisor
    return numerator * lam if lam != 1.0 else numerator


def dare_reference(
    base: dict,
    agents: list[dict],
    weights: list[float],
    densities: list[float],
    *,
    seed: int = 0,
    lam: float = 1.0,
    ties: bool = False,
    normalize: bool = False,
    rescale: bool = True,
) -> dict[str, torch.Tensor]:
    """DARE: keep each element with probability density (the hashed stream), rescale by 1/density, then TA or TIES."""
    merged = {}
    for name, tv in task_vectors(base, agents).items():
        dropped = []
        for t, (tau, density) in enumerate(zip(tv, densities, strict=True)):
            if density >= 1:
                dropped.append(tau)
                continue
            keep = hashed_uniform(dare_key(seed, name, t), 0, tau.numel()).reshape(tau.shape) < density
            value = torch.where(keep, tau, torch.zeros_like(tau))
            dropped.append(value / density if rescale else value)
        if ties:
            merged[name] = base[name].float() + _disjoint(dropped, weights, lam, normalize)
        else:
            merged[name] = base[name].float() + _weighted(dropped, weights, lam, normalize)
    return merged


def _weighted(deltas, weights, lam, normalize):
    total = torch.zeros_like(deltas[0])
    for d, w in zip(deltas, weights, strict=True):
        total = total + d * w
    if normalize and abs(sum(weights)) >= 1e-8:
        total = total / sum(weights)
    return total * lam if lam != 1.0 else total


def task_arithmetic_reference(base, agents, weights, lam=1.0, normalize=False):
    return {
        name: base[name].float() + _weighted(tv, weights, lam, normalize)
        for name, tv in task_vectors(base, agents).items()
    }


def linear_reference(base, agents, weights, normalize=True):
    out = {}
    for name in base:
        if not base[name].is_floating_point():
            continue
        total = torch.zeros_like(base[name], dtype=torch.float32)
        for agent, w in zip(agents, weights, strict=True):
            total = total + agent[name].float() * w
        out[name] = total / sum(weights) if normalize else total
    return out


def fisher_reference(
    base: dict, agents: list[dict], fishers: list[dict], weights: list[float], lam: float = 1.0, floor: float = 1e-6
) -> dict[str, torch.Tensor]:
    """Fisher merging (Matena & Raffel): base + lambda * sum_t w_t F'_t tau_t / sum_t w_t F'_t, F' = max(F, floor);
    where the denominator is zero, the weighted mean of the task vectors (0 if every weight is zero)."""
    merged = {}
    for name, tv in task_vectors(base, agents).items():
        numerator = torch.zeros_like(tv[0])
        denominator = torch.zeros_like(tv[0])
        plain = torch.zeros_like(tv[0])
        for tau, fisher, w in zip(tv, fishers, weights, strict=True):
            f = fisher[name].float()
            if floor > 0:
                f = torch.maximum(f, torch.tensor(floor, dtype=torch.float32))
            wf = f * torch.tensor(w, dtype=torch.float32)
            numerator = numerator + wf * tau
            denominator = denominator + wf
            plain = plain + tau * torch.tensor(w, dtype=torch.float32)
        fallback = plain / sum(weights) if sum(weights) > 0 else torch.zeros_like(plain)
        out = torch.where(denominator == 0, fallback, numerator / denominator)
        merged[name] = base[name].float() + (out * lam if lam != 1.0 else out)
    return merged


# The exact magnitude statistics the streaming histograms approximate (ram_trl.statistics.magnitude)


def gini_coefficient(values: torch.Tensor) -> float:
    """Exact Gini coefficient of ``|values|``.

    ``G = sum_i (2 i - n - 1) x_(i) / (n sum_i x_i)`` with ``x_(1) <= ... <= x_(n)`` the sorted magnitudes: 0 when
    all magnitudes are equal, ``1 - 1/n`` for one nonzero among ``n`` (it tends to 1 as ``n`` grows).

    Args:
        values: Any shape; sorted in float64 in memory (use :class:`MagnitudeStatistics` for a whole model).

    Returns:
        The coefficient, or NaN when ``values`` is empty or all zero.
    """
    x = values.reshape(-1).to(torch.float64).abs().sort().values
    n = x.numel()
    total = float(x.sum())
    if n == 0 or total == 0.0:
        return math.nan
    ranks = torch.arange(1, n + 1, dtype=torch.float64, device=x.device)
    return float(((2 * ranks - n - 1) * x).sum()) / (n * total)


def top_mass_share(values: torch.Tensor, fraction: float) -> float:
    """Exact share of the L1 mass of ``values`` held by its ``k`` largest magnitudes.

    Args:
        values: Any shape.
        fraction: Share of the elements; ``k = max(1, floor(fraction * n))`` (:func:`ram_trl.statistics.counting.keep_count`,
            the same rule as TIES trimming).

    Returns:
        ``sum of the k largest |values| / sum |values|``, or NaN when empty or all zero.
    """
    x = values.reshape(-1).to(torch.float64).abs()
    total = float(x.sum())
    if x.numel() == 0 or total == 0.0:
        return math.nan
    k = keep_count(x.numel(), fraction)
    return float(x.topk(k).values.sum()) / total
