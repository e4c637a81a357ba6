"""Reads and writes at indices: index_select, embedding, ``x[index]``, gather,
padding, splits, slice and select scatters, and scatter / index_put where one element
per row is written."""

from __future__ import annotations

import math

import torch

from ...errors import Unsupported
from .. import ops
from ..values import BufferView, Computed
from .pointwise import filled
from .reductions import reduce_dims
from .registry import handles, out_type
from .views import concat, norm_start, part

aten = torch.ops.aten


# --- indexing: reads at indices the kernel loads ----------------------------------------------

def _index_entry(index) -> None:
    if not isinstance(index, (BufferView, Computed)) or not ops.is_int(index.dtype):
        raise Unsupported("an index that is not an integer tensor")


def _take(tr, x, dim: int, index) -> Computed:
    """``x``'s slices along ``dim`` at the values of ``index`` (any shape, flattened), as
    ``index_select``."""
    _index_entry(index)
    if not x.shape:  # a scalar's index_select: the scalar as one element
        x = _shaped(tr, Computed(tr.value(x), (), x.dtype), (1,))
    n = math.prod(index.shape)
    t = tr.t
    iv = tr.value(index)
    if tuple(index.shape) != (n,):
        iv = tr.mk(t.Reshape(iv, tr.ivec((n,))), index.dtype, (n,))
    shape = tuple(n if d == dim else s for d, s in enumerate(x.shape))
    lined = tuple(n if d == dim else 1 for d in range(len(shape)))
    if lined != (n,):
        iv = tr.mk(t.Reshape(iv, tr.ivec(lined)), index.dtype, lined)
    if lined != shape:
        iv = tr.mk(t.Broadcast(iv, tr.ivec(shape)), index.dtype, shape)
    return Computed(tr.mk(t.Gather(tr.value(x), iv, dim), x.dtype, shape), shape, x.dtype)


def _shaped(tr, entry: Computed, shape) -> Computed:
    shape = tuple(shape)
    if tuple(entry.shape) == shape:
        return entry
    return Computed(tr.mk(tr.t.Reshape(entry.term, tr.ivec(shape)), entry.dtype, shape), shape, entry.dtype)


@handles(aten.index_select)
def _index_select(tr, node, x, dim, index):
    return _shaped(tr, _take(tr, x, dim % max(1, len(x.shape)), index), out_type(node)[0])


@handles(aten.embedding)
def _embedding(tr, node, weight, indices, *args, **kw):
    """A table's rows at the indices (padding_idx and the rest change only the backward)."""
    return _shaped(tr, _take(tr, weight, 0, indices), out_type(node)[0])


@handles(aten.index)
def _index(tr, node, x, indices):
    """``x[..., i, j, ...]``: integer index tensors at adjacent dims after full slices
    (``None`` entries), broadcast together: one index into those dims merged (an index
    outside its dim reads NaN, as one outside the table does). Apart (their result's
    dims move to the front) or a mask: eager."""
    given = [d for d, i in enumerate(indices) if i is not None]
    if not given or given != list(range(given[0], given[-1] + 1)):
        raise Unsupported(f"indexing with {len(given)} index tensors apart")
    for i in (indices[d] for d in given):
        _index_entry(i)
    merged = _merged_index(tr, x, given, [indices[d] for d in given])
    k, sizes = given[0], [x.shape[d] for d in given]
    flat_shape = tuple(x.shape[:k]) + (math.prod(sizes),) + tuple(x.shape[given[-1] + 1:])
    flat = _shaped(tr, Computed(tr.value(x), tuple(x.shape), x.dtype), flat_shape)
    return _shaped(tr, _take(tr, flat, k, merged), out_type(node)[0])


