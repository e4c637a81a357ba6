"""Reductions: sums, extrema, products, any/all, means and variances, each over
its dims flattened into the last axis."""

from __future__ import annotations

import math

import torch

from ...errors import Unsupported
from .. import ops
from ..values import Computed
from .registry import handles, out_type

aten = torch.ops.aten
prims = torch.ops.prims


# --- reductions ------------------------------------------------------------------------------

def reduce_dims(tr, x, dims, keepdim: bool, op: str, out_dtype: str, out_shape):
    """Reduce ``x`` over ``dims``: permute the reduced dims last, flatten them, reduce the last axis."""
    t = tr.t
    shape = tuple(x.shape)
    rank = len(shape)
    dims = sorted({d % rank for d in dims}) if rank and dims else list(range(rank))
    v = tr.cast(tr.value(x), x.dtype, out_dtype, shape)
    if rank == 0:
        v = tr.mk(t.Reshape(v, tr.ivec((1, 1))), out_dtype, (1, 1))
        kept, red = [], [1]
    else:
        kept = [d for d in range(rank) if d not in dims]
        perm = kept + dims
        if perm != list(range(rank)):
            v = tr.mk(t.Permute(v, tr.ivec(perm)), out_dtype, tuple(shape[d] for d in perm))
        red_n = math.prod(shape[d] for d in dims)
        flat = tuple(shape[d] for d in kept) + (red_n,)
        if not kept:
            flat = (1, red_n)
        if flat != tuple(shape[d] for d in perm):
            v = tr.mk(t.Reshape(v, tr.ivec(flat)), out_dtype, flat)
        red = [red_n]
    reduced_shape = tuple(shape[d] for d in kept) + (1,) if kept else (1, 1)
    r = tr.mk(t.Reduce(op, v), out_dtype, reduced_shape)
    if tuple(out_shape) != reduced_shape:
        r = tr.mk(t.Reshape(r, tr.ivec(out_shape)), out_dtype, out_shape)
    return Computed(r, tuple(out_shape), out_dtype), red[0]


def _reduce_args(node, x, dims=None, keepdim=False, **kw):
    if dims is None:
        dims = []
    if isinstance(dims, int):
        dims = [dims]
    return list(dims), bool(keepdim)


@handles(aten.sum, prims.sum)
def _sum(tr, node, x, dims=None, keepdim=False, dtype=None, **kw):
    shape, dt = out_type(node)
    dims, keepdim = _reduce_args(node, x, dims, keepdim)
    return reduce_dims(tr, x, dims, keepdim, "sum", dt, shape)[0]


@handles(aten.amax, aten.amin)
def _amax(tr, node, x, dims=None, keepdim=False):
    shape, dt = out_type(node)
    dims, keepdim = _reduce_args(node, x, dims, keepdim)
    op = "max" if node.target.overloadpacket is aten.amax else "min"
    return reduce_dims(tr, x, dims, keepdim, op, dt, shape)[0]


@handles(aten.prod)
def _prod(tr, node, x, dim=None, keepdim=False, dtype=None):
    shape, dt = out_type(node)
    if not ops.is_float(dt):
        raise Unsupported("prod of integers (a float32 product of partial rows would round them)")
    dims, keepdim = _reduce_args(node, x, dim, keepdim)
    return reduce_dims(tr, x, dims, keepdim, "prod", dt, shape)[0]


@handles(aten.any, aten.all)
def _any_all(tr, node, x, dims=None, keepdim=False):
    """any: the count of nonzero elements is nonzero; all: the count of zeros is zero.
    Counted in float32 (exact to 2^24, and a count never returns to 0), so that a NaN is
    true, as in torch, and a reduction over no elements gives any False and all True
    (a max of flags would give -inf there)."""
    shape, _ = out_type(node)
    dims, keepdim = _reduce_args(node, x, dims, keepdim)
    t = tr.t
    test = "ne" if node.target.overloadpacket is aten.any else "eq"
    flags = tr.mk(t.Binary(test, tr.operand(x, x.shape, "float32"), tr.const(0, "float32")), "bool", tuple(x.shape))
    count, _ = reduce_dims(tr, Computed(flags, tuple(x.shape), "bool"), dims, keepdim, "sum", "float32", shape)
    return Computed(tr.mk(t.Binary(test, count.term, tr.const(0, "float32")), "bool", shape), shape, "bool")


@handles(aten.mean)
def _mean(tr, node, x, dims=None, keepdim=False, dtype=None):
    shape, dt = out_type(node)
    if not ops.is_float(dt):
        raise Unsupported("mean of integers")
    dims, keepdim = _reduce_args(node, x, dims, keepdim)
    s, n = reduce_dims(tr, x, dims, keepdim, "sum", dt, shape)
    return Computed(tr.mk(tr.t.Binary("div", s.term, tr.const(n, dt)), dt, shape), shape, dt)


@handles(prims.var)
def _var(tr, node, x, dims, correction=0.0, **kw):
    """Two-pass variance: mean first, then the mean of squared deviations (stable)."""
    shape, dt = out_type(node)
    t = tr.t
    rank = len(x.shape)
    keep_shape = tuple(1 if (d in [e % rank for e in dims]) else s for d, s in enumerate(x.shape))
    s, n = reduce_dims(tr, x, dims, True, "sum", dt, keep_shape)
    mean = tr.mk(t.Binary("div", s.term, tr.const(n, dt)), dt, keep_shape)
    xv = tr.cast(tr.value(x), x.dtype, dt, x.shape)
    dev = tr.mk(t.Binary("sub", xv, tr.mk(t.Broadcast(mean, tr.ivec(x.shape)), dt, x.shape)), dt, x.shape)
    sq = tr.mk(t.Binary("mul", dev, dev), dt, x.shape)
    ss, _ = reduce_dims(tr, Computed(sq, tuple(x.shape), dt), dims, False, "sum", dt, shape)
    return Computed(tr.mk(t.Binary("div", ss.term, tr.const(max(n - correction, 0), dt)), dt, shape), shape, dt)
