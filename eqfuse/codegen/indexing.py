"""Index environments: how the iteration index of a kernel reaches each value.

A value is evaluated at an ``Env``: one index expression per dimension of its shape (and
the row-major linear index when it is known cheaply). Index-map nodes (broadcast,
reshape, permute, slice, cat) transform the environment on the way down to the loads,
so fusing across a view is never a special case: the load at the bottom computes its
address from whatever environment reaches it.

Index expressions remember which kernel axes they depend on (``x`` for a pointwise
kernel; ``r`` rows and ``c`` columns for a reduction kernel), which gives each load its
mask and each value its block shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..schema.plan import contiguous_strides


@dataclass(frozen=True)
class Idx:
    expr: str
    axes: frozenset = frozenset()

    @property
    def is_zero(self) -> bool:
        return self.expr == "0"


ZERO = Idx("0")


@dataclass(frozen=True)
class Split:
    """The linear index is ``row * cols + col``: lets reshapes keep a row structure."""
    row: Idx
    col: Idx
    cols: int


@dataclass(frozen=True)
class Env:
    shape: tuple
    dims: tuple  # Idx per dim
    linear: Idx | None = None
    split: Split | None = None
    guard: Idx | None = None  # an extra condition under which loads are valid (cat branches)


def unravel(linear: Idx, shape) -> tuple:
    """Per-dim indices of a row-major linear index over ``shape``."""
    dims = []
    first = True
    for k, size in enumerate(shape):
        if size == 1:
            dims.append(ZERO)
            continue
        stride = math.prod(shape[k + 1:])
        e = linear.expr if stride == 1 else f"({linear.expr} // {stride})"
        if not first:
            e = f"({e} % {size})"
        first = False
        dims.append(Idx(e, linear.axes))
    return tuple(dims)


def linear_of(env: Env) -> Idx:
    if env.linear is not None:
        return env.linear
    terms, axes = [], frozenset()
    for d, st in zip(env.dims, contiguous_strides(env.shape)):
        if d.is_zero:
            continue
        terms.append(d.expr if st == 1 else f"{d.expr} * {st}")
        axes |= d.axes
    return Idx("(" + " + ".join(terms) + ")" if terms else "0", axes)


def strided_offset(env: Env, strides, shape, offset: int = 0) -> Idx:
    """The element offset of the point ``env`` in a tensor of ``shape`` laid out with
    ``strides`` (broadcast and unit dims cost nothing)."""
    if env.linear is not None and offset == 0 and tuple(strides) == contiguous_strides(shape):
        return env.linear
    terms, axes = [], frozenset()
    for d, st, size in zip(env.dims, strides, shape):
        if d.is_zero or st == 0 or size == 1:
            continue
        terms.append(d.expr if st == 1 else f"{d.expr} * {st}")
        axes |= d.axes
    if offset:
        terms.append(str(offset))
    return Idx(" + ".join(terms) if terms else "0", axes)


def _squeezed(shape):
    return tuple(s for s in shape if s != 1)


def reshape_env(env: Env, shape) -> Env:
    """The environment of a reshape's operand (of ``shape``), given the reshape's own."""
    shape = tuple(shape)
    if shape == env.shape:
        return env
    if _squeezed(shape) == _squeezed(env.shape):
        nonunit = iter(d for d, s in zip(env.dims, env.shape) if s != 1)
        dims = tuple(ZERO if s == 1 else next(nonunit) for s in shape)
        return replace(env, shape=shape, dims=dims)
    if env.split is not None and shape and shape[-1] == env.split.cols:
        sp = env.split
        return replace(env, shape=shape, dims=unravel(sp.row, shape[:-1]) + (sp.col,))
    linear = linear_of(env)
    return Env(shape, unravel(linear, shape), linear, None, env.guard)


def broadcast_env(env: Env, src_shape) -> Env:
    """Operand environment of a broadcast from ``src_shape`` to ``env.shape``."""
    src_shape = tuple(src_shape)
    lead = len(env.shape) - len(src_shape)
    dims = tuple(ZERO if s == 1 else env.dims[lead + k] for k, s in enumerate(src_shape))
    same = src_shape == env.shape
    return Env(src_shape, dims, env.linear if same else None, env.split if same else None, env.guard)


def permute_env(env: Env, perm, src_shape) -> Env:
    dims = [None] * len(perm)
    for k, p in enumerate(perm):
        dims[p] = env.dims[k]
    if list(perm) == sorted(perm):
        return env
    return Env(tuple(src_shape), tuple(dims), None, None, env.guard)


def slice_env(env: Env, dim, start, step, src_shape) -> Env:
    d = env.dims[dim]
    e = d.expr if step == 1 else f"{d.expr} * {step}"
    if start:
        e = f"({e} + {start})"
    dims = list(env.dims)
    dims[dim] = Idx(e, d.axes) if not (d.is_zero and not start) else d
    if d.is_zero and start:
        dims[dim] = Idx(str(start))
    return Env(tuple(src_shape), tuple(dims), None, None, env.guard)


def shifted_env(env: Env, dim, shift, src_shape, cond: Idx) -> Env:
    """Operand environment of one branch of a cat: index shifted, guarded by ``cond``."""
    d = env.dims[dim]
    dims = list(env.dims)
    dims[dim] = Idx(f"({d.expr} - {shift})", d.axes) if shift else d
    guard = cond if env.guard is None else Idx(f"({env.guard.expr} & {cond.expr})", env.guard.axes | cond.axes)
    return Env(tuple(src_shape), tuple(dims), None, None, guard)


def env_key(env: Env):
    return (env.shape, env.dims, env.guard)