def _merged_index(tr, x, dims: list, indices: list) -> Computed:
    """The index into ``x``'s ``dims`` merged (row-major) of the index tensors
    ``indices``, broadcast together; -1 (outside) where one is outside its dim."""
    t = tr.t
    shape = tuple(torch.broadcast_shapes(*[tuple(i.shape) for i in indices]))
    merged = inside = None
    for d, index in zip(dims, indices):
        n = x.shape[d]
        v = tr.operand(_ranked(tr, index, len(shape)), shape, "int64")
        negative = tr.mk(t.Binary("lt", v, tr.const(0, "int64")), "bool", shape)
        v = tr.mk(t.Where(negative, tr.mk(t.Binary("add", v, tr.const(n, "int64")), "int64", shape), v), "int64", shape)
        ok = tr.mk(t.Binary("and", tr.mk(t.Binary("ge", v, tr.const(0, "int64")), "bool", shape),
                            tr.mk(t.Binary("lt", v, tr.const(n, "int64")), "bool", shape)), "bool", shape)
        inside = ok if inside is None else tr.mk(t.Binary("and", inside, ok), "bool", shape)
        if merged is not None:
            merged = tr.mk(t.Binary("mul", merged, tr.const(n, "int64")), "int64", shape)
            v = tr.mk(t.Binary("add", merged, v), "int64", shape)
        merged = v
    merged = tr.mk(t.Where(inside, merged, tr.const(-1, "int64")), "int64", shape)
    return Computed(merged, shape, "int64")


def _ranked(tr, entry, rank: int):
    """``entry`` with leading dims of 1 up to ``rank`` (broadcasting aligns from the right)."""
    if len(entry.shape) == rank:
        return entry
    shape = (1,) * (rank - len(entry.shape)) + tuple(entry.shape)
    return Computed(tr.mk(tr.t.Reshape(tr.value(entry), tr.ivec(shape)), entry.dtype, shape), shape, entry.dtype)


def _gathered(tr, x, dim: int, index) -> Computed:
    """``torch.gather``: ``x`` (narrowed to ``index``'s extent in the other dims) read
    along ``dim`` at ``index``."""
    _index_entry(index)
    if len(index.shape) != len(x.shape) or not x.shape:
        raise Unsupported("gather of a scalar or across ranks")
    for d, size in enumerate(index.shape):
        if d != dim and size != x.shape[d]:
            x = part(tr, x, d, 0, size)
    shape = tuple(index.shape)
    return Computed(tr.mk(tr.t.Gather(tr.value(x), tr.value(index), dim), x.dtype, shape), shape, x.dtype)


@handles(aten.constant_pad_nd)
def _constant_pad_nd(tr, node, x, pad, value=0):
    """``F.pad(x, pad, value=value)``: along each dim ``pad`` names (the last dim first, a
    (before, after) pair each), ``x`` narrowed where a pad is negative and joined between
    blocks of ``value`` where it is positive."""
    shape, dt = out_type(node)
    if not math.prod(shape) or not math.prod(x.shape):
        raise Unsupported("a pad to or of an empty tensor")
    out = x
    for i in range(len(pad) // 2):
        dim = len(x.shape) - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        start = max(-before, 0)
        size = out.shape[dim] - start - max(-after, 0)
        if size <= 0:
            raise Unsupported("a pad that cuts a dim away")
        if size != out.shape[dim]:
            out = part(tr, out, dim, start, size)
        if before > 0 or after > 0:
            blocks = [filled(tr, value, tuple(w if d == dim else n for d, n in enumerate(out.shape)), dt)
                      for w in (before, after)]
            parts = [blocks[0]] * (before > 0) + [out] + [blocks[1]] * (after > 0)
            out = concat(tr, parts, dim, dt)
    return Computed(tr.cast(tr.value(out), out.dtype, dt, shape), shape, dt)


@handles(aten.split, aten.split_with_sizes)
def _split(tr, node, x, sizes, dim=0):
    dim = dim % len(x.shape)
    n = x.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)] or [0]
    out, start = [], 0
    for size in sizes:
        out.append(part(tr, x, dim, start, size))
        start += size
    return out


