"""Writes at indices: index_put, scatter and its reductions, histc, put, masked, diagonal and
strided scatters, each position reading the values that name it."""

from __future__ import annotations

import math

import torch

from . import bounds
from .scans import cumsum_as_row_sums

aten = torch.ops.aten


def _nan_where(wrong, out):
    """``out``, NaN throughout where ``wrong`` (a 0-d bool: an argument eager raises on), for
    floats: a kernel cannot raise."""
    if not out.is_floating_point():
        return out
    return torch.where(wrong, torch.full((), math.nan, dtype=out.dtype, device=out.device), out)


def _index_put_at_many(x, indices, values, accumulate=False):
    """``index_put`` with one index tensor of several positions along one dim (a static
    cache's prompt written at its positions; index_copy, index_add and index_fill come
    here decomposed): for each position of ``x`` the last index naming it (a reduction
    over the indices), then that slot of ``values`` read there (an indexed read), ``x``
    elsewhere; where accumulating, each position's sum of the values naming it. An index
    outside ``x`` (eager raises) gives NaN throughout, for floats. One position is the
    pointwise write of schema/handlers/indexing.py; a boolean mask (nonzero: a shape from
    the values) and writes past bounds.CUMSUM_WORK comparisons stay ATen's."""
    given = [d for d, i in enumerate(indices) if i is not None]
    if len(given) != 1:
        return NotImplemented
    (dim,) = given
    index = indices[dim]
    n, count = x.shape[dim] if x.dim() else 0, index.numel()
    if (index.dim() != 1 or index.dtype == torch.bool or index.is_floating_point() or type(n) is not int
            or type(count) is not int or count <= 1):
        return NotImplemented
    slots = list(x.shape)
    slots[dim] = count
    rest = math.prod(slots) // count
    if n * count * (rest if accumulate else 1) > bounds.CUMSUM_WORK:
        return NotImplemented
    written = torch.broadcast_to(values.to(x.dtype), slots)
    wrapped = torch.where(index < 0, index + n, index)
    naming = wrapped.unsqueeze(0) == torch.arange(n, device=x.device).unsqueeze(1)  # [position, index]
    if accumulate:  # positions no index names keep x as it is (its -0.0 too: x + 0 would not)
        summed = torch.where(naming, written.movedim(dim, -1).unsqueeze(-2), 0).sum(-1, dtype=x.dtype)
        named = naming.any(1).reshape([n] + [1] * (x.dim() - 1 - dim))
        out = torch.where(named, x + summed.movedim(-1, dim), x)
    else:
        last = torch.where(naming, torch.arange(count, device=x.device), -1).amax(1)  # [position]
        taken = written.index_select(dim, last.clamp(min=0))
        here = (last >= 0).reshape([n] + [1] * (x.dim() - 1 - dim))
        out = torch.where(here, taken, x)
    return _nan_where(((index < -n) | (index >= n)).any(), out)


def _index_put_in_place_at_many(x, indices, values, accumulate=False):
    made = _index_put_at_many(x, indices, values, accumulate)
    return made if made is NotImplemented else x.copy_(made)


def _histc(x, bins=100, min=0, max=0):
    """``histc`` with its range given (a mixture of experts' tokens per expert): each bin's
    count of the elements that fall in it (bins x elements comparisons, a reduction),
    each element's bin ``(x - min) * bins / (max - min)`` as torch computes it, the top
    edge in the last bin, elements outside the range (and NaN) in none. A range taken
    from the data (min = max) stays ATen's, and so do half widths, whose bins ATen finds
    in its own rounding (an element on an edge may land in the next bin in float32)."""
    if (not max > min or x.numel() * bins > bounds.CUMSUM_WORK or x.dtype in (torch.bool, torch.float16, torch.bfloat16)
            or (not x.is_floating_point() and x.dtype.itemsize > 4)):
        return NotImplemented
    value = x.reshape(-1)
    value = value if value.is_floating_point() else value.to(torch.float32)
    inside = (value >= min) & (value <= max)
    value = torch.where(inside, value, min)  # NaN and infinities are in no bin, and no integer
    which = ((value - min) * bins / (max - min)).floor().to(torch.int64)
    which = torch.where(value == max, bins - 1, which)
    falls = (which.unsqueeze(0) == torch.arange(bins, device=x.device).unsqueeze(1)) & inside.unsqueeze(0)
    return falls.sum(1).to(x.dtype)


