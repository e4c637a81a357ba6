"""FX ops computed element by element: unary and binary ops, division and
remainders, selects, clamps, casts and copies, constants and ranges."""

from __future__ import annotations

import math

import torch

from ...errors import Unsupported
from .. import ops
from ..ops import dtype_name
from ..values import BufferView, Computed, node_meta
from .registry import handles, moves_values, out_type, promotion_meta

aten = torch.ops.aten
prims = torch.ops.prims


UNARY_TARGETS = {
    aten.neg: "neg", aten.exp: "exp", aten.log: "log", aten.sqrt: "sqrt", aten.rsqrt: "rsqrt",
    aten.tanh: "tanh", aten.sigmoid: "sigmoid", aten.relu: "relu", aten.abs: "abs", aten.erf: "erf",
    aten.erfc: "erfc", aten.erfinv: "erfinv",
    aten.sin: "sin", aten.cos: "cos", aten.floor: "floor", aten.ceil: "ceil",
    aten.reciprocal: "reciprocal", aten.logical_not: "not", aten.log1p: "log1p", aten.expm1: "expm1",
    aten.isnan: "isnan", aten.isinf: "isinf", aten.log2: "log2", aten.exp2: "exp2", aten.log10: "log10",
    aten.trunc: "trunc", aten.sign: "sign", aten.sgn: "sign", aten.round: "round",
    aten.signbit: "signbit", prims.signbit: "signbit", aten.sinh: "sinh", aten.cosh: "cosh", aten.tan: "tan",
    aten.asinh: "asinh", aten.acosh: "acosh", aten.atanh: "atanh", aten.atan: "atan", aten.asin: "asin",
    aten.acos: "acos", aten.arcsinh: "asinh", aten.arccosh: "acosh", aten.arctanh: "atanh", aten.arctan: "atan",
    aten.arcsin: "asin", aten.arccos: "acos",
}


def _unary(tr, node, x, *rest, **kw):
    op = UNARY_TARGETS[node.target.overloadpacket]
    shape, dt = out_type(node)
    if op == "round" and (rest or kw.get("decimals") or dt == "float64"):
        raise Unsupported("round to decimals, or of float64")
    if op == "signbit" and x.dtype != "float32":
        raise Unsupported(f"signbit of {x.dtype} (its kernel form reads float32's bits)")
    if op in ops.BOOL_UNARY:
        v = tr.operand(x, shape, x.dtype)
        return Computed(tr.mk(tr.t.Unary(op, v), "bool", shape), shape, "bool")
    if not ops.is_float(dt) and op not in ("neg", "abs", "relu"):
        raise Unsupported(f"{op} on {dt}")
    v = tr.operand(x, shape, dt)
    return Computed(tr.mk(tr.t.Unary(op, v), dt, shape), shape, dt)


handles(*UNARY_TARGETS)(_unary)


@handles(aten.bitwise_not)
def _bitwise_not(tr, node, x):
    if x.dtype != "bool":
        raise Unsupported("bitwise_not on integers")
    shape, _ = out_type(node)
    return Computed(tr.mk(tr.t.Unary("not", tr.operand(x, shape, "bool")), "bool", shape), shape, "bool")


BINARY_TARGETS = {
    aten.add: "add", aten.sub: "sub", aten.mul: "mul", aten.div: "div", aten.maximum: "maximum",
    aten.minimum: "minimum", aten.eq: "eq", aten.ne: "ne", aten.lt: "lt", aten.le: "le",
    aten.gt: "gt", aten.ge: "ge", aten.logical_and: "and", aten.logical_or: "or",
    aten.logical_xor: "xor", aten.bitwise_and: "and", aten.bitwise_or: "or", aten.bitwise_xor: "xor",
    prims.div: "div", aten.pow: "pow", aten.fmax: "fmax", aten.fmin: "fmin", aten.atan2: "atan2",
    aten.arctan2: "atan2", aten.hypot: "hypot",
    aten.bitwise_right_shift: "rshift", aten.__rshift__: "rshift",
    aten.bitwise_left_shift: "lshift", aten.__lshift__: "lshift",
}


