"""Magnitude statistics of the active task-vector elements (mean ``|tau|``, excess kurtosis, Gini, top-k L1 mass),
accumulated chunk by chunk in memory independent of the model's size: a ``|tau|`` histogram with exact per-bin sums
and stated error bounds (docs/analysis.md)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ram_trl.statistics.counting import keep_count

if TYPE_CHECKING:
    from ram_trl.distributed import DistContext

#: Mantissa bits kept by the |tau| histogram of :class:`MagnitudeStatistics`: ``2**7 = 128`` bins per octave. With 7
#: bits a bin is exactly the set of float32 values that truncate to one bfloat16 value.
MAGNITUDE_MANTISSA_BITS = 7

#: The top fractions of active elements whose share of the L1 mass is reported, by report key.
TOP_FRACTIONS = {"top_1pct_mass": 0.01, "top_5pct_mass": 0.05}

_FLOAT32_MANTISSA_BITS = 23


def magnitude_bin_edges(first: int, stop: int, mantissa_bits: int = MAGNITUDE_MANTISSA_BITS) -> torch.Tensor:
    """Lower edges of bins ``first .. stop`` (inclusive: ``stop`` gives the upper edge of bin ``stop - 1``), float64."""
    shift = _FLOAT32_MANTISSA_BITS - mantissa_bits
    bits = (torch.arange(first, stop + 1, dtype=torch.int64) << shift).to(torch.int32)  # host
    return bits.view(torch.float32).to(torch.float64)


class MagnitudeWorkspace:
    """Buffers that :func:`sum_of_squares` and :meth:`MagnitudeStatistics.add_values` reuse from chunk to chunk (no
    allocation, hence no page faults, per chunk). One per thread."""

    def __init__(self, numel: int, device: torch.device | str = "cpu") -> None:
        self.wide = torch.empty(2, numel, dtype=torch.int64, device=device)
        self.narrow = torch.empty(2, numel, dtype=torch.int32, device=device)

    @property
    def numel(self) -> int:
        return self.wide.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.wide, self.narrow))

    def buffers(self, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(wide, narrow)``: int64 and int32 ``(2, numel)`` buffers (views of this workspace when they fit)."""
        if numel <= self.numel and self.wide.device == device:
            return self.wide[:, :numel], self.narrow[:, :numel]
        return _new_buffers(numel, device)


def _new_buffers(numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(2, numel, dtype=torch.int64, device=device),
        torch.empty(2, numel, dtype=torch.int32, device=device),
    )


def sum_of_squares(values: torch.Tensor, workspace: MagnitudeWorkspace | None = None) -> torch.Tensor:
    """``sum x**2`` of float32 values, in float64 (every square is exact in float64)."""
    values = values.reshape(-1)
    if workspace is None:
        wide, _ = _new_buffers(values.numel(), values.device)
    else:
        wide, _ = workspace.buffers(values.numel(), values.device)
    x = wide[0].view(torch.float64)
    x.copy_(values)
    return torch.dot(x, x)


def excess_kurtosis(count: int, power_sums: Sequence[float]) -> float:
    """Excess kurtosis ``m4 / m2**2 - 3`` from the power sums of a sample (population moments)."""
    if count == 0:
        return math.nan
    s1, s2, s3, s4 = (float(s) / count for s in power_sums)
    m2 = s2 - s1 * s1
    m4 = s4 - 4 * s1 * s3 + 6 * s1 * s1 * s2 - 3 * s1**4
    if m2 <= 0.0:
        return math.nan
    return m4 / (m2 * m2) - 3.0


def histogram_gini(counts: torch.Tensor, sums: torch.Tensor, zeros: int = 0) -> float:
    """Gini coefficient of magnitudes known only through a histogram with ordered, disjoint bins."""
    counts = counts.to(torch.float64)
    sums = sums.to(torch.float64)
    total = float(sums.sum())
    n = float(counts.sum()) + zeros
    if total == 0.0:
        return math.nan
    before = torch.cumsum(counts, 0) - counts + zeros
    return float((sums * (2 * before + counts - n)).sum()) / (n * total)


def histogram_top_mass(counts: torch.Tensor, sums: torch.Tensor, fraction: float) -> float:
    """Share of the L1 mass in the top ``k`` elements, estimated from a histogram with ordered, disjoint bins."""
    total = float(sums.sum())
    n = int(counts.sum())
    if n == 0 or total == 0.0:
        return math.nan
    k = keep_count(n, fraction)
    c = counts.flip(0)
    s = sums.to(torch.float64).flip(0)
    cumulative = torch.cumsum(c, 0)
    j = int(torch.searchsorted(cumulative, torch.tensor([k], dtype=cumulative.dtype, device=cumulative.device)))
    taken = int(cumulative[j] - c[j])
    mass = float(s[:j].sum()) + (k - taken) * float(s[j]) / int(c[j])
    return mass / total


