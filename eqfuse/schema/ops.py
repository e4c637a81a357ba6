"""The kernel-level operators: one table that says what each means in PyTorch (the
reference used by the soundness tests) and how it is written in Triton.

Triton templates take operand expressions already converted to the compute dtype
(float32 for every floating type narrower than float64).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OpDef:
    name: str
    torch_fn: Callable
    triton: str  # a format string over {a}, {b}
    cost: float = 1.0  # relative compute cost per element, for the cost model


def _tanh_triton() -> str:
    # 2*sigmoid(2x)-1: exact to float32 rounding, and portable to the interpreter; below
    # 2^-12, where x^3/3 is under float32's rounding of x, x itself (its cancellation there
    # would lose x's digits, and -0.0's sign).
    return "tl.where(tl.abs({a}) < 2.44140625e-4, {a}, 2.0 * tl.sigmoid(2.0 * {a}) - 1.0)"


UNARY: dict[str, OpDef] = {op.name: op for op in [
    OpDef("neg", torch.neg, "({a} * -1)", 0.5),  # Triton's -x is 0 - x: -(+0.0) would be +0.0
    OpDef("exp", torch.exp, "tl.exp({a})", 2),
    OpDef("log", torch.log, "tl.log({a})", 2),
    OpDef("sqrt", torch.sqrt, "tl.sqrt({a})", 2),
    OpDef("rsqrt", torch.rsqrt, "tl.rsqrt({a})", 2),
    OpDef("tanh", torch.tanh, _tanh_triton(), 3),
    OpDef("sigmoid", torch.sigmoid, "tl.sigmoid({a})", 3),
    OpDef("relu", torch.relu, "tl.where({a} < 0, 0, {a})", 0.5),  # as torch: NaN and -0.0 pass
    OpDef("abs", torch.abs, "tl.abs({a})", 0.5),
    OpDef("erf", torch.erf, "tl.erf({a})", 3),
    OpDef("sin", torch.sin, "tl.sin({a})", 3),
    OpDef("cos", torch.cos, "tl.cos({a})", 3),
    OpDef("floor", torch.floor, "tl.floor({a})", 0.5),
    OpDef("ceil", torch.ceil, "tl.ceil({a})", 0.5),
    OpDef("reciprocal", torch.reciprocal, "(1.0 / {a})", 1),
    # log(u) * (x / (u - 1)) with u = 1 + x corrects the rounding of 1 + x (Goldberg's
    # trick); the ratio first, so that log(u) * x cannot overflow (x = 3e38), and u = inf
    # is inf (the ratio would be inf / inf).
    OpDef("log1p", torch.log1p,
          "tl.where({a} + 1.0 == 1.0, {a}, tl.where({a} + 1.0 == float('inf'), {a} + 1.0, "
          "tl.log({a} + 1.0) * ({a} / (({a} + 1.0) - 1.0))))", 3),
    OpDef("expm1", torch.expm1,  # x (1 + x / 2) near 0: -0.0 keeps its sign
          "tl.where(tl.abs({a}) < 1e-5, {a} * (1.0 + 0.5 * {a}), tl.exp({a}) - 1.0)", 3),
    OpDef("log2", torch.log2, "tl.log2({a})", 2),
    OpDef("exp2", torch.exp2, "tl.exp2({a})", 2),
    # log2(x) * log10(2): within an ulp or two of log10 (exact at 0, inf and NaN)
    OpDef("log10", torch.log10, "(tl.log2({a}) * 0.30102999566398120)", 2),
    # toward zero: ceil below 0 keeps -0.0 (trunc(-0.3) is -0.0), floor keeps NaN
    OpDef("trunc", torch.trunc, "tl.where({a} < 0, tl.ceil({a}), tl.floor({a}))", 0.5),
    # half to even, as torch: x's fraction above its floor decides (x + 0.5 would round
    # 0.49999997 up); from -0.5 to 0.5 a zero of x's sign (round(-0.3) is -0.0); from 2^23
    # on every float32 is whole (float64 is not: translated for narrower floats only)
    OpDef("round", torch.round,
          "tl.where(tl.abs({a}) >= 8388608.0, {a}, tl.where(tl.abs({a}) <= 0.5, {a} * 0.0, "
          "tl.floor({a}) + tl.where({a} - tl.floor({a}) > 0.5, 1.0, "
          "tl.where({a} - tl.floor({a}) == 0.5, tl.where(tl.floor({a}) % 2 != 0, 1.0, 0.0), 0.0))))", 2),
    # as torch: 0 for NaN and for either zero
    OpDef("sign", torch.sign, "tl.where({a} > 0, 1.0, tl.where({a} < 0, -1.0, 0.0))", 0.5),
    OpDef("not", torch.logical_not, "({a} == 0)", 0.5),
    OpDef("isnan", torch.isnan, "({a} != {a})", 0.5),
    OpDef("isinf", torch.isinf, "(tl.abs({a}) == float(\"inf\"))", 0.5),
    # the sign bit itself, set for -0.0 and for a NaN that carries it (float32 only: a GPU's
    # conversions between float widths, and its arithmetic, may hand back a NaN unsigned)
    OpDef("signbit", torch.signbit, "(tl.cast({a}, tl.float32).to(tl.int32, bitcast=True) < 0)", 0.5),
]}

BINARY: dict[str, OpDef] = {op.name: op for op in [
    OpDef("add", torch.add, "({a} + {b})"),
    OpDef("sub", torch.sub, "({a} - {b})"),
    OpDef("mul", torch.mul, "({a} * {b})"),
    OpDef("div", torch.div, "({a} / {b})", 1.5),
    OpDef("pow", torch.pow, "", 4),  # written by the code generator (constant exponents)
    # NaN from either side, as torch has it (Triton's maximum is a GPU's max.f32, which
    # returns the other operand; propagate_nan has no Gluon spelling for the templates)
    OpDef("maximum", torch.maximum, "tl.where({a} != {a}, {a}, tl.where({b} != {b}, {b}, tl.maximum({a}, {b})))"),
    OpDef("minimum", torch.minimum, "tl.where({a} != {a}, {a}, tl.where({b} != {b}, {b}, tl.minimum({a}, {b})))"),
    # the other operand where one is NaN (NaN where both are), else the first where equal
    # (fmax(-0.0, 0.0) is -0.0 in torch)
    OpDef("fmax", torch.fmax, "tl.where({a} != {a}, {b}, tl.where({b} > {a}, {b}, {a}))"),
    OpDef("fmin", torch.fmin, "tl.where({a} != {a}, {b}, tl.where({b} < {a}, {b}, {a}))"),
    # a's magnitude bits with b's sign bit, NaN included (float32 only, as signbit)
    # (tl.cast: a literal operand becomes a value that bitcasts)
    OpDef("copysign", torch.copysign, "(((tl.cast({a}, tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF) | "
          "(tl.cast({b}, tl.float32).to(tl.int32, bitcast=True) & (-0x7FFFFFFF - 1))).to(tl.float32, bitcast=True))",
          0.5),
    OpDef("eq", torch.eq, "({a} == {b})"),
    OpDef("ne", torch.ne, "({a} != {b})"),
    OpDef("lt", torch.lt, "({a} < {b})"),
    OpDef("le", torch.le, "({a} <= {b})"),
    OpDef("gt", torch.gt, "({a} > {b})"),
    OpDef("ge", torch.ge, "({a} >= {b})"),
    # On bools, as selects and a comparison: Triton's interpreter refuses & | ^ between a
    # scalar bool (a broadcast value of one element) and a block of them
    OpDef("and", torch.logical_and, "tl.where({a}, {b}, False)"),
    OpDef("or", torch.logical_or, "tl.where({a}, True, {b})"),
    OpDef("xor", torch.logical_xor, "({a} != {b})"),
    # On integers: bits (unpacking quantised weights).
    OpDef("bitand", torch.bitwise_and, "({a} & {b})", 0.5),
    OpDef("bitor", torch.bitwise_or, "({a} | {b})", 0.5),
    OpDef("bitxor", torch.bitwise_xor, "({a} ^ {b})", 0.5),
    OpDef("rshift", torch.bitwise_right_shift, "({a} >> {b})", 0.5),
    OpDef("lshift", torch.bitwise_left_shift, "({a} << {b})", 0.5),
]}

BOOL_UNARY = {"not", "isnan", "isinf", "signbit"}  # unary ops whose result is bool
COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor"}

# Reductions over the last axis: torch reference and the neutral element.
REDUCE: dict[str, tuple[Callable, float]] = {
    "sum": (lambda x: x.sum(-1, keepdim=True), 0.0),
    "max": (lambda x: x.amax(-1, keepdim=True), float("-inf")),
    "min": (lambda x: x.amin(-1, keepdim=True), float("inf")),
}

# dtype names used in terms, and the torch / Triton types they stand for.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
TRITON_DTYPES = {
    "float16": "tl.float16", "bfloat16": "tl.bfloat16", "float32": "tl.float32",
    "float64": "tl.float64", "int8": "tl.int8", "int16": "tl.int16", "int32": "tl.int32",
    "int64": "tl.int64", "uint8": "tl.uint8", "bool": "tl.int1",
}
NARROW_FLOATS = {"float16", "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise KeyError(f"dtype {dtype} is not supported by eqfuse kernels") from None


def itemsize(dtype: str) -> int:
    """Bytes an element of ``dtype`` (a name) takes: asked thousands of times a graph by
    the cost model and the TMA checks, so read from torch's dtype, not a tensor made for it."""
    return DTYPES[dtype].itemsize


def is_float(dtype: str) -> bool:
    return DTYPES[dtype].is_floating_point


def reduce_identity(op: str, dtype: str):
    """The value reduction ``op`` starts from in ``dtype``: -inf for a float max, the
    smallest integer for an integer one (an int64 max over a row: multilabel_margin_loss)."""
    identity = REDUCE[op][1]
    if dtype == "bool":
        return op == "min"
    if not is_float(dtype) and math.isinf(identity):
        info = torch.iinfo(DTYPES[dtype])
        return info.min if identity < 0 else info.max
    return identity