# The reductions a scatter combines the values naming one position with (as
# scatter_reduce names them), and the value that leaves each unchanged where it has one.
_SCATTER_REDUCTIONS = {"sum": 0, "prod": 1, "amax": float("-inf"), "amin": float("inf"), "mean": 0, "assign": None}


def _scattered(x, dim, index, src, reduce: str, include_self: bool = True):
    """``scatter_reduce`` (``scatter``: ``reduce`` "assign", the last value naming a
    position) as reductions over the index: for each position along ``dim`` of each row,
    the values whose index names it, combined (with ``x``'s own where ``include_self``);
    positions no index names keep ``x``'s value as it is (-0.0 too), and so do rows past
    the index's extent. An index outside ``x`` (eager raises) gives NaN throughout, for
    floats. Each position compares every index of its row: past bounds.CUMSUM_WORK comparisons,
    and for bools or an integer mean, the op stays ATen's."""
    if x.dim() == 0 and index.dim() == 0:  # a scalar: its one position
        made = _scattered(x.reshape(1), 0, index.reshape(1), src.reshape(1) if isinstance(src, torch.Tensor) else src,
                          reduce, include_self)
        return made if made is NotImplemented else made.reshape(())
    if x.dim() == 0 or index.dim() != x.dim() or x.dtype == torch.bool or index.numel() == 0:
        return NotImplemented
    dim %= x.dim()
    n, extent = x.shape[dim], list(index.shape)
    if type(n) is not int or n * index.numel() > bounds.CUMSUM_WORK or (reduce == "mean" and not x.is_floating_point()):
        return NotImplemented
    if isinstance(src, torch.Tensor):
        for d, e in enumerate(extent):
            src = src.narrow(d, 0, e)
        src = src.to(x.dtype)
    else:
        src = torch.full(extent, src, dtype=x.dtype, device=x.device)
    region = x
    for d, e in enumerate(extent):
        if d != dim:
            region = region.narrow(d, 0, e)
    base = region.movedim(dim, -1)  # [..., n]
    values = src.movedim(dim, -1).unsqueeze(-2)  # [..., 1, m]
    idx = index.movedim(dim, -1).unsqueeze(-2)
    naming = idx == torch.arange(n, device=x.device).unsqueeze(-1)  # [..., n, m]: value j names position i
    named = naming.any(-1)
    if reduce == "assign":
        m = extent[dim]
        last = torch.where(naming, torch.arange(m, device=x.device), -1).amax(-1)  # [..., n]
        combined = torch.gather(values.squeeze(-2), -1, last.clamp(min=0))
    elif reduce in ("amax", "amin"):
        # integers: the row's least (greatest) value fills the others, no larger than any named
        fill = _SCATTER_REDUCTIONS[reduce] if x.is_floating_point() else (
            values.amin(-1, keepdim=True) if reduce == "amax" else values.amax(-1, keepdim=True))
        picked = torch.where(naming, values, fill)
        combined = picked.amax(-1) if reduce == "amax" else picked.amin(-1)
        if include_self:
            combined = torch.maximum(base, combined) if reduce == "amax" else torch.minimum(base, combined)
    else:
        picked = torch.where(naming, values, _SCATTER_REDUCTIONS[reduce])
        combined = picked.prod(-1) if reduce == "prod" else picked.sum(-1, dtype=x.dtype)
        if include_self:
            combined = base * combined if reduce == "prod" else base + combined
        if reduce == "mean":
            combined = combined / (naming.sum(-1) + int(include_self))
    out = torch.where(named, combined, base).movedim(-1, dim)
    partial = [d for d, e in enumerate(extent) if d != dim and e < x.shape[d]]
    if partial:  # the rows past the index's extent keep x
        pads = [p for d in reversed(range(x.dim())) for p in (0, x.shape[d] - out.shape[d])]
        inside = torch.ones((), dtype=torch.bool, device=x.device)
        for d in partial:
            inside = inside & (torch.arange(x.shape[d], device=x.device) < extent[d]).reshape(
                [-1] + [1] * (x.dim() - 1 - d))
        out = torch.where(inside, aten.constant_pad_nd(out, pads, 0), x)
    return _nan_where(((index < 0) | (index >= n)).any(), out)


def _scatter_many(x, dim, index, src):
    """``scatter`` where a row's index names several positions, or reads part of a larger
    source (one each, of the index's shape: schema/handlers/indexing.py's pointwise form)."""
    one_per_row = index.dim() == x.dim() and index.shape[dim] == 1 and all(
        i == s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != dim % max(x.dim(), 1))
    if one_per_row and (not isinstance(src, torch.Tensor) or src.shape == index.shape):
        return NotImplemented
    return _scattered(x, dim, index, src, "assign")


