"""Matrix products: mm, bmm, addmm and baddbmm as Dot terms."""

from __future__ import annotations

import torch

from ...errors import Unsupported
from ..values import BufferView, Computed, node_meta
from .registry import handles, out_type

aten = torch.ops.aten


# --- matrix products -------------------------------------------------------------------------
# Capture decomposes matmul, @, linear and einsum into mm / bmm / addmm with views around
# them; a transpose of an input folds into the strides the kernel reads it with.

MATMUL_DTYPES = ("float32", "float16", "bfloat16")


def _dot(tr, node, a, b, shape=None) -> Computed:
    dt = out_type(node)[1]
    shape = shape or out_type(node)[0]
    for x in (a, b):
        if not isinstance(x, (BufferView, Computed)):
            raise Unsupported("matmul of a non-tensor")
    if a.dtype != b.dtype:
        raise Unsupported(f"matmul of {a.dtype} by {b.dtype}")
    if dt not in MATMUL_DTYPES:
        raise Unsupported(f"matmul of {dt} (eqfuse kernels take {', '.join(MATMUL_DTYPES)})")
    if a.shape[-1] == 0:
        raise Unsupported("matmul over an empty dimension")
    return Computed(tr.mk(tr.t.Dot(tr.value(a), tr.value(b)), dt, shape), shape, dt)


@handles(aten.mm, aten.bmm)
def _mm(tr, node, a, b):
    batched = _unflattened_batch(tr, node)
    if batched is None:
        return _dot(tr, node, a, b)
    # torch's matmul flattens the batch dims of both operands into one for bmm and views
    # the result back: the product is stated over the batch dims themselves, so that rules
    # meet the operands as computed (the softmax feeding attention's second product).
    a4, b4 = batched
    d = _dot(tr, node, a4, b4, a4.shape[:-1] + b4.shape[-1:])
    shape, dt = out_type(node)
    return Computed(tr.mk(tr.t.Reshape(d.term, tr.ivec(shape)), dt, shape), shape, dt)


_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def _unflattened_batch(tr, node):
    """For ``bmm(view(a), view(b))`` where both views only merge the batch dims of a and b
    (same batch shape, rank > 3): the entries of a and b. None otherwise."""
    if node.target is not aten.bmm.default:
        return None
    sources = []
    for arg in node.args[:2]:
        if not (isinstance(arg, torch.fx.Node) and arg.target in _VIEWS):
            return None
        src = arg.args[0]
        inner, outer = node_meta(src), node_meta(arg)
        if inner is None or inner.dim() <= 3 or tuple(inner.shape[-2:]) != tuple(outer.shape[-2:]):
            return None
        sources.append(src)
    a, b = (node_meta(s) for s in sources)
    if tuple(a.shape[:-2]) != tuple(b.shape[:-2]):
        return None
    return tuple(tr.env[s] for s in sources)


@handles(aten.addmm, aten.baddbmm)
def _addmm(tr, node, bias, a, b, beta=1, alpha=1):
    """beta * bias + alpha * (a @ b); a zero beta ignores the bias (NaN included), as torch does."""
    d = _dot(tr, node, a, b)
    shape, dt = d.shape, d.dtype
    v = d.term
    if alpha != 1:
        v = tr.mk(tr.t.Binary("mul", v, tr.const(alpha, dt)), dt, shape)
    if beta != 0:
        bv = tr.operand(bias, shape, dt)
        if beta != 1:
            bv = tr.mk(tr.t.Binary("mul", bv, tr.const(beta, dt)), dt, shape)
        v = tr.mk(tr.t.Binary("add", v, bv), dt, shape)
    return Computed(v, shape, dt)
