"""Task-vector statistics, accumulated chunk by chunk over a whole model.

:class:`OverlapStatistics` is the one implementation of the counts behind RAM's stage 2 (shared / unique / active
elements per agent, the overlap histogram, pairwise co-activity). The merge's statistics pass, the merge report and
the sparsity analysis (:mod:`ram_trl.analysis`) all use it. :class:`MagnitudeStatistics` accumulates the magnitude
statistics of the active elements (mean ``|tau|``, excess kurtosis, Gini coefficient, top-k L1 mass) with memory
independent of the model's size; the small stateless functions below it compute each metric, exactly on a tensor or
with a stated error bound from a histogram.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ram_trl.methods import ram
from ram_trl.methods.ties import keep_count

if TYPE_CHECKING:
    from ram_trl.distributed import DistContext

#: Up to this many agents, a chunk's masks are encoded as one subset code per element and counted with one bincount.
MAX_SUBSET_AGENTS = 12


@functools.cache
def _subset_tables(num_agents: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every subset code, its member agents ``(2**N, N)`` and its size one-hot ``(2**N, N + 1)``, as int64."""
    codes = torch.arange(2**num_agents, dtype=torch.int64)
    members = (codes.unsqueeze(1) >> torch.arange(num_agents)) & 1
    sizes = torch.nn.functional.one_hot(members.sum(dim=1), num_agents + 1)
    return members, sizes


def subset_counts(mask: torch.Tensor) -> torch.Tensor:
    """Elements per subset of active agents: ``out[code]`` counts the elements whose active agents are the bits of
    ``code`` (:func:`~ram_trl.methods.ram.subset_codes`).

    Args:
        mask: Bool tensor, or float ``0`` / ``1`` flags, of shape ``(num_agents, n)``, at most
            :data:`MAX_SUBSET_AGENTS` agents.

    Returns:
        An int64 tensor of shape ``(2**num_agents,)`` on the mask's device; sums of them over chunks feed
        :meth:`OverlapStatistics.add_subset_counts`.
    """
    num_agents = mask.shape[0]
    if num_agents > MAX_SUBSET_AGENTS:
        raise ValueError(f"subset counts take at most {MAX_SUBSET_AGENTS} agents, got {num_agents}")
    code = ram.subset_codes(mask)
    return torch.bincount(code.reshape(-1), minlength=2**num_agents).to(torch.int64)


