"""Reads in another order: flip as each dim read backwards, unfold as the windows' positions,
the ``*_copy`` ops as their views copied."""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _flip_as_reads(x, dims):
    """``flip``: each flipped dim read backwards (index_select of a descending arange,
    an indexed read that the kernel computes the index of as it goes). A 0-d tensor (its
    dim 0 or -1 is itself) and no dims at all give a copy."""
    if x.dim() == 0 or not dims:
        return x.clone()
    for d in dims:
        n = x.shape[d]
        x = x.index_select(d, torch.arange(n - 1, -1, -1, device=x.device))
    return x


def _unfold_as_reads(x, dimension, size, step):
    """``Tensor.unfold``: the windows along ``dimension`` read at their positions (an
    index_select of window start times ``step`` plus offset, computed as the kernel goes),
    each window's elements last. A copy where eager returns a view (equal values). A 0-d
    tensor is one window of itself."""
    if x.dim() == 0:
        return x.reshape(1) if size == 1 else NotImplemented
    d = dimension % x.dim()
    n = (x.shape[d] - size) // step + 1
    start = torch.arange(n, device=x.device)[:, None] * step
    picked = x.index_select(d, (start + torch.arange(size, device=x.device)[None, :]).reshape(-1))
    return picked.reshape(tuple(x.shape[:d]) + (n, size) + tuple(x.shape[d + 1:])).movedim(d + 1, -1)


def _copy_of(view):
    """``<view>_copy``: the view, then a contiguous copy of it (no memory shared)."""
    def copy(x, *args, **kwargs):
        made = view(x, *args, **kwargs)
        if isinstance(made, (tuple, list)):
            return [m.clone(memory_format=torch.contiguous_format) for m in made]
        return made.clone(memory_format=torch.contiguous_format)
    return copy
