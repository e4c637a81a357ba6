"""Orderings as ranks: argmax/argmin, max/min with their index, topk, sort, kthvalue, median."""

from __future__ import annotations

import torch

from . import bounds
from .scans import holds

aten = torch.ops.aten


def _position_of(x, dim: int | None, keepdim: bool, largest: bool):
    """``argmax`` (``largest``) or ``argmin`` as two reductions a kernel fuses: the row's
    extreme (NaN where the row has one, as torch's), then the first position holding it
    (a NaN's where it is NaN; -0.0 and 0.0 alike, as torch compares them)."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    if x.dim() == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    dim = dim % x.dim()
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    extreme = x.amax(dim, keepdim=True) if largest else x.amin(dim, keepdim=True)
    n = x.shape[dim]
    position = torch.arange(n, device=x.device).reshape([n] + [1] * (x.dim() - 1 - dim))
    return torch.where(holds(x, extreme), position, n).amin(dim, keepdim=keepdim)


def _argmax(x, dim=None, keepdim=False):
    if x.dtype == torch.bool:
        return NotImplemented  # eager refuses bools: so does the graph, in its eager step
    return _position_of(x, dim, keepdim, largest=True)


def _argmin(x, dim=None, keepdim=False):
    if x.dtype == torch.bool:
        return NotImplemented
    return _position_of(x, dim, keepdim, largest=False)


# topk of up to this many is that many passes over the row (a mixture of experts' top 2
# of 8); more stays ATen's sort-based kernel
TOPK_PASSES = 4


def _topk(x, k, dim=-1, largest=True, sorted=True):
    """The ``k`` largest of each row as ``k`` passes: each the largest of the elements not
    taken yet (NaN the largest, as torch's) and the first position holding it. Ties go
    to the lowest position (torch leaves their order open). The smallest, and more than
    TOPK_PASSES: the row sorted by ranks (``_sorted``), its first ``k``."""
    if type(k) is not int or x.dim() == 0 or not 0 <= k <= x.shape[dim]:
        return NotImplemented  # (eager's error past the row)
    if _ties_likely(x):
        return NotImplemented
    if not largest or not 0 < k <= TOPK_PASSES:
        made = _sorted(x, dim, descending=largest)
        return made if made is NotImplemented else tuple(t.narrow(dim, 0, k) for t in made)
    rows = x.movedim(dim, -1)
    n = rows.shape[-1]
    position = torch.arange(n, device=x.device)
    taken = torch.zeros(rows.shape, dtype=torch.bool, device=x.device)
    values, indices = [], []
    for _ in range(k):
        top = torch.where(taken, float("-inf"), rows).amax(-1, keepdim=True)
        at = torch.where(holds(rows, top) & ~taken, position, n).amin(-1, keepdim=True)
        values.append(top)
        indices.append(at)
        taken = taken | (position == at)
    return torch.cat(values, -1).movedim(-1, dim), torch.cat(indices, -1).movedim(-1, dim)


def _ranks(rows, descending: bool):
    """Each element's place in its row (the last dim) sorted stably, NaN the largest as
    torch sorts: the count of the row's elements that go before it, a reduction over the
    row's pairs."""
    if rows.dtype == torch.bool:
        rows = rows.to(torch.uint8)
    mine, theirs = rows.unsqueeze(-1), rows.unsqueeze(-2)  # [..., i, 1], [..., 1, j]
    before = theirs > mine if descending else theirs < mine
    same = theirs == mine
    if rows.is_floating_point():
        nan_mine, nan_theirs = mine.isnan(), theirs.isnan()
        before = before | ((nan_theirs & ~nan_mine) if descending else (nan_mine & ~nan_theirs))
        same = same | (nan_mine & nan_theirs)
    n = rows.shape[-1]
    earlier = torch.arange(n, device=rows.device) < torch.arange(n, device=rows.device).unsqueeze(-1)  # [i, j]: j < i
    return (before | (same & earlier)).sum(-1)


def _sorted(x, dim=-1, descending=False):
    """``sort`` (stable, as ``stable=True``; torch leaves the order of ties open
    otherwise) by ranks: each place's index is the position whose rank it is (a
    reduction over the row), its value read there. The row's pairs are its work:
    past bounds.CUMSUM_WORK it stays ATen's."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    dim %= x.dim()
    n = x.shape[dim]
    if type(n) is not int or x.numel() * n > bounds.CUMSUM_WORK or x.is_complex():
        return NotImplemented
    rows = x.movedim(dim, -1)
    ranks = _ranks(rows, descending).unsqueeze(-2)  # [..., 1, i]
    place = torch.arange(n, device=x.device).unsqueeze(-1)  # [r, 1]
    indices = torch.where(ranks == place, torch.arange(n, device=x.device), 0).sum(-1)  # [..., r]
    return torch.gather(rows, -1, indices).movedim(-1, dim), indices.movedim(-1, dim)


# Where torch leaves the order of ties open (sort without stable=True, topk, kthvalue,
# median), integers and bools stay ATen's: their ties are common (a mixture of experts
# sorts its tokens' expert ids) and eager's order of them is its algorithm's; a plan
# that orders them otherwise lays out every output that follows otherwise, which
# validation then cannot compare (rewrite/validate.order_dependent_outputs).
def _ties_likely(x) -> bool:
    return not x.is_floating_point()


def _sort(x, dim=-1, descending=False):
    return NotImplemented if _ties_likely(x) else _sorted(x, dim, descending)


def _sort_stable(x, *, stable=None, dim=-1, descending=False):
    return NotImplemented if _ties_likely(x) and not stable else _sorted(x, dim, descending)


def _kthvalue(x, k, dim=-1, keepdim=False):
    """The ``k``-th smallest of each row (NaN the largest) and its position, from the sort."""
    if _ties_likely(x) or (x.dim() and not 0 < k <= x.shape[dim]):
        return NotImplemented  # (past the row: eager's error)
    made = _sorted(x, dim)
    if made is NotImplemented or x.dim() == 0:
        return made
    return tuple(t.narrow(dim, k - 1, 1) if keepdim else t.select(dim, k - 1) for t in made)


def _median_dim(x, dim, keepdim=False, ignore_nan=False):
    """The lower median of each row and its position: the sorted row's middle place, of
    the row's numbers where ``ignore_nan`` (``nanmedian``), else NaN and the first NaN's
    position where the row has one (as torch's)."""
    if _ties_likely(x):
        return NotImplemented
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    dim %= x.dim()
    made = _sorted(x, dim)
    if made is NotImplemented or x.shape[dim] == 0:
        return NotImplemented
    values, indices = made
    n = x.shape[dim]
    nan = x.isnan() if x.is_floating_point() else torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    counted = n - nan.sum(dim, keepdim=True) if ignore_nan else torch.full_like(nan.sum(dim, keepdim=True), n)
    middle = ((counted - 1) // 2).clamp(min=0)
    value, index = torch.gather(values, dim, middle), torch.gather(indices, dim, middle)
    if not ignore_nan and x.is_floating_point():  # NaN in the row: NaN, at the first NaN
        first_nan = _position_of(nan.to(torch.uint8), dim, True, largest=True)
        held = nan.any(dim, keepdim=True)
        value, index = torch.where(held, values.narrow(dim, n - 1, 1), value), torch.where(held, first_nan, index)
    return (value, index) if keepdim else (value.squeeze(dim), index.squeeze(dim))


def _median(x):
    made = _median_dim(x.reshape(-1), 0) if x.numel() else NotImplemented
    return made if made is NotImplemented else made[0]


def _nanmedian(x):
    made = _median_dim(x.reshape(-1), 0, ignore_nan=True) if x.numel() else NotImplemented
    return made if made is NotImplemented else made[0]


def _nanmedian_dim(x, dim, keepdim=False):
    return _median_dim(x, dim, keepdim, ignore_nan=True)


def _max_with_index(x, dim, keepdim=False):
    return x.amax(dim, keepdim=keepdim), _position_of(x, dim, keepdim, largest=True)


def _min_with_index(x, dim, keepdim=False):
    return x.amin(dim, keepdim=keepdim), _position_of(x, dim, keepdim, largest=False)


def _max_of_all(x):
    return x.amax() if x.numel() else NotImplemented  # (eager's error for no elements)


def _min_of_all(x):
    return x.amin() if x.numel() else NotImplemented