@handles(aten.slice_scatter)
def _slice_scatter(tr, node, base, src, dim=0, start=None, end=None, step=1):
    """``base`` with ``src`` written over ``base[start:end]`` along ``dim``: with step 1 it
    is ``cat(base[:start], src, base[end:])`` (the backward of slicing and of split, where
    ``base`` is zeros). Empty parts are left out."""
    if step != 1:
        raise Unsupported(f"slice_scatter with step {step} (only step 1 is a concatenation)")
    shape, dt = out_type(node)
    dim = dim % len(shape)
    return _written_over(tr, base, src, dim, norm_start(start, shape[dim]), dt)


@handles(aten.select_scatter)
def _select_scatter(tr, node, base, src, dim, index):
    """``base`` with ``src`` written over ``base.select(dim, index)``: a slice_scatter of
    ``src`` with ``dim`` put back as size 1."""
    shape, dt = out_type(node)
    dim = dim % len(shape)
    if not isinstance(src, (BufferView, Computed)):
        raise Unsupported("select_scatter of a non-tensor")
    one = (*shape[:dim], 1, *shape[dim + 1:])
    row = Computed(tr.mk(tr.t.Reshape(tr.value(src), tr.ivec(one)), src.dtype, one), one, src.dtype)
    return _written_over(tr, base, row, dim, index % shape[dim], dt)


def _written_over(tr, base, src, dim: int, lo: int, dt: str) -> Computed:
    """``base`` with ``src`` over ``[lo, lo + len)`` along ``dim``: the concatenation of
    ``base``'s parts around it and ``src``, empty parts left out."""
    for x in (base, src):
        if not isinstance(x, (BufferView, Computed)):
            raise Unsupported("a scatter of a non-tensor")
    hi = lo + src.shape[dim]  # src has exactly the sliced extent (torch checks it)
    parts = [part(tr, base, dim, 0, lo), src, part(tr, base, dim, hi, base.shape[dim] - hi)]
    parts = [p for p in parts if p.shape[dim] > 0]
    if not parts:  # an empty tensor: any part states it
        parts = [src]
    return concat(tr, parts, dim, dt)


# --- one element per row along a dim: gather and scatter as selects ------------------------
# Where the index has one element along ``dim`` (cross-entropy's target: nll_loss reads
# -logp[i, target[i]] with gather, and its backward writes into zeros with scatter), the
# op is a select against the iota along ``dim``: pointwise (scatter) or a row sum (gather),
# which fuse into the kernels around them (the log-softmax's, its backward's) instead of
# running in eager over a vocabulary-wide tensor.

def _one_per_row(x, index, dim: int) -> int | None:
    """``dim`` (normalised) where ``index`` has one element along it and ``x``'s sizes
    along the others; None otherwise."""
    if not isinstance(index, (BufferView, Computed)) or not isinstance(x, (BufferView, Computed)):
        return None
    if len(index.shape) != len(x.shape) or not x.shape:
        return None
    dim %= len(x.shape)
    same = all(i == s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != dim)
    return dim if same and index.shape[dim] == 1 and index.dtype in ("int64", "int32") else None


def _is_index(tr, x, index, dim: int):
    """A bool Value of ``x``'s shape: True where the position along ``dim`` is ``index``'s."""
    shape = tuple(x.shape)
    iota = tr.mk(tr.t.Iota(tr.ivec(shape), dim), "int64", shape)
    return tr.mk(tr.t.Binary("eq", iota, tr.operand(index, shape, "int64")), "bool", shape)


_ZERO = {True: -0.0, False: 0}  # the sum's identity: -0.0 + x is x, the sign of a zero too


@handles(aten.gather)
def _gather(tr, node, x, dim, index, sparse_grad=False):
    """``x.gather(dim, index)`` with one index per row: the row's sum of ``x`` where the
    position is the index, -0.0 elsewhere (exact: one value and zeros; NaN or inf elsewhere
    in the row are not selected), which fuses into the row's other reductions (a
    cross-entropy's log-softmax). A -0.0 selected comes back +0.0, as from every sum of
    eqfuse's kernels (their reductions start at +0.0). Otherwise an indirect read (``_gathered``)."""
    one = _one_per_row(x, index, dim)
    shape, dt = out_type(node)
    if one is None or not (ops.is_float(dt) or dt in ("int64", "int32")):
        return _gathered(tr, x, dim % max(1, len(x.shape)), index)
    dim = one
    fill = tr.const(_ZERO[ops.is_float(dt)], dt)
    picked = tr.mk(tr.t.Where(_is_index(tr, x, index, dim), tr.operand(x, x.shape, dt), fill), dt, tuple(x.shape))
    return reduce_dims(tr, Computed(picked, tuple(x.shape), dt), [dim], True, "sum", dt, shape)[0]


