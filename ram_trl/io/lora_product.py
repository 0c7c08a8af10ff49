"""The product ``B @ A`` of LoRA factors with bits that depend on neither the row blocking nor the BLAS (why and how:
docs/ci.md, "Bits that depend on the machine")."""

from __future__ import annotations

import torch

#: Elements of the float64 BLAS product per call (32 MB): few calls, since every call may start the BLAS's threads.
PRODUCT_ELEMENTS = 1 << 22

#: Elements checked at a time: below ATen's grain size (32768), so the elementwise passes run on the calling thread
#: without an OpenMP region each (on a busy machine every region waits for all its threads), in cache.
BLOCK_ELEMENTS = 32000

#: The float64 BLAS product the check starts from (any summation order; the tests swap in other orders).
_float64_product = torch.matmul

# The bound's constant per rank: 8 (r + 2) u covers the two summation errors (2.03 r u T), the norms' own rounding and
# the rounding of s +- bound (a few u of |s| + bound), with a margin of about four.
_UNIT = 2.0**-53


def lora_product(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``b @ a`` in float32, each element the float64 sum of its products in rank order, rounded once."""
    if b.dim() != 2 or a.dim() != 2 or b.shape[1] != a.shape[0]:
        raise ValueError(f"LoRA factors of shapes {tuple(b.shape)} and {tuple(a.shape)} do not multiply")
    m, r = b.shape
    n = a.shape[1]
    out = torch.empty(m, n, dtype=torch.float32, device=b.device)
    if m == 0 or n == 0:
        return out
    if r == 0:
        return out.zero_()
    b64 = b.to(torch.float32).to(torch.float64)
    a64 = a.to(torch.float32).to(torch.float64)
    col_norms = torch.linalg.vector_norm(a64, dim=0)
    row_norms = torch.linalg.vector_norm(b64, dim=1).mul_(8.0 * (r + 2) * _UNIT)
    unsure = []
    product_rows, block_rows = max(1, PRODUCT_ELEMENTS // n), max(1, BLOCK_ELEMENTS // n)
    for first in range(0, m, product_rows):
        product = _float64_product(b64[first : first + product_rows], a64)
        for start in range(first, first + product.shape[0], block_rows):
            stop = min(start + block_rows, first + product.shape[0])
            rows = product[start - first : stop - first]
            unsure.append(_block(rows, row_norms[start:stop], col_norms, out[start:stop], start))
    unsure = [u for u in unsure if u is not None]
    # sum again in rank order where the float64 product's error bound straddles a float32 rounding boundary
    if unsure:
        rows = torch.cat([u[0] for u in unsure])
        cols = torch.cat([u[1] for u in unsure])
        products = b64[rows] * a64[:, cols].T  # exact
        total = torch.zeros(rows.numel(), dtype=torch.float64, device=b64.device)
        for k in range(r):
            total += products[:, k]
        out[rows, cols] = total.to(torch.float32)
    return out


def _block(
    s: torch.Tensor, row_bound: torch.Tensor, col_norms: torch.Tensor, out: torch.Tensor, first: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows ``first:`` of :func:`lora_product` into ``out`` from the float64 product ``s``; returns the unsure ones."""
    torch.add(s, 0.0, out=out)  # rounded once; a zero becomes +0 (-0 + 0 = +0)
    rows, cols = row_bound[:, None], col_norms[None, :]
    hi = torch.addcmul(s, rows, cols, out=torch.empty_like(out))  # float64 sums, rounded once to float32
    lo = torch.addcmul(s, rows, cols, value=-1.0, out=torch.empty_like(out))
    unsure = torch.ne(lo.view(torch.int32), hi.view(torch.int32))
    if not unsure.any():
        return None
    unsure_rows, unsure_cols = unsure.nonzero(as_tuple=True)
    return unsure_rows.add_(first), unsure_cols