@dataclass
class OverlapStatistics:
    """Per-agent overlap histogram and pairwise co-activity of active task-vector elements.

    ``histogram[t, k]`` counts the elements active in agent ``t`` that exactly ``k`` agents (``t`` included) update,
    for ``k = 1 .. num_agents``; column 0 is always 0. Unique elements are ``k == 1``, shared ``k >= 2``.
    ``pairwise[s, t]`` counts the elements active in both ``s`` and ``t`` (its diagonal is each agent's active count).

    Args:
        num_agents: Number of agents.
        histogram: int64 tensor of shape ``(num_agents, num_agents + 1)``.
        pairwise: int64 tensor of shape ``(num_agents, num_agents)``.
        numel: Elements counted (the model's size, or the tensor's for per-tensor statistics).
    """

    num_agents: int
    histogram: torch.Tensor
    pairwise: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int64))
    numel: int = 0

    @classmethod
    def zeros(cls, num_agents: int) -> OverlapStatistics:
        return cls(
            num_agents,
            torch.zeros(num_agents, num_agents + 1, dtype=torch.int64),
            torch.zeros(num_agents, num_agents, dtype=torch.int64),
            0,
        )

    def update(self, mask: torch.Tensor) -> None:
        """Add one chunk's activity mask (bool, or float ``0`` / ``1`` flags; shape ``(num_agents, n)``)."""
        n_agents = self.num_agents
        if n_agents <= MAX_SUBSET_AGENTS:
            self.add_subset_counts(subset_counts(mask), mask.shape[-1])
            return
        mask = mask.to(torch.bool)
        counts = ram.overlap_counts(mask)
        for k in range(1, n_agents + 1):
            at_k = counts == k
            for t in range(n_agents):
                self.histogram[t, k] += torch.count_nonzero(mask[t] & at_k)
        for s in range(n_agents):
            for t in range(s, n_agents):
                both = torch.count_nonzero(mask[s] & mask[t])
                self.pairwise[s, t] += both
                if s != t:
                    self.pairwise[t, s] += both
        self.numel += mask.shape[-1]

    def add_subset_counts(self, subsets: torch.Tensor, numel: int) -> None:
        """Add the elements counted per subset of active agents (:func:`subset_counts`) over ``numel`` elements.

        Counting subsets chunk by chunk and converting once (e.g. per tensor) costs less than :meth:`update` on
        every small chunk.
        """
        members, sizes = _subset_tables(self.num_agents)
        weighted = members * subsets.to(torch.int64).cpu().unsqueeze(1)
        self.histogram += weighted.T @ sizes
        self.pairwise += weighted.T @ members
        self.histogram[:, 0] = 0
        self.numel += numel

    def add(self, other: OverlapStatistics) -> None:
        self.histogram += other.histogram
        self.pairwise += other.pairwise
        self.numel += other.numel

    def __add__(self, other: OverlapStatistics) -> OverlapStatistics:
        """The counts of both, as a new object (e.g. to aggregate per-tensor statistics by module type)."""
        return OverlapStatistics(
            self.num_agents,
            self.histogram + other.histogram,
            self.pairwise + other.pairwise,
            self.numel + other.numel,
        )

    def active(self, t: int) -> int:
        return int(self.histogram[t, 1:].sum())

    def unique(self, t: int) -> int:
        return int(self.histogram[t, 1])

    def shared(self, t: int) -> int:
        return int(self.histogram[t, 2:].sum())

    def density(self, t: int) -> float:
        return self.active(t) / self.numel if self.numel else 0.0

    def rho(self, t: int) -> float:
        return ram.overlap_unique_ratio(self.shared(t), self.unique(t))

    def jaccard(self, s: int, t: int) -> float:
        """Jaccard index of the active sets of agents ``s`` and ``t``."""
        union = int(self.pairwise[s, s] + self.pairwise[t, t] - self.pairwise[s, t])
        return int(self.pairwise[s, t]) / union if union else 0.0

    def lambdas(self, r: float, alpha: float | None, soft: bool = False) -> list[float]:
        """Rescale factors ``lambda_t`` for RAM+ (``soft=False``, clipped at ``alpha``) or RAM+s (``soft=True``)."""
        if soft:
            return [ram.soft_rescale_factor(self.rho(t), r) for t in range(self.num_agents)]
        assert alpha is not None
        return [ram.rescale_factor(self.rho(t), r, alpha) for t in range(self.num_agents)]

    def overlap_shares(self, t: int) -> list[float]:
        """Share of agent ``t``'s active elements that exactly ``0, 1, ..., num_agents - 1`` OTHER agents also update
        (the RAM paper's figure 2, right); all zeros for an agent with no active element."""
        active = self.active(t)
        return [int(c) / active if active else 0.0 for c in self.histogram[t, 1:].tolist()]

    def element_counts(self) -> list[int]:
        """Elements updated by exactly ``k`` agents, for ``k = 0 .. num_agents`` (they sum to ``numel``).

        An element updated by ``k >= 1`` agents appears in ``k`` rows of column ``k`` of the histogram.
        """
        per_k = [int(self.histogram[:, k].sum()) // k for k in range(1, self.num_agents + 1)]
        return [self.numel - sum(per_k), *per_k]

    def union(self) -> int:
        """Elements updated by at least one agent."""
        return self.numel - self.element_counts()[0]

    def jaccard_matrix(self) -> list[list[float]]:
        """Pairwise Jaccard indices of the active sets (:meth:`jaccard`); the diagonal is 1 for an agent with any
        active element."""
        return [[self.jaccard(s, t) for t in range(self.num_agents)] for s in range(self.num_agents)]

    def all_reduce(self, ctx: DistContext) -> None:
        """Sum the counts of every rank of a distributed run into this object (no-op in a single process)."""
        if not ctx.enabled:
            return
        ctx.all_reduce_sum(self.histogram)
        ctx.all_reduce_sum(self.pairwise)
        self.numel = ctx.all_reduce_int(self.numel)

    def as_dict(self, t: int) -> dict[str, float | int | list[int]]:
        return {
            "active": self.active(t),
            "unique": self.unique(t),
            "shared": self.shared(t),
            "density": self.density(t),
            "rho": self.rho(t),
            "overlap_histogram": self.histogram[t, 1:].tolist(),
        }


# ---------------------------------------------------------------------------------------------------------------
# Magnitudes of the active task-vector elements

#: Mantissa bits kept by the |tau| histogram of :class:`MagnitudeStatistics`: ``2**7 = 128`` bins per octave. With 7
#: bits a bin is exactly the set of float32 values that truncate to one bfloat16 value.
MAGNITUDE_MANTISSA_BITS = 7

#: The top fractions of active elements whose share of the L1 mass is reported, by report key.
TOP_FRACTIONS = {"top_1pct_mass": 0.01, "top_5pct_mass": 0.05}

_FLOAT32_MANTISSA_BITS = 23
_FLOAT32_SIGN_CLEAR = 0x7FFFFFFF


def magnitude_bin(values: torch.Tensor, mantissa_bits: int = MAGNITUDE_MANTISSA_BITS) -> torch.Tensor:
    """Histogram bin of each ``|value|``: its float32 bits without the sign, keeping ``mantissa_bits`` mantissa bits.

    Bins are ordered like the magnitudes they hold. A normal float32 magnitude in ``[2**e, 2**(e + 1))`` falls in one
    of ``2**mantissa_bits`` bins of equal width ``2**(e - mantissa_bits)``, so every bin ``[lo, hi)`` of normal
    values has ``hi / lo <= 1 + 2**-mantissa_bits``. (Subnormal magnitudes, below ``2**-126``, share wider bins.)

    Args:
        values: Float32 values, any shape.
        mantissa_bits: Mantissa bits kept, 0 to 23.

    Returns:
        int32 bin indices in ``[0, 2**(8 + mantissa_bits))``, same shape as ``values``.
    """
    bits = values.contiguous().view(torch.int32) & _FLOAT32_SIGN_CLEAR
    return bits.bitwise_right_shift_(_FLOAT32_MANTISSA_BITS - mantissa_bits)


def magnitude_bin_edges(first: int, stop: int, mantissa_bits: int = MAGNITUDE_MANTISSA_BITS) -> torch.Tensor:
    """Lower edges of bins ``first .. stop`` (inclusive: ``stop`` gives the upper edge of bin ``stop - 1``), float64.

    Args:
        first: First bin index.
        stop: One past the last bin index; at most ``255 * 2**mantissa_bits`` (whose edge is ``inf``).
        mantissa_bits: As in :func:`magnitude_bin`.

    Returns:
        ``stop - first + 1`` edges.
    """
    shift = _FLOAT32_MANTISSA_BITS - mantissa_bits
    bits = (torch.arange(first, stop + 1, dtype=torch.int64) << shift).to(torch.int32)
    return bits.view(torch.float32).to(torch.float64)


class MagnitudeWorkspace:
    """Buffers that :func:`power_sums` and :meth:`MagnitudeStatistics.add_values` reuse from chunk to chunk (no
    allocation, hence no page faults, per chunk). One per thread.

    Args:
        numel: Most values a call uses them for (longer inputs allocate their own buffers).
        device: Where the values live.
    """

    def __init__(self, numel: int, device: torch.device | str = "cpu") -> None:
        self.wide = torch.empty(2, numel, dtype=torch.float64, device=device)
        self.narrow = torch.empty(2, numel, dtype=torch.int32, device=device)

    @property
    def numel(self) -> int:
        return self.wide.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.wide, self.narrow))

    def buffers(self, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(wide, narrow)``: float64 and int32 ``(2, numel)`` buffers (views of this workspace when they fit)."""
        if numel <= self.numel and self.wide.device == device:
            return self.wide[:, :numel], self.narrow[:, :numel]
        return _new_buffers(numel, device)


def _new_buffers(numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(2, numel, dtype=torch.float64, device=device),
        torch.empty(2, numel, dtype=torch.int32, device=device),
    )


def power_sums(values: torch.Tensor, workspace: MagnitudeWorkspace | None = None) -> torch.Tensor:
    """The float64 power sums ``(sum x, sum x**2, sum x**3, sum x**4)`` of float32 values.

    Each ``x**2`` is exact in float64. The rows ``(x, x**2)`` times their transpose give the sums of the powers 2 to
    4 in one pass over memory (one dot product per power would read it three times).

    Args:
        values: Float32 values, any shape.
        workspace: Buffers to compute in (else allocated).

    Returns:
        A float64 tensor of 4 elements.
    """
    values = values.reshape(-1)
    if workspace is None:
        rows, _ = _new_buffers(values.numel(), values.device)
    else:
        rows, _ = workspace.buffers(values.numel(), values.device)
    x, square = rows[0], rows[1]
    x.copy_(values)
    torch.mul(x, x, out=square)
    gram = rows @ rows.T
    return torch.stack([x.sum(), gram[0, 0], gram[0, 1], gram[1, 1]])


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
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    return float(((2 * ranks - n - 1) * x).sum()) / (n * total)


def top_mass_share(values: torch.Tensor, fraction: float) -> float:
    """Exact share of the L1 mass of ``values`` held by its ``k`` largest magnitudes.

    Args:
        values: Any shape.
        fraction: Share of the elements; ``k = max(1, floor(fraction * n))`` (:func:`ram_trl.methods.ties.keep_count`,
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


def excess_kurtosis(count: int, power_sums: Sequence[float]) -> float:
    """Excess kurtosis ``m4 / m2**2 - 3`` from the power sums of a sample (population moments).

    Args:
        count: Number of values ``n``.
        power_sums: ``(sum x, sum x**2, sum x**3, sum x**4)``.

    Returns:
        The excess kurtosis (-2 for values +-1 in equal numbers, 0 for a normal, 3 for a Laplace distribution), or
        NaN when ``n == 0`` or all values are equal.
    """
    if count == 0:
        return math.nan
    s1, s2, s3, s4 = (float(s) / count for s in power_sums)
    m2 = s2 - s1 * s1
    m4 = s4 - 4 * s1 * s3 + 6 * s1 * s1 * s2 - 3 * s1**4
    if m2 <= 0.0:
        return math.nan
    return m4 / (m2 * m2) - 3.0


def histogram_gini(counts: torch.Tensor, sums: torch.Tensor, zeros: int = 0) -> float:
    """Gini coefficient of magnitudes known only through a histogram with ordered, disjoint bins.

    Every element of a bin is taken at the bin's mean (its exact sum over its count), which is exact across bins
    and gives the smallest Gini consistent with the bins' contents: for bins ``[lo, hi)`` with ``hi / lo <= 1 + d``
    the true coefficient ``G`` satisfies ``G - d / 4 <= estimate <= G`` (within a bin of ``c`` elements the rank
    weighted sum can exceed the equal-values value by at most ``(hi - lo) c**2 / 8 <= d * sum_bin * c / 8``; summed
    over bins and divided by ``n * sum / 2`` that is at most ``d / 4``).

    Args:
        counts: Elements per bin (bins in ascending order of magnitude), int64.
        sums: Sum of the magnitudes per bin, float64.
        zeros: Extra elements of magnitude 0 (e.g. the inactive elements of a masked task vector).

    Returns:
        The estimate, or NaN when there is no nonzero mass.
    """
    counts = counts.to(torch.float64)
    sums = sums.to(torch.float64)
    total = float(sums.sum())
    n = float(counts.sum()) + zeros
    if total == 0.0:
        return math.nan
    before = torch.cumsum(counts, 0) - counts + zeros
    return float((sums * (2 * before + counts - n)).sum()) / (n * total)


def histogram_top_mass(counts: torch.Tensor, sums: torch.Tensor, fraction: float) -> float:
    """Share of the L1 mass in the top ``k`` elements, estimated from a histogram with ordered, disjoint bins.

    Whole bins are taken from the top down; from the bin that holds the ``k``-th largest element, the missing
    ``m`` elements are taken at the bin's mean. Those ``m`` elements truly sum to between ``m lo`` and ``m hi``, as
    does the estimate, so for bins with ``hi / lo <= 1 + d`` the relative error is at most ``d``:
    ``|estimate - exact| <= d * exact``.

    Args:
        counts: Elements per bin (ascending order of magnitude), int64.
        sums: Sum of the magnitudes per bin, float64.
        fraction: Share of the elements, ``k = max(1, floor(fraction * n))`` (as :func:`top_mass_share`).

    Returns:
        The estimate, or NaN when there is no nonzero mass.
    """
    total = float(sums.sum())
    n = int(counts.sum())
    if n == 0 or total == 0.0:
        return math.nan
    k = keep_count(n, fraction)
    c = counts.flip(0)
    s = sums.to(torch.float64).flip(0)
    cumulative = torch.cumsum(c, 0)
    j = int(torch.searchsorted(cumulative, torch.tensor([k], dtype=cumulative.dtype)))
    taken = int(cumulative[j] - c[j])
    mass = float(s[:j].sum()) + (k - taken) * float(s[j]) / int(c[j])
    return mass / total


@dataclass(frozen=True)
class _Packing:
    """How :class:`MagnitudeStatistics` packs a bin's count and remainder sum into one int64: ``count << shift``
    plus the sum of ``dropped_bits``-bit remainders, unpacked at the latest after ``capacity`` elements (so neither
    field can overflow)."""

    dropped_bits: int
    shift: int
    capacity: int

    @property
    def dropped_mask(self) -> int:
        return (1 << self.dropped_bits) - 1


@functools.cache
def _packing(mantissa_bits: int) -> _Packing:
    dropped = _FLOAT32_MANTISSA_BITS - mantissa_bits
    # n elements pack to at most n * 2**shift + n * 2**dropped: both fields fit while n <= 2**(shift - dropped),
    # and the int64 while 2 * shift - dropped <= 62
    shift = (62 + dropped) // 2
    return _Packing(dropped, shift, 1 << (shift - dropped))


@functools.cache
def _bin_lower_edges_and_units(mantissa_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per bin: its lower edge, and the float32 unit ``u`` of its magnitudes (``2**(e - 150)`` for the
    biased exponent ``e``, 1 for subnormals); a magnitude is its bin's edge plus ``u`` times its dropped bits."""
    dropped = _FLOAT32_MANTISSA_BITS - mantissa_bits
    index = torch.arange(2 ** (8 + mantissa_bits), dtype=torch.int64)
    lower = (index << dropped).to(torch.int32).view(torch.float32).to(torch.float64)
    exponent = (index >> mantissa_bits).clamp(min=1) - 127 - _FLOAT32_MANTISSA_BITS
    unit = ((exponent + 1023) << 52).view(torch.float64)
    return lower, unit


class MagnitudeStatistics:
    """Magnitude statistics of each agent's active task-vector elements, accumulated chunk by chunk.

    - The count and the float64 power sums ``sum tau**p`` (``p = 1..4``) of the signed values, hence the mean,
      standard deviation and excess kurtosis.
    - A fixed histogram of ``|tau|`` with ``2**mantissa_bits`` bins per octave (:func:`magnitude_bin`). Each bin
      holds its count and, exactly, the sum of its magnitudes (so the mean ``|tau|`` is exact): within a bin every
      float32 magnitude is ``u * (c + r)`` for the bin's float32 unit ``u``, a constant ``c`` of the bin and the
      ``23 - mantissa_bits`` mantissa bits ``r`` the bin drops, so the sum is ``u * (n c + sum r)`` with integer
      ``n`` and ``sum r``, accumulated in int64 in any order. Both are added with one ``scatter_add_`` per chunk, as
      ``n * 2**s + sum r`` in one int64 per bin, unpacked before the fields could overlap.

    With ``d = 2**-mantissa_bits`` (1/128 by default), for every active ``|tau| >= 2**-126`` (always the case for
    ``eps >= 2**-126``, e.g. the default 1e-5):

    - the Gini coefficient estimate is within ``[G - d/4, G]`` (:func:`histogram_gini`; 0.002 by default);
    - the top-k L1 mass shares are within a relative ``d`` of the exact ones (:func:`histogram_top_mass`; 0.8%).

    Memory: ``num_agents * 2**(8 + mantissa_bits) * 24`` bytes (768 KB per agent by default), whatever the model.

    Args:
        num_agents: Number of agents.
        mantissa_bits: Histogram resolution (see above), 0 to 23.
    """

    def __init__(self, num_agents: int, mantissa_bits: int = MAGNITUDE_MANTISSA_BITS) -> None:
        if not 0 <= mantissa_bits <= _FLOAT32_MANTISSA_BITS:
            raise ValueError(f"mantissa_bits={mantissa_bits} must be between 0 and {_FLOAT32_MANTISSA_BITS}")
        self.num_agents = num_agents
        self.mantissa_bits = mantissa_bits
        bins = 2 ** (8 + mantissa_bits)
        self._counts = torch.zeros(num_agents, bins, dtype=torch.int64)
        self._remainders = torch.zeros(num_agents, bins, dtype=torch.int64)
        self._packed = torch.zeros(num_agents, bins, dtype=torch.int64)
        self._pending = [0] * num_agents
        #: float64 ``(num_agents, 4)``: sums of ``tau``, ``tau**2``, ``tau**3``, ``tau**4``.
        self.power_sums = torch.zeros(num_agents, 4, dtype=torch.float64)

    @classmethod
    def zeros(cls, num_agents: int, mantissa_bits: int = MAGNITUDE_MANTISSA_BITS) -> MagnitudeStatistics:
        """Empty statistics of ``num_agents`` agents."""
        return cls(num_agents, mantissa_bits)

    @property
    def relative_bin_width(self) -> float:
        """``d``: every bin of normal magnitudes ``[lo, hi)`` has ``hi / lo <= 1 + d``."""
        return 2.0**-self.mantissa_bits

    @property
    def counts(self) -> torch.Tensor:
        """int64 ``(num_agents, bins)``: elements per ``|tau|`` bin."""
        self._unpack()
        return self._counts

    @property
    def remainders(self) -> torch.Tensor:
        """int64 ``(num_agents, bins)``: per bin, the sum of the mantissa bits the bin drops (see the class)."""
        self._unpack()
        return self._remainders

    @property
    def sums(self) -> torch.Tensor:
        """float64 ``(num_agents, bins)``: the sum of ``|tau|`` per bin, exact up to one final rounding."""
        lower, unit = _bin_lower_edges_and_units(self.mantissa_bits)
        counts = self.counts
        sums = counts.to(torch.float64) * lower + self.remainders.to(torch.float64) * unit
        return sums.where(counts > 0, 0.0)  # empty bins of inf / NaN magnitudes: 0

    def add_histogram(
        self,
        t: int,
        values: torch.Tensor,
        *,
        zero_filled: bool = False,
        workspace: MagnitudeWorkspace | None = None,
    ) -> int:
        """Add float32 values of agent ``t`` to its ``|tau|`` histogram (not to the power sums).

        Args:
            t: Agent index.
            values: Active task-vector values, any shape (on any device; the histogram moves to it).
            zero_filled: ``values`` is a whole chunk in which the inactive elements are 0 (e.g.
                :func:`~ram_trl.methods.ram.masked_deltas`): the elements of bin 0 are left out, which saves the
                caller a gather of the active elements. Requires every active magnitude to be at least the lower
                edge of bin 1 (``2**-133`` by default; true for any threshold ``eps >= 2**-133``).
            workspace: Buffers to compute in (else allocated).

        Returns:
            The number of elements added.
        """
        values = values.reshape(-1).contiguous()
        layout = _packing(self.mantissa_bits)
        if self._packed.device != values.device:
            self._unpack()
            self._packed = self._packed.to(values.device)
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
            torch.bitwise_and(part.view(torch.int32), _FLOAT32_SIGN_CLEAR, out=bins)
            torch.bitwise_and(bins, layout.dropped_mask, out=dropped)
            bins.bitwise_right_shift_(layout.dropped_bits)
            index, packed = wide.view(torch.int64)
            index.copy_(bins)
            packed.copy_(dropped)
            packed.add_(1 << layout.shift)
            accumulator = self._packed[t]
            kept = accumulator[0].clone() if zero_filled else None
            accumulator.scatter_add_(0, index, packed)
            self._pending[t] += n
            added += n
            if kept is not None:
                added -= int(accumulator[0] - kept) >> layout.shift
                accumulator[0] = kept
        return added

    def add_values(
        self,
        t: int,
        values: torch.Tensor,
        *,
        zero_filled: bool = False,
        workspace: MagnitudeWorkspace | None = None,
    ) -> int:
        """Add float32 values of agent ``t`` to its statistics (histogram and power sums).

        Args:
            t: Agent index.
            values: Active task-vector values, any shape.
            zero_filled: As in :meth:`add_histogram` (zeros add nothing to the power sums). Values must be finite:
                NaN or inf make ``power_sums[t, 0]`` non-finite.
            workspace: Buffers to compute in (else allocated).

        Returns:
            The number of elements added.
        """
        self.power_sums[t] += power_sums(values, workspace).to(self.power_sums.device)
        return self.add_histogram(t, values, zero_filled=zero_filled, workspace=workspace)

    def update(self, deltas: torch.Tensor, mask: torch.Tensor) -> None:
        """Add one chunk: float32 task vectors ``(num_agents, n)`` and their activity mask (same shape)."""
        for t in range(self.num_agents):
            values = deltas[t][mask[t]]
            if values.numel():
                self.add_values(t, values)

    @classmethod
    def of_values(
        cls, values: torch.Tensor, mantissa_bits: int = MAGNITUDE_MANTISSA_BITS, *, zero_filled: bool = False
    ) -> MagnitudeStatistics:
        """One agent's statistics of some active values (see :meth:`add_values`), e.g. to :meth:`add` to a total."""
        stats = cls(1, mantissa_bits)
        stats.add_values(0, values, zero_filled=zero_filled)
        return stats

    def add(self, other: MagnitudeStatistics) -> None:
        """Add ``other``'s statistics (same agents and resolution; on any device) to this object's."""
        if (other.num_agents, other.mantissa_bits) != (self.num_agents, self.mantissa_bits):
            raise ValueError("cannot add magnitude statistics of other agents or another resolution")
        self.counts.add_(other.counts.to(self._counts.device))
        self.remainders.add_(other.remainders.to(self._remainders.device))
        self.power_sums += other.power_sums.to(self.power_sums.device)

    def all_reduce(self, ctx: DistContext) -> None:
        """Sum every rank's statistics into this object (no-op in a single process)."""
        for tensor in (self.counts, self.remainders, self.power_sums):
            ctx.all_reduce_sum(tensor)

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
        return int(self.counts[t].sum())

    def summary(self, t: int, numel: int | None = None) -> dict[str, float | int]:
        """Agent ``t``'s statistics (NaN where undefined, e.g. for an agent without active elements).

        Args:
            t: Agent index.
            numel: Elements of the whole task vector. When given, the Gini coefficient and excess kurtosis of the
                masked task vector (inactive elements counted as 0, as RAM treats them) are added too.

        Returns:
            ``count``, ``mean_abs``, ``mean``, ``std``, ``excess_kurtosis``, ``gini``, ``top_1pct_mass``,
            ``top_5pct_mass`` (over the active elements) [, ``gini_masked``, ``excess_kurtosis_masked``].
        """
        n = self.count(t)
        magnitude_sums = self.sums[t]
        sums = self.power_sums[t].tolist()
        mean = sums[0] / n if n else math.nan
        variance = sums[1] / n - mean * mean if n else math.nan
        out: dict[str, float | int] = {
            "count": n,
            "mean_abs": float(magnitude_sums.sum()) / n if n else math.nan,
            "mean": mean,
            "std": math.sqrt(max(variance, 0.0)) if n else math.nan,
            "excess_kurtosis": excess_kurtosis(n, sums),
            "gini": histogram_gini(self.counts[t], magnitude_sums),
        }
        for key, fraction in TOP_FRACTIONS.items():
            out[key] = histogram_top_mass(self.counts[t], magnitude_sums, fraction)
        if numel is not None:
            out["gini_masked"] = histogram_gini(self.counts[t], magnitude_sums, zeros=numel - n)
            out["excess_kurtosis_masked"] = excess_kurtosis(numel, sums)
        return out

    def coarse_histogram(self, bins_per_octave: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``|tau|`` histogram merged to ``bins_per_octave`` (a power of two) bins per octave, over the range of
        nonempty bins of any agent, for plots.

        Returns:
            ``(edges, counts)``: float64 edges ``(m + 1,)`` and int64 counts ``(num_agents, m)``; empty when no
            agent has an active element.
        """
        bits = int(math.log2(bins_per_octave))
        if 2**bits != bins_per_octave or bits > self.mantissa_bits:
            raise ValueError(
                f"bins_per_octave={bins_per_octave} must be a power of two up to {2**self.mantissa_bits}"
            )
        group = 2 ** (self.mantissa_bits - bits)
        coarse = self.counts.reshape(self.num_agents, -1, group).sum(dim=2)
        nonempty = coarse.sum(dim=0).nonzero().flatten()
        if nonempty.numel() == 0:
            return torch.zeros(0, dtype=torch.float64), torch.zeros(self.num_agents, 0, dtype=torch.int64)
        first, last = int(nonempty[0]), int(nonempty[-1])
        return magnitude_bin_edges(first, last + 1, bits), coarse[:, first : last + 1]
