"""The typed egglog schema: graph-level tensors and kernel-level values.

Two sorts, as in the e-graph tensor compilers this project learns from:

* ``Tensor`` is a buffer in memory: a graph input (``Input``) or the output of a kernel
  (``Kernel(value)``).
* ``Value`` lives inside one kernel. ``Load(t)`` reads a kernel output whole and contiguous,
  ``LoadStrided`` reads an input buffer through a strided view. Everything else is
  pointwise arithmetic, a reduction over the last axis, or an index map (broadcast,
  reshape, permute, slice, cat) that changes how the iteration index reaches the operand.

The translator first states every FX op as its own kernel; the fusion rule
``Load(Kernel(u)) == u`` then offers the fused form and extraction chooses where kernel
boundaries fall. Float constants are keyed by the bits of their float64 value, so that
``0.0`` and ``-0.0`` differ and NaN equals itself.

Importing this module imports egglog (about 0.4 s): import it lazily.
"""

from __future__ import annotations

import struct

from egglog import Expr, String, StringLike, Vec, function, i64, i64Like


class Tensor(Expr):
    """A materialised buffer."""


class Value(Expr):
    """A kernel-level value: one element per point of the iteration space."""


IntVec = Vec[i64]


@function
def Input(name: StringLike, dtype: StringLike) -> Tensor:  # noqa: N802 - egglog constructor
    """A buffer the kernels read but do not compute: a graph input or an eager result."""


@function
def Kernel(body: Value) -> Tensor:  # noqa: N802
    """Materialise ``body`` into a fresh contiguous buffer of its shape."""


@function
def Load(t: Tensor) -> Value:  # noqa: N802
    """Read a kernel's output buffer, whole and contiguous."""


@function
def LoadStrided(t: Tensor, shape: IntVec, strides: IntVec, offset: i64Like) -> Value:  # noqa: N802
    """Read an input buffer through a strided view (element strides and offset)."""


@function
def Const(bits: i64Like, dtype: StringLike) -> Value:  # noqa: N802
    """A scalar constant: the bits of its float64 value, and its dtype."""


@function
def Iota(shape: IntVec, axis: i64Like) -> Value:  # noqa: N802
    """The index along ``axis`` of an iteration space of ``shape`` (int64)."""


@function
def Unary(op: StringLike, x: Value) -> Value:  # noqa: N802
    ...


@function
def Binary(op: StringLike, a: Value, b: Value) -> Value:  # noqa: N802
    ...


@function
def Where(cond: Value, a: Value, b: Value) -> Value:  # noqa: N802
    ...


@function
def Cast(x: Value, dtype: StringLike) -> Value:  # noqa: N802
    ...


@function
def Reduce(op: StringLike, x: Value) -> Value:  # noqa: N802
    """Reduce over the last axis, keeping it with size 1 (``sum``, ``max``, ``min``)."""


@function
def Broadcast(x: Value, shape: IntVec) -> Value:  # noqa: N802
    """Numpy-style broadcast of ``x`` to ``shape`` (right-aligned)."""


@function
def Reshape(x: Value, shape: IntVec) -> Value:  # noqa: N802
    """Row-major reshape to ``shape`` (same element count)."""


@function
def Permute(x: Value, perm: IntVec) -> Value:  # noqa: N802
    ...


@function
def Slice(x: Value, dim: i64Like, start: i64Like, step: i64Like, size: i64Like) -> Value:  # noqa: N802
    """Elements ``start, start+step, ...`` (``size`` of them) along ``dim``."""


@function
def Cat(a: Value, b: Value, dim: i64Like) -> Value:  # noqa: N802
    """``a`` followed by ``b`` along ``dim``."""


@function
def vdtype(x: Value) -> String:
    """Dtype analysis: set by the translator on every value it creates."""


@function
def vshape(x: Value) -> IntVec:
    """Shape analysis: set by the translator on every value it creates."""


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
    return Const(float_bits(float(value)), dtype)