@dataclass(frozen=True)
class _Packing:
    """How :class:`MagnitudeStatistics` bins float32 values and packs a bin's count and remainder sum into one
    int64: ``count << shift`` plus the sum of the ``dropped_bits``-bit remainders, unpacked at the latest after
    ``capacity`` elements (so neither field can overflow)."""

    mantissa_bits: int
    dropped_bits: int
    shift: int
    capacity: int

    @property
    def dropped_mask(self) -> int:
        return (1 << self.dropped_bits) - 1

    @property
    def magnitude_bins(self) -> int:
        return 2 ** (8 + self.mantissa_bits)


@functools.cache
def _packing(mantissa_bits: int) -> _Packing:
    dropped = _FLOAT32_MANTISSA_BITS - mantissa_bits
    # n elements pack to at most n * 2**shift + n * 2**dropped: both fields fit while n <= 2**(shift - dropped),
    # and the int64 while 2 * shift - dropped <= 62
    shift = (62 + dropped) // 2
    return _Packing(mantissa_bits, dropped, shift, 1 << (shift - dropped))


@functools.cache
def _nonfinite_bins(mantissa_bits: int, device: torch.device) -> torch.Tensor:
    """The signed bins of the non-finite values (exponent 255; positive, then negative; the first of each is inf)."""
    bins = 2 ** (8 + mantissa_bits)
    nonfinite = torch.arange(255 << mantissa_bits, bins, dtype=torch.int64)  # host
    return torch.cat([nonfinite, nonfinite + bins]).to(device)


def _fold_signs(signed: torch.Tensor) -> torch.Tensor:
    """Per-``|tau|`` bin values from per-signed-bin ones (positive bins first): the two halves added."""
    half = signed.shape[1] // 2
    return signed[:, :half] + signed[:, half:]