@handles(aten.scatter)
def _scatter(tr, node, base, dim, index, src, reduce=None):
    """``base.scatter(dim, index, src)`` with one index per row (src a scalar, or shaped
    as the index): ``src`` where the position along ``dim`` is the index, ``base`` elsewhere."""
    dim = _one_per_row(base, index, dim)
    shape, dt = out_type(node)
    if reduce is not None or dim is None:
        raise Unsupported("scatter with more than one index per row, past CUMSUM_WORK comparisons of positions "
                          "with indices (frontend/decompose/), or of bools")
    if isinstance(src, (BufferView, Computed)) and tuple(src.shape) != tuple(index.shape):
        raise Unsupported("scatter of a source larger than its index")
    value = tr.operand(src, shape, dt)
    return Computed(tr.mk(tr.t.Where(_is_index(tr, base, index, dim), value, tr.operand(base, shape, dt)), dt, shape),
                    shape, dt)


@handles(aten.index_put)
def _index_put(tr, node, x, indices, values, accumulate=False):
    """``x.index_put(indices, values)`` at one position along one dim (a static cache's
    update at a decode step's position, ``index_copy`` decomposed): ``values`` there, ``x``
    elsewhere (``x`` plus them where accumulating), pointwise. A position outside ``x``
    (eager raises) gives NaN throughout. Several positions along one dim arrive here only
    where frontend/decompose/ declined them, and run in eager."""
    given = [d for d, i in enumerate(indices) if i is not None]
    shape, dt = out_type(node)
    if len(given) != 1 or len(indices[given[0]].shape) > 1 or math.prod(indices[given[0]].shape) != 1:
        raise Unsupported("index_put at several positions that no kernel form takes (a boolean mask, index tensors "
                          "at several dims or of several dims, or more positions times indices than CUMSUM_WORK)")
    (dim,) = given
    index = indices[dim]
    _index_entry(index)
    t = tr.t
    slot = tuple(1 if d == dim else s for d, s in enumerate(shape))
    if not isinstance(values, (BufferView, Computed)) or len(values.shape) > len(slot) or not _broadcastable_to(
            values.shape, slot):
        raise Unsupported("index_put of values shaped otherwise than the position they fill")
    v = tr.operand(_ranked(tr, values, len(slot)), slot, dt)
    if slot != shape:
        v = tr.mk(t.Broadcast(v, tr.ivec(shape)), dt, shape)
    ones = (1,) * len(shape)
    position = _merged_index(tr, x, [dim], [index])  # -1 where outside
    p = tr.mk(t.Broadcast(tr.mk(t.Reshape(position.term, tr.ivec(ones)), "int64", ones), tr.ivec(shape)),
              "int64", shape)
    here = tr.mk(t.Binary("eq", tr.mk(t.Iota(tr.ivec(shape), dim), "int64", shape), p), "bool", shape)
    base = tr.operand(x, shape, dt)
    new = tr.mk(t.Binary("add", base, v), dt, shape) if accumulate else v
    out = tr.mk(t.Where(here, new, base), dt, shape)
    if ops.is_float(dt):
        outside = tr.mk(t.Binary("lt", p, tr.const(0, "int64")), "bool", shape)
        out = tr.mk(t.Where(outside, tr.const(math.nan, dt), out), dt, shape)
    return Computed(out, shape, dt)


def _broadcastable_to(shape, target) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (aligned from the right)."""
    return all(s in (1, g) for s, g in zip(reversed(tuple(shape)), reversed(tuple(target))))