def _binary(tr, node, a, b, *rest, alpha=None, rounding_mode=None, **kw):
    op = BINARY_TARGETS[node.target.overloadpacket]
    shape, dt = out_type(node)
    if op == "div" and rounding_mode is not None and not ops.is_float(dt):
        return _int_division(tr, node, a, b, "floor" if rounding_mode == "floor" else "trunc")
    if rounding_mode == "floor":
        return _float_division(tr, node, a, b, "floordiv")
    if rounding_mode is not None and not (rounding_mode == "trunc" and ops.is_float(dt)):
        raise Unsupported(f"div with rounding_mode={rounding_mode!r}")
    if op == "pow" and isinstance(a, (int, float)) and not isinstance(b, (int, float)) and ops.is_float(dt):
        return _scalar_to_a_power(tr, a, b, shape, dt)
    if op == "pow" and not (isinstance(b, (int, float)) and ops.is_float(dt)):
        raise Unsupported("pow is supported on floats with a scalar exponent or a positive scalar base")
    if op in ("and", "or", "xor") and dt != "bool":
        op = "bit" + op  # bitwise on integers, logical on bools
    if op.startswith("bit") or op.endswith("shift"):
        if ops.is_float(dt):
            raise Unsupported(f"{op} on {dt}")
    if op in ops.COMPARISONS:
        compute = dtype_name(torch.result_type(promotion_meta(a), promotion_meta(b)))
        if op in ("and", "or", "xor"):
            compute = "bool"
    else:
        compute = dt
        if op == "div" and not ops.is_float(dt):
            raise Unsupported("integer division")
    va, vb = tr.operand(a, shape, compute), tr.operand(b, shape, compute)
    if alpha is not None and alpha != 1:
        vb = tr.mk(tr.t.Binary("mul", vb, tr.const(alpha, compute)), compute, shape)
    v = tr.mk(tr.t.Binary(op, va, vb), dt, shape)
    if rounding_mode == "trunc":  # a float quotient rounded toward zero, as torch computes it
        v = tr.mk(tr.t.Unary("trunc", v), dt, shape)
    return Computed(v, shape, dt)


handles(*BINARY_TARGETS)(_binary)


def _scalar_to_a_power(tr, base, exponent, shape, dt):
    """``base ** exponent`` for a positive scalar base other than 1: exp2(exponent *
    log2(base)), which is exp2 itself for base 2 (as ``ldexp`` spells it: exact at integer
    exponents) and within a few ulps of eager's powf elsewhere (the product's rounding
    times the result's exponent; validation judges it). NaN, infinities and zeros of the
    exponent come out as pow's. Base 1 (1 whatever the exponent, NaN included) and bases
    of zero or below (signs, exact zeros) stay eager. The base is first rounded to ``dt``
    (eager's common dtype: 3.14159 ** x in bfloat16 is 3.140625 ** x); the rest is computed
    in float32 and rounded once to ``dt``."""
    rounded = torch.tensor(base, dtype=ops.DTYPES[dt]).item()
    if not (rounded > 0 and rounded != 1 and math.isfinite(rounded)):
        raise Unsupported(f"pow of the scalar base {base} to a tensor exponent")
    base = rounded
    wide = "float64" if dt == "float64" else "float32"
    v = tr.operand(exponent, shape, wide)
    if base != 2:
        v = tr.mk(tr.t.Binary("mul", v, tr.const(math.log2(base), wide)), wide, shape)
    return Computed(tr.cast(tr.mk(tr.t.Unary("exp2", v), wide, shape), wide, dt, shape), shape, dt)


@handles(aten.floor_divide)
def _floor_divide(tr, node, a, b):
    if ops.is_float(out_type(node)[1]):
        return _float_division(tr, node, a, b, "floordiv")
    return _int_division(tr, node, a, b, "floor")


@handles(aten.remainder, aten.fmod)
def _remainder(tr, node, a, b):
    kind = "fmod" if node.target.overloadpacket is aten.fmod else "remainder"
    if ops.is_float(out_type(node)[1]):
        return _float_division(tr, node, a, b, kind)
    return _int_division(tr, node, a, b, kind)


