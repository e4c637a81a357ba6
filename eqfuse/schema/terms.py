"""The typed egglog schema: graph-level tensors and kernel-level values.

Two sorts, as in the e-graph tensor compilers this project learns from:

* ``Tensor`` is a buffer in memory: a graph input (``Input``) or the output of a kernel
  (``Kernel(value)``).
* ``Value`` lives inside one kernel. ``Load(t)`` reads a kernel output whole and contiguous,
  ``LoadStrided`` reads an input buffer through a strided view. Everything else is
  pointwise arithmetic, a reduction over the last axis, a matrix product (``Dot``), a
  streamed softmax product (``ExpDot``, ``ExpSum``: attention), or an index map
  (broadcast, reshape, permute, slice, cat) that changes how the iteration index reaches
  the operand.

The translator first states every FX op as its own kernel; the fusion rule
``Load(Kernel(u)) == u`` then offers the fused form and extraction chooses where kernel
boundaries fall. Float constants are keyed by the bits of their float64 value, so that
``0.0`` and ``-0.0`` differ and NaN equals itself.

Importing this module imports egglog (about 0.4 s): import it lazily.
"""

from __future__ import annotations

import struct

from egglog import Expr, Vec, function, i64, i64Like


class Tensor(Expr):
    """A materialised buffer."""


class Value(Expr):
    """A kernel-level value: one element per point of the iteration space."""


IntVec = Vec[i64]


@function
def Input(buffer: i64Like, dtype: i64Like) -> Tensor:
    """A buffer the kernels read but do not compute: a graph input or an eager result
    (``buffer_code`` names it, ``dtype_code`` its dtype)."""


@function
def Kernel(body: Value) -> Tensor:
    """Materialise ``body`` into a fresh contiguous buffer of its shape."""


@function
def Load(t: Tensor) -> Value:
    """Read a kernel's output buffer, whole and contiguous."""


@function
def LoadStrided(t: Tensor, shape: IntVec, strides: IntVec, offset: i64Like) -> Value:
    """Read an input buffer through a strided view (element strides and offset)."""


@function
def Const(bits: i64Like, dtype: i64Like) -> Value:
    """A scalar constant: the bits of its float64 value, and its dtype code."""


@function
def Iota(shape: IntVec, axis: i64Like) -> Value:
    """The index along ``axis`` of an iteration space of ``shape`` (int64)."""


@function
def Where(cond: Value, a: Value, b: Value) -> Value:
    ...


@function
def Cast(x: Value, dtype: i64Like) -> Value:
    ...


@function
def Broadcast(x: Value, shape: IntVec) -> Value:
    """Numpy-style broadcast of ``x`` to ``shape`` (right-aligned)."""


@function
def Reshape(x: Value, shape: IntVec) -> Value:
    """Row-major reshape to ``shape`` (same element count)."""


@function
def Permute(x: Value, perm: IntVec) -> Value:
    ...


@function
def Slice(x: Value, dim: i64Like, start: i64Like, step: i64Like, size: i64Like) -> Value:
    """Elements ``start, start+step, ...`` (``size`` of them) along ``dim``."""


@function
def Cat(a: Value, b: Value, dim: i64Like) -> Value:
    """``a`` followed by ``b`` along ``dim``."""


@function
def Gather(x: Value, index: Value, dim: i64Like) -> Value:
    """``x`` read along ``dim`` at ``index``'s values (``torch.gather``): the result has
    ``index``'s shape, which is ``x``'s in every other dim. An index outside ``x`` reads
    NaN (0 for integers) where eager raises: the kernel cannot raise, and must not read
    outside the buffer."""


@function
def Dot(a: Value, b: Value) -> Value:
    """Matrix product over the last axis of ``a`` and the second-last of ``b``:
    ``[*batch, M, K] x [*batch, K, N] -> [*batch, M, N]`` (same batch dims; a broadcast
    batch is an index map on the operand). Accumulates in float32; the result has the
    operands' dtype."""


@function
def ExpDot(s: Value, v: Value) -> Value:
    """``Dot(Cast(exp(s - rowmax(s)), dtype(v)), v)``: the product of the unnormalised
    softmax of the scores ``s`` [*batch, M, N] with ``v`` [*batch, N, D], accumulated in
    float32; the result has ``v``'s dtype. It is the part of attention that streams: the
    row max may be a running max, the accumulator rescaled when it grows."""


@function
def ExpSum(s: Value) -> Value:
    """``Reduce_sum(exp(s - rowmax(s)))`` [*batch, M, 1]: the softmax denominator, which
    streams with the same running max as ``ExpDot``."""


@function
def vdtype(x: Value) -> i64:
    """Dtype analysis (a dtype code): set by the translator on every value it creates."""


@function
def vshape(x: Value) -> IntVec:
    """Shape analysis: set by the translator on every value it creates."""


# --- operators: one constructor each ------------------------------------------------------
# An operator is part of the constructor's name (``Binary_add``), not a string argument, and
# dtypes and buffers are small integer codes: egglog 13.2 was seen to hand back e-nodes
# whose string argument belonged to another term (``Binary("float32", ...)``), now and
# then, in long sessions. The schema has no strings at all.

def _declare(kind: str, names, params: str) -> dict:
    table = {}
    for name in names:
        ns = {"Value": Value}
        exec(f"def {kind}_{name}({params}) -> Value: ...", ns)  # noqa: S102 - a fixed template
        fn = ns[f"{kind}_{name}"]
        fn.__module__ = __name__
        table[name] = function(fn)
    return table


def _op_names():
    from .ops import BINARY, REDUCE, UNARY
    return UNARY, BINARY, REDUCE


_UNARY, _BINARY, _REDUCE = (_declare(kind, names, params) for kind, names, params in zip(
    ("Unary", "Binary", "Reduce"), _op_names(), ("x: Value", "a: Value, b: Value", "x: Value")))


def Unary(op: str, x: Value) -> Value:
    return _UNARY[op](x)


def Binary(op: str, a: Value, b: Value) -> Value:
    return _BINARY[op](a, b)


def Reduce(op: str, x: Value) -> Value:
    """Reduce over the last axis, keeping it with size 1 (``sum``, ``max``, ``min``)."""
    return _REDUCE[op](x)


# --- helpers for building terms -----------------------------------------------------------

def float_bits(x: float) -> int:
    """The float64 bits of ``x`` as a signed i64, the key of a constant."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def ivec(values) -> Vec[i64]:
    values = [int(v) for v in values]
    if not values:
        return Vec[i64].empty()
    return Vec[i64](*(i64(v) for v in values))


def const(value, dtype: str) -> Value:
    return Const(float_bits(float(value)), dtype_code(dtype))


def dtype_code(dtype: str) -> int:
    from .ops import DTYPES
    return list(DTYPES).index(dtype)


def dtype_name(code: int) -> str:
    from .ops import DTYPES
    return list(DTYPES)[code]


_EXT = 1 << 20


def buffer_code(name: str) -> int:
    """``in<k>`` -> k; ``ext<j>_<k>`` (output k of eager node j) -> 2^20 + j * 2^10 + k."""
    if name.startswith("in"):
        return int(name[2:])
    j, k = name[3:].split("_")
    return _EXT + (int(j) << 10) + int(k)


def buffer_name(code: int) -> str:
    if code < _EXT:
        return f"in{code}"
    code -= _EXT
    return f"ext{code >> 10}_{code & 1023}"
