"""Views and concatenations: reshapes, permutes, expands, slices, selects,
``as_strided`` and ``cat``; a view of an input folds into its strides, of a computed
value it is an index-map term."""

from __future__ import annotations

import math

import torch

from ...errors import Unsupported
from ..plan import contiguous_strides
from ..values import BufferView, Computed, node_meta
from .registry import handles, moves_values, out_type

aten = torch.ops.aten
prims = torch.ops.prims


# --- views -----------------------------------------------------------------------------------

def _view(tr, node, x, make_term):
    """A view: folds into the strides of an input buffer, else an index-map term."""
    shape, dt = out_type(node)
    m = node_meta(node)
    if isinstance(x, BufferView) and x.foldable:
        base = node_meta(node.args[0])
        offset = x.offset + (m.storage_offset() - base.storage_offset())
        return BufferView(x.buf, shape, tuple(m.stride()), offset, dt, True)
    v = tr.value(x)
    return Computed(tr.mk(make_term(v, shape), dt, shape), shape, dt)


def _reshape_term(tr):
    return lambda v, shape: tr.t.Reshape(v, tr.ivec(shape))


@moves_values
@handles(aten.view, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze, aten.flatten,
         aten.unflatten)
def _reshape(tr, node, x, *args, **kw):
    return _view(tr, node, x, _reshape_term(tr))


@handles(aten.diagonal)
def _diagonal(tr, node, x, *args, **kw):
    """A diagonal of an input buffer: a view, folded into its strides as any view is (of a
    computed value, no index map of the schema reads one)."""
    if isinstance(x, BufferView) and x.foldable:
        return _view(tr, node, x, None)
    raise Unsupported("diagonal of a computed value")


@handles(aten.as_strided)
def _as_strided(tr, node, x, size, stride, storage_offset=None):
    """A view at given strides: folded into an input buffer's strides, as any view is; of
    a computed value, only where it reads the value's elements in their order from the
    start (the strides of ``size`` laid out contiguously, over every element of a value
    laid out so): a reshape. Group norm's decomposition on the CPU views its per-channel
    scales so."""
    base = node_meta(node.args[0])
    offset = base.storage_offset() if storage_offset is None else storage_offset
    in_order = (base.is_contiguous() and offset == base.storage_offset() and math.prod(size) == base.numel()
                and tuple(stride) == contiguous_strides(tuple(size)))
    if not (in_order or (isinstance(x, BufferView) and x.foldable)):
        raise Unsupported("as_strided of a computed value other than as a reshape")
    return _view(tr, node, x, _reshape_term(tr))  # folds where it can


@moves_values
@handles(aten.expand)
def _expand(tr, node, x, *args, **kw):
    return _view(tr, node, x, lambda v, shape: tr.t.Broadcast(v, tr.ivec(shape)))


@moves_values
@handles(prims.broadcast_in_dim)
def _broadcast_in_dim(tr, node, x, shape, bdims):
    # Insert the missing dims as size 1, then broadcast.
    inter = [1] * len(shape)
    for src, d in enumerate(bdims):
        inter[d] = x.shape[src]
    t = tr.t
    v = tr.value(x)
    if tuple(inter) != tuple(x.shape):
        v = tr.mk(t.Reshape(v, tr.ivec(inter)), x.dtype, tuple(inter))
    if tuple(inter) != tuple(shape):
        v = tr.mk(t.Broadcast(v, tr.ivec(shape)), x.dtype, tuple(shape))
    return Computed(v, tuple(shape), x.dtype)


@moves_values
@handles(aten.permute, aten.transpose, aten.t, aten.numpy_T)
def _permute(tr, node, x, *args, **kw):
    rank = len(x.shape)
    pk = node.target.overloadpacket
    if pk is aten.permute:
        perm = [d % rank for d in args[0]]
    elif pk is aten.transpose:
        perm = list(range(rank))
        a, b = args[0] % rank, args[1] % rank
        perm[a], perm[b] = perm[b], perm[a]
    else:
        perm = list(reversed(range(rank)))
    return _view(tr, node, x, lambda v, shape: tr.t.Permute(v, tr.ivec(perm)))


def norm_start(start, size):
    if start is None:
        return 0
    if start < 0:
        start += size
    return min(max(start, 0), size)


@moves_values
@handles(aten.slice)
def _slice(tr, node, x, dim=0, start=None, end=None, step=1):
    dim = dim % len(x.shape)
    s0 = norm_start(start, x.shape[dim])
    shape, _ = out_type(node)
    return _view(tr, node, x, lambda v, sh: tr.t.Slice(v, dim, s0, step, shape[dim]))


@moves_values
@handles(aten.select)
def _select(tr, node, x, dim, index):
    dim = dim % len(x.shape)
    index = index % x.shape[dim]
    t = tr.t

    def term(v, shape):
        sliced_shape = tuple(1 if d == dim else s for d, s in enumerate(x.shape))
        sliced = tr.mk(t.Slice(v, dim, index, 1, 1), x.dtype, sliced_shape)
        return t.Reshape(sliced, tr.ivec(shape))
    return _view(tr, node, x, term)


def concat(tr, parts, dim: int, dt: str) -> Computed:
    """``parts`` (entries of one rank) joined along ``dim``, cast to ``dt``."""
    v = tr.cast(tr.value(parts[0]), parts[0].dtype, dt, parts[0].shape)
    sofar = list(parts[0].shape)
    for p in parts[1:]:
        sofar[dim] += p.shape[dim]
        v = tr.mk(tr.t.Cat(v, tr.cast(tr.value(p), p.dtype, dt, p.shape), dim), dt, tuple(sofar))
    return Computed(v, tuple(sofar), dt)


@moves_values
@handles(aten.cat)
def _cat(tr, node, tensors, dim=0):
    shape, dt = out_type(node)
    parts = [p for p in tensors if math.prod(p.shape) > 0 or len(p.shape) == len(shape)]
    parts = [p for p in parts if len(p.shape) == len(shape)]
    dim = dim % len(shape)
    if not parts:
        raise Unsupported("cat of nothing")
    return concat(tr, parts, dim, dt)


def part(tr, x, dim: int, start: int, size: int):
    """``x`` narrowed to ``[start, start + size)`` along ``dim``: a strided view of an
    input buffer, else a ``Slice`` term."""
    sub_shape = list(x.shape)
    sub_shape[dim] = size
    if isinstance(x, BufferView) and x.foldable:
        offset = x.offset + start * x.strides[dim]
        return BufferView(x.buf, tuple(sub_shape), x.strides, offset, x.dtype, True)
    term = tr.mk(tr.t.Slice(tr.value(x), dim, start, 1, size), x.dtype, tuple(sub_shape))
    return Computed(term, tuple(sub_shape), x.dtype)