@functools.cache
def _bin_lower_edges_and_units(mantissa_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per magnitude bin: its lower edge, and the float32 unit ``u`` of its magnitudes (``2**(e - 150)``
    for the biased exponent ``e``, ``2**-149`` for subnormals); a magnitude is its bin's edge plus ``u`` times the
    mantissa bits the bin drops."""
    dropped = _FLOAT32_MANTISSA_BITS - mantissa_bits
    index = torch.arange(2 ** (8 + mantissa_bits), dtype=torch.int64)  # host
    lower = (index << dropped).to(torch.int32).view(torch.float32).to(torch.float64)
    exponent = (index >> mantissa_bits).clamp(min=1) - 127 - _FLOAT32_MANTISSA_BITS
    unit = ((exponent + 1023) << 52).view(torch.float64)
    return lower, unit


class MagnitudeStatistics:
    """Magnitude statistics of each agent's active task-vector elements, accumulated chunk by chunk."""

    def __init__(self, num_agents: int, mantissa_bits: int = MAGNITUDE_MANTISSA_BITS) -> None:
        if not 0 <= mantissa_bits <= _FLOAT32_MANTISSA_BITS:
            raise ValueError(f"mantissa_bits={mantissa_bits} must be between 0 and {_FLOAT32_MANTISSA_BITS}")
        self.num_agents = num_agents
        self.mantissa_bits = mantissa_bits
        bins = 2 ** (9 + mantissa_bits)  # positive values, then negative ones
        self._counts = torch.zeros(num_agents, bins, dtype=torch.int64)  # host
        self._remainders = torch.zeros(num_agents, bins, dtype=torch.int64)  # host
        self._packed = torch.zeros(num_agents, bins, dtype=torch.int64)  # host; moves to the values' device
        self._pending = [0] * num_agents
        #: float64 ``(num_agents,)``: ``sum tau**2`` of each agent's active values.
        self.square_sums = torch.zeros(num_agents, dtype=torch.float64)  # host

    @classmethod
    def zeros(cls, num_agents: int, mantissa_bits: int = MAGNITUDE_MANTISSA_BITS) -> MagnitudeStatistics:
        return cls(num_agents, mantissa_bits)

    @property
    def relative_bin_width(self) -> float:
        """``d``: every bin of normal magnitudes ``[lo, hi)`` has ``hi / lo <= 1 + d``."""
        return 2.0**-self.mantissa_bits

    @property
    def fourth_power_relative_error(self) -> float:
        """The bound on the estimate of ``sum tau**4``: at most this much below the truth, relatively."""
        d = self.relative_bin_width
        return 1.5 * d**2 + 4 * d**3 + d**4

    @property
    def counts(self) -> torch.Tensor:
        """int64 ``(num_agents, bins)``: elements per ``|tau|`` bin (both signs)."""
        self._unpack()
        return _fold_signs(self._counts)

    @property
    def sums(self) -> torch.Tensor:
        """float64 ``(num_agents, bins)``: the sum of ``|tau|`` per bin (both signs), exact up to rounding."""
        return _fold_signs(self._signed_sums())

    @property
    def power_sums(self) -> torch.Tensor:
        """float64 ``(num_agents, 4)``: ``sum tau``, ``sum tau**2`` and estimates of ``sum tau**3``, ``sum tau**4``."""
        return self._power_sums(self._signed_sums())

    def _signed_sums(self) -> torch.Tensor:
        """The exact magnitude sums (float64) of the signed bins, positive bins first."""
        self._unpack()
        lower, unit = _bin_lower_edges_and_units(self.mantissa_bits)
        counts = self._counts
        sums = counts.to(torch.float64) * lower.repeat(2) + self._remainders.to(torch.float64) * unit.repeat(2)
        return sums.where(counts > 0, 0.0)  # empty bins of inf / NaN magnitudes: 0

    def _power_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """:attr:`power_sums` from the signed bins' sums (every value at its bin's mean for the powers 3 and 4)."""
        half = sums.shape[1] // 2
        sign = torch.ones(sums.shape[1], dtype=torch.float64)  # host
        sign[half:] = -1.0
        mean = sums / self._counts.clamp(min=1)  # each bin's mean magnitude (0 in empty bins)
        out = torch.empty(self.num_agents, 4, dtype=torch.float64)  # host
        out[:, 0] = (sums * sign).sum(dim=1)
        out[:, 1] = self.square_sums
        out[:, 2] = (sums * mean * mean * sign).sum(dim=1)
        out[:, 3] = (sums * mean * mean * mean).sum(dim=1)
        return out

    def add_histogram(
        self,
        t: int,
        values: torch.Tensor,
        *,
        zero_filled: bool = False,
        finite: bool = False,
        workspace: MagnitudeWorkspace | None = None,
    ) -> int:
        """Add float32 values of agent ``t`` to its histogram (not to :attr:`square_sums`)."""
        values = values.reshape(-1).contiguous()
        layout = _packing(self.mantissa_bits)
        if self._packed.device != values.device:
            self._unpack()
            self._packed = self._packed.to(values.device)
        nonfinite_bins = None if finite else _nonfinite_bins(self.mantissa_bits, values.device)
        added = 0
        for start in range(0, values.numel(), layout.capacity):
            part = values[start : start + layout.capacity]
            n = part.numel()
            if self._pending[t] + n > layout.capacity:
                self._unpack(t)
            if workspace is None:
                wide, narrow = _new_buffers(n, part.device)
            else:
                wide, narrow = workspace.buffers(n, part.device)
            bins, dropped = narrow[0], narrow[1]
            bits = part.view(torch.int32)
            torch.bitwise_right_shift(bits, layout.dropped_bits, out=bins)
            bins.bitwise_and_(2 * layout.magnitude_bins - 1)  # the sign bit shifted in above it: 0 or 1
            torch.bitwise_and(bits, layout.dropped_mask, out=dropped)
            index, packed = wide
            index.copy_(bins)
            packed.copy_(dropped)
            packed.add_(1 << layout.shift)
            accumulator = self._packed[t]
            zero_bins = accumulator[:: layout.magnitude_bins]  # a view of the bins of +0 and -0
            zeros_before = zero_bins.clone() if zero_filled else None
            nonfinite_before = None if nonfinite_bins is None else accumulator[nonfinite_bins]
            accumulator.scatter_add_(0, index, packed)
            self._pending[t] += n
            added += n
            if zeros_before is not None:  # take the zeros out again
                added -= int(((zero_bins - zeros_before) >> layout.shift).sum())
                zero_bins.copy_(zeros_before)
            if nonfinite_before is not None and nonfinite_bins is not None:
                arrived = int(((accumulator[nonfinite_bins] - nonfinite_before) >> layout.shift).sum())
                if arrived:  # take NaN and inf out again, then put the infs back (remainder 0)
                    accumulator[nonfinite_bins] = nonfinite_before
                    positive, negative = int((part == math.inf).sum()), int((part == -math.inf).sum())
                    positive_bin, negative_bin = (255 << self.mantissa_bits) + layout.magnitude_bins * torch.arange(
                        2
                    )  # host
                    accumulator[positive_bin] += positive << layout.shift
                    accumulator[negative_bin] += negative << layout.shift
                    added += positive + negative - arrived
        return added

    def add_values(
        self, t: int, values: torch.Tensor, *, zero_filled: bool = False, workspace: MagnitudeWorkspace | None = None
    ) -> int:
        """Add float32 values of agent ``t``: to its histogram (:meth:`add_histogram`) and :attr:`square_sums`."""
        squares = sum_of_squares(values, workspace)
        finite = math.isfinite(float(squares))
        if not finite:  # NaN left out; inf counts
            values = values[~torch.isnan(values)]
            squares = sum_of_squares(values)
        self.square_sums[t] += squares.to(self.square_sums.device)
        return self.add_histogram(t, values, zero_filled=zero_filled, finite=finite, workspace=workspace)

    def update(self, deltas: torch.Tensor, mask: torch.Tensor) -> None:
        """Add one chunk: float32 task vectors ``(num_agents, n)`` and their activity mask (same shape)."""
        for t in range(self.num_agents):
            values = deltas[t][mask[t]]
            if values.numel():
                self.add_values(t, values)

    def add(self, other: MagnitudeStatistics) -> None:
        """Add ``other``'s statistics (same agents and resolution; on any device) to this object's."""
        if (other.num_agents, other.mantissa_bits) != (self.num_agents, self.mantissa_bits):
            raise ValueError("cannot add magnitude statistics of other agents or another resolution")
        self._unpack()
        other._unpack()
        self._counts += other._counts.to(self._counts.device)
        self._remainders += other._remainders.to(self._remainders.device)
        self.square_sums += other.square_sums.to(self.square_sums.device)

    def all_reduce(self, ctx: DistContext) -> None:
        """Sum every rank's statistics into this object (no-op in a single process)."""
        self._unpack()
        for tensor in (self._counts, self._remainders, self.square_sums):
            ctx.all_reduce_sum(tensor)

    def settle(self) -> None:
        """Move the packed counts (on the last values' device) into the host totals: later reads need no device."""
        self._unpack()

    def _unpack(self, t: int | None = None) -> None:
        """Move the packed counts and remainders of agent ``t`` (default: all) into the int64 totals."""
        agents = range(self.num_agents) if t is None else [t]
        layout = _packing(self.mantissa_bits)
        for a in agents:
            if not self._pending[a]:
                continue
            packed = self._packed[a]
            self._counts[a] += (packed >> layout.shift).to(self._counts.device)
            self._remainders[a] += (packed & ((1 << layout.shift) - 1)).to(self._remainders.device)
            packed.zero_()
            self._pending[a] = 0

    def count(self, t: int) -> int:
        self._unpack(t)
        return int(self._counts[t].sum())

    def summary(self, t: int, numel: int | None = None) -> dict[str, float | int]:
        """Agent ``t``'s statistics (NaN where undefined, e.g. for an agent without active elements)."""
        signed = self._signed_sums()
        counts, magnitude_sums = self.counts[t], _fold_signs(signed)[t]
        n = int(counts.sum())
        sums = self._power_sums(signed)[t].tolist()
        mean = sums[0] / n if n else math.nan
        variance = sums[1] / n - mean * mean if n else math.nan
        out: dict[str, float | int] = {
            "count": n,
            "mean_abs": float(magnitude_sums.sum()) / n if n else math.nan,
            "mean": mean,
            "std": math.sqrt(max(variance, 0.0)) if n else math.nan,
            "excess_kurtosis": excess_kurtosis(n, sums),
            "gini": histogram_gini(counts, magnitude_sums),
        }
        for key, fraction in TOP_FRACTIONS.items():
            out[key] = histogram_top_mass(counts, magnitude_sums, fraction)
        if numel is not None:
            out["gini_masked"] = histogram_gini(counts, magnitude_sums, zeros=numel - n)
            out["excess_kurtosis_masked"] = excess_kurtosis(numel, sums)
        return out

    def coarse_histogram(self, bins_per_octave: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """For plots: the ``|tau|`` histogram at ``bins_per_octave`` (a power of two), first to last nonempty bin."""
        bits = int(math.log2(bins_per_octave))
        if 2**bits != bins_per_octave or bits > self.mantissa_bits:
            raise ValueError(f"bins_per_octave={bins_per_octave} must be a power of two up to {2**self.mantissa_bits}")
        group = 2 ** (self.mantissa_bits - bits)
        coarse = self.counts.reshape(self.num_agents, -1, group).sum(dim=2)
        nonempty = coarse.sum(dim=0).nonzero().flatten()
        if nonempty.numel() == 0:
            edges = torch.zeros(0, dtype=torch.float64)  # host
            return edges, torch.zeros(self.num_agents, 0, dtype=torch.int64)  # host
        first, last = int(nonempty[0]), int(nonempty[-1])
        return magnitude_bin_edges(first, last + 1, bits), coarse[:, first : last + 1]
