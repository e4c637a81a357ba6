"""Scans as row reductions: cumsum and cumprod over a triangle of the row, running maxima and
minima, logcumsumexp."""

from __future__ import annotations

import torch

from . import bounds

aten = torch.ops.aten


def cumsum_as_row_sums(x, dim, dtype=None):
    if dtype is None and not (x.is_floating_point() or x.is_complex()):
        dtype = torch.int64  # as torch: integers and bools sum in int64
    x = x.to(dtype) if dtype is not None else x
    prefixes = _prefixes(x, dim, 0)
    if prefixes is None:
        return NotImplemented
    return prefixes.sum(-1, dtype=x.dtype).movedim(-1, dim)  # int32 stays int32


def _upto(n: int, device) -> torch.Tensor:
    """[i, j]: j <= i, the triangle of a row's prefixes."""
    index = torch.arange(n, device=device)
    return index[None, :] <= index[:, None]


def _prefixes(x, dim: int, fill=None):
    """Each element's prefix of its row, the rest ``fill``: [..., i, j] = x[..., j] where
    j <= i (``dim`` moved last), for scans done as row reductions; None past bounds.CUMSUM_WORK.
    No ``fill``: the row's first element, which every prefix holds (a neutral filler for
    a max or a min in any dtype: int64's largest is no constant a term holds exactly)."""
    n = x.shape[dim] if x.dim() else 1
    if x.dim() == 0 or x.numel() * n > bounds.CUMSUM_WORK:
        return None
    rows = x.movedim(dim, -1).unsqueeze(-2)  # [..., 1, n]
    filler = rows[..., :1] if fill is None else torch.full((), fill, dtype=x.dtype, device=x.device)
    return torch.where(_upto(n, x.device), rows, filler)


def holds(x, extreme):
    """Where ``x`` holds ``extreme``: equal to it (-0.0 and 0.0 alike, as torch compares
    them), or NaN where it is NaN (torch's max and min are NaN wherever one is)."""
    hit = x == extreme
    return hit | (extreme.isnan() & x.isnan()) if x.is_floating_point() else hit


def _running_extreme(x, dim: int, largest: bool):
    """``cummax`` / ``cummin``: the extreme of each prefix (NaN from the first NaN on) and
    the last position in the prefix holding it (torch's: ties and NaN the latest)."""
    if x.dtype == torch.bool or x.dim() == 0:
        return NotImplemented
    prefixes = _prefixes(x, dim)
    if prefixes is None:
        return NotImplemented
    values = (prefixes.amax(-1) if largest else prefixes.amin(-1)).unsqueeze(-1)
    rows = x.movedim(dim, -1).unsqueeze(-2)
    n = rows.shape[-1]
    positions = torch.where(_upto(n, x.device) & holds(rows, values), torch.arange(n, device=x.device), -1).amax(-1)
    values = values.squeeze(-1)
    return values.movedim(-1, dim), positions.movedim(-1, dim)


def _cummax(x, dim):
    return _running_extreme(x, dim, largest=True)


def _cummin(x, dim):
    return _running_extreme(x, dim, largest=False)


def _logcumsumexp(x, dim):
    """The log of each prefix's sum of exponentials, its largest taken out first (an
    infinite largest: 0 taken out, so that +inf stays inf and -inf gives -inf)."""
    if not x.is_floating_point():
        return NotImplemented
    prefixes = _prefixes(x, dim, float("-inf"))
    if prefixes is None:
        return NotImplemented
    top = prefixes.amax(-1, keepdim=True)
    top = torch.where(top.isinf(), 0.0, top)
    return (top.squeeze(-1) + (prefixes - top).exp().sum(-1).log()).movedim(-1, dim)


def _cumprod_as_row_products(x, dim, dtype=None):
    """``cumprod`` as ``cumsum`` is: each element the product over the triangle of its row
    up to it (floats only: integer products stay exact in ATen's scan)."""
    x = x.to(dtype) if dtype is not None else x
    prefixes = _prefixes(x, dim, 1) if x.is_floating_point() else None
    if prefixes is None:
        return NotImplemented
    return prefixes.prod(-1).movedim(-1, dim)