def _float_division(tr, node, a, b, op: str):
    """Floats' ``fmod``, ``remainder`` or ``floordiv`` (a division rounded down), exact as
    torch's (schema/ops.py: the significands' long division), for float32 and the narrower
    floats, which are exact in float32."""
    shape, dt = out_type(node)
    if dt == "float64":
        raise Unsupported(f"{op} on float64 (its kernel form divides float32's significands)")
    va, vb = tr.operand(a, shape, dt), tr.operand(b, shape, dt)
    return Computed(tr.mk(tr.t.Binary(op, va, vb), dt, shape), shape, dt)


def _int_division(tr, node, a, b, kind: str):
    """Integer ``a`` divided by a nonzero integer constant ``b``: the quotient rounded toward
    zero (``trunc``) or down (``floor``), the remainder of a's sign (``fmod``) or of b's
    (``remainder``, Python's), as torch computes them, from C's quotient and remainder
    (Triton's // and %). A divisor that is a tensor stays eager: at a zero, eager raises
    on the CPU, where a kernel would hand back a number. Floats: ``_float_division``."""
    shape, dt = out_type(node)
    if dt == "bool":
        raise Unsupported(f"{kind} on bool")
    if isinstance(b, bool) or not isinstance(b, int) or b == 0:
        raise Unsupported(f"{kind} by {'a tensor' if not isinstance(b, (int, float)) else repr(b)}: integer "
                          "division by a nonzero constant only (at a zero divisor eager raises)")
    va, vb, zero = tr.operand(a, shape, dt), tr.const(b, dt), tr.const(0, dt)

    def mk(term):
        return tr.mk(term, dt, shape)

    if b == -1:  # C's quotient by -1 overflows at the smallest integer; torch's wraps, as a product does
        q, r = mk(tr.t.Binary("mul", va, vb)), mk(tr.t.Binary("mul", va, zero))
    else:
        q, r = mk(tr.t.Binary("idiv", va, vb)), mk(tr.t.Binary("irem", va, vb))
    # a nonzero remainder of the other sign than b: floor is one below C's quotient, and
    # Python's remainder b more than C's
    off = tr.mk(tr.t.Binary("lt" if b > 0 else "gt", r, zero), "bool", shape)
    if kind == "trunc":
        v = q
    elif kind == "fmod":
        v = r
    elif kind == "floor":
        v = mk(tr.t.Where(off, mk(tr.t.Binary("sub", q, tr.const(1, dt))), q))
    else:
        v = mk(tr.t.Where(off, mk(tr.t.Binary("add", r, vb)), r))
    return Computed(v, shape, dt)


@handles(aten.where)
def _where(tr, node, c, a, b):
    shape, dt = out_type(node)
    vc = tr.operand(c, shape, "bool")
    return Computed(tr.mk(tr.t.Where(vc, tr.operand(a, shape, dt), tr.operand(b, shape, dt)), dt, shape),
                    shape, dt)


@handles(aten.nextafter)
def _nextafter(tr, node, a, b):
    """The float next to a toward b, by its bits (float32: a narrower float's next is its own)."""
    shape, dt = out_type(node)
    if dt != "float32":
        raise Unsupported(f"nextafter on {dt} (its kernel form steps float32's bits)")
    return Computed(tr.mk(tr.t.Binary("nextafter", tr.operand(a, shape, dt), tr.operand(b, shape, dt)), dt, shape),
                    shape, dt)


@handles(aten.copysign)
def _copysign(tr, node, a, b):
    """|a| with b's sign bit (-0.0 and a NaN carrying it count as negative), by the bits."""
    shape, dt = out_type(node)
    if isinstance(a, (int, float)):
        raise Unsupported("copysign of a number")
    dtypes = [a.dtype] + ([] if isinstance(b, (int, float)) else [b.dtype])
    if any(d != "float32" for d in (dt, *dtypes)):
        raise Unsupported(f"copysign of {', '.join(dtypes)} (its kernel form reads float32's bits)")
    v = tr.t.Binary("copysign", tr.operand(a, shape, dt), tr.operand(b, shape, dt))
    return Computed(tr.mk(v, dt, shape), shape, dt)