_SCATTER_NAMES = {"add": "sum", "multiply": "prod"}  # scatter's reduce= as scatter_reduce names it


def _scatter_reducing(x, dim, index, src, reduce):
    return _scattered(x, dim, index, src, _SCATTER_NAMES[reduce])


def _scatter_add(x, dim, index, src):
    return _scattered(x, dim, index, src, "sum")


def _scatter_reduce(x, dim, index, src, reduce, include_self=True):
    return _scattered(x, dim, index, src, reduce, include_self)


def _index_reduce(x, dim, index, source, reduce, include_self=True):
    """``index_reduce``: ``scatter_reduce`` with the index repeated along the other dims."""
    if index.dim() != 1:
        return NotImplemented
    if x.dim() == 0:  # a scalar: its one position
        made = _index_reduce(x.reshape(1), 0, index, source.reshape(1), reduce, include_self)
        return made if made is NotImplemented else made.reshape(())
    dim %= x.dim()
    spread = index.reshape([1] * dim + [-1] + [1] * (source.dim() - dim - 1)).expand(source.shape)
    return _scattered(x, dim, spread, source, reduce, include_self)


def _put(x, index, source, accumulate=False):
    """``put``: ``index_put`` along the flattened tensor (at one position, the pointwise
    write of schema/handlers/indexing.py)."""
    flat, where, values = x.reshape(-1), [index.reshape(-1)], source.reshape(-1)
    made = _index_put_at_many(flat, where, values, accumulate)
    if made is NotImplemented and index.numel() == 1:
        made = aten.index_put(flat, where, values, accumulate)
    return made if made is NotImplemented else made.reshape(x.shape)


def _masked_scatter(x, mask, source):
    """``masked_scatter``: where the mask holds, the next value of ``source`` in order,
    each position reading the one its count of earlier held places names (a prefix sum);
    NaN throughout, for floats, where the mask holds more places than ``source`` has values."""
    held = torch.broadcast_to(mask, x.shape).reshape(-1)
    if x.numel() ** 2 > bounds.CUMSUM_WORK or x.numel() == 0:
        return NotImplemented
    count = cumsum_as_row_sums(held, 0)
    picked = source.reshape(-1)[(count - 1).clamp(min=0, max=max(source.numel() - 1, 0))]
    out = torch.where(held, picked.to(x.dtype), x.reshape(-1)).reshape(x.shape)
    return _nan_where(count[-1] > source.numel(), out)  # more places than the source has values


def _diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    """``diagonal_scatter``: ``src`` on the diagonal (``j - i == offset`` over ``dim1`` and
    ``dim2``), each place reading its diagonal element (an indexed read), ``x`` elsewhere."""
    if x.dim() < 2:
        return NotImplemented
    dim1, dim2 = dim1 % x.dim(), dim2 % x.dim()
    moved = x.movedim((dim1, dim2), (-2, -1))  # [..., n1, n2]
    n1, n2 = moved.shape[-2:]
    i = torch.arange(n1, device=x.device).unsqueeze(-1)
    j = torch.arange(n2, device=x.device)
    on = (j - i) == offset
    length = src.shape[-1]
    if length == 0:
        return x.clone()
    # each place's element along the diagonal (its row, or its column below the main one)
    place = torch.broadcast_to(i if offset >= 0 else j, (n1, n2)).clamp(max=length - 1)
    values = src.index_select(-1, place.reshape(-1)).reshape(tuple(src.shape[:-1]) + (n1, n2))
    return torch.where(on, values.to(x.dtype), moved).movedim((-2, -1), (dim1, dim2))


def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    """``as_strided_scatter`` of a contiguous ``x``: ``put`` at the view's positions in
    ``x``'s elements (where the view meets a position twice, the later element, as eager's
    copy into it leaves it)."""
    if not x.is_contiguous() or len(size) != len(stride) or any(type(n) is not int for n in (*size, *stride)):
        return NotImplemented
    positions = torch.full((), storage_offset or 0, dtype=torch.int64, device=x.device)
    for d, (n, step) in enumerate(zip(size, stride)):
        positions = positions + (torch.arange(n, device=x.device) * step).reshape([n] + [1] * (len(size) - 1 - d))
    return _put(x, positions, src)