@handles(aten.clamp, aten.clamp_min, aten.clamp_max)
def _clamp(tr, node, x, lo=None, hi=None, **kw):
    shape, dt = out_type(node)
    if node.target.overloadpacket is aten.clamp_max:
        lo, hi = None, lo
    v = tr.operand(x, shape, dt)
    if lo is not None:
        v = tr.mk(tr.t.Binary("maximum", v, tr.operand(lo, shape, dt)), dt, shape)
    if hi is not None:
        v = tr.mk(tr.t.Binary("minimum", v, tr.operand(hi, shape, dt)), dt, shape)
    return Computed(v, shape, dt)


@handles(aten._to_copy, prims.convert_element_type, aten.to)
def _to_copy(tr, node, x, *args, **kw):
    shape, dt = out_type(node)
    literal = tr.literal(x)
    if literal is not None:
        # A literal of the code moved to the device (a sliding-window cache's window size,
        # made on the CPU): its value in the new dtype, which no kernel then reads from the CPU
        value = torch.tensor(literal, dtype=ops.DTYPES[x.dtype]).to(ops.DTYPES[dt]).item()
        return Computed(tr.operand(value, shape, dt), shape, dt)
    m = node_meta(node)
    if isinstance(x, (BufferView, Computed)) and str(m.device) != str(node_meta(node.args[0]).device):
        raise Unsupported("a copy between devices")
    return Computed(tr.cast(tr.value(x), x.dtype, dt, shape), shape, dt)


@handles(aten.copy)
def _copy_into(tr, node, dst, src, non_blocking=False):
    """``aten.copy(dst, src)``, a functionalised ``dst.copy_(src)`` (T5 shifting its labels
    right): ``src``'s values broadcast to ``dst``'s shape, in ``dst``'s dtype."""
    shape, dt = out_type(node)
    if tr.literal(src) is not None:
        src = tr.literal(src)  # a literal of the code, on the CPU: its value (T5's start token)
    if isinstance(src, (BufferView, Computed)) and str(node_meta(node.args[1]).device) != str(node_meta(node).device):
        raise Unsupported("a copy between devices")
    v = tr.operand(src, shape, dt)
    if not isinstance(src, (BufferView, Computed)) and shape:
        v = tr.mk(tr.t.Broadcast(v, tr.ivec(shape)), dt, shape)
    return Computed(v, shape, dt)


@moves_values
@handles(aten.alias, aten.detach)
def _identity(tr, node, x, *args, **kw):
    return x


@moves_values
@handles(aten.clone, aten.lift_fresh_copy, aten.contiguous)
def _copy(tr, node, x, *args, **kw):
    """A copy has the values of ``x`` in a fresh, contiguous layout: views of it no
    longer fold into the strides of ``x``'s buffer."""
    if isinstance(x, BufferView):
        return BufferView(x.buf, x.shape, x.strides, x.offset, x.dtype, foldable=False)
    return x


@handles(aten.full, aten.scalar_tensor, aten.full_like, aten.zeros_like, aten.ones_like)
def _full(tr, node, *args, **kw):
    shape, dt = out_type(node)
    pk = node.target.overloadpacket
    value = {aten.full: lambda: args[1], aten.scalar_tensor: lambda: args[0],
             aten.full_like: lambda: args[1], aten.zeros_like: lambda: 0,
             aten.ones_like: lambda: 1}[pk]()
    return filled(tr, value, shape, dt)


@handles(aten.arange)
def _arange(tr, node, *args, **kw):
    shape, dt = out_type(node)
    nums = [a for a in args if isinstance(a, (int, float))]
    start, step = (0, 1)
    if len(nums) >= 2:
        start = nums[0]
    if len(nums) >= 3:
        step = nums[2]
    v = tr.mk(tr.t.Iota(tr.ivec(shape), 0), "int64", shape)
    v = tr.cast(v, "int64", dt, shape)
    if step != 1:
        v = tr.mk(tr.t.Binary("mul", v, tr.const(step, dt)), dt, shape)
    if start != 0:
        v = tr.mk(tr.t.Binary("add", v, tr.const(start, dt)), dt, shape)
    return Computed(v, shape, dt)


def filled(tr, value, shape, dt: str) -> Computed:
    """``value`` broadcast to ``shape``, in ``dt``."""
    v = tr.const(value, dt)
    return Computed(tr.mk(tr.t.Broadcast(v, tr.ivec(shape)), dt, shape) if shape else v, shape, dt)
