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
class Digit:
    """One digit of a mixed-radix index: ``(atom // lo) % size`` of a kernel index ``atom``
    that runs over ``0 .. extent-1``."""
    atom: Idx
    extent: int
    lo: int
    size: int

    def idx(self) -> Idx:
        if self.size == 1:
            return ZERO
        e = self.atom.expr
        if self.lo != 1:
            e = f"({e} // {self.lo})"
        if self.lo * self.size != self.extent:
            e = f"({e} % {self.size})"
        return Idx(e, self.atom.axes)


def _merge(digits) -> tuple:
    """Adjacent digits of one atom that are contiguous in it become one digit."""
    out: list[Digit] = []
    for d in digits:
        if d.size == 1:
            continue
        prev = out[-1] if out else None
        if prev is not None and prev.atom == d.atom and prev.lo == d.lo * d.size:
            out[-1] = Digit(d.atom, d.extent, d.lo, prev.size * d.size)
        else:
            out.append(d)
    return tuple(out)


def _group_idx(group) -> Idx:
    """The index of a dimension made of ``group`` (outer digit first)."""
    if not group:
        return ZERO
    terms, axes, scale = [], frozenset(), 1
    for d in reversed(group):
        i = d.idx()
        terms.append(i.expr if scale == 1 else f"{i.expr} * {scale}")
        axes |= i.axes
        scale *= d.size
    return Idx(terms[0] if len(terms) == 1 else "(" + " + ".join(reversed(terms)) + ")", axes)


def regroup(digits, shape) -> tuple | None:
    """Split a mixed-radix index (``digits``, outer first) into one digit group per dim of
    ``shape``; None where a dim does not fall on digit boundaries that divide evenly."""
    pending = [d for d in digits if d.size != 1]
    groups = []
    for size in reversed(tuple(shape)):
        group, need = [], int(size)
        while need > 1:
            if not pending:
                return None
            d = pending.pop()
            if d.size <= need:
                if need % d.size:
                    return None
                group.append(d)
                need //= d.size
            else:
                if d.size % need:
                    return None
                group.append(Digit(d.atom, d.extent, d.lo, need))
                pending.append(Digit(d.atom, d.extent, d.lo * need, d.size // need))
                need = 1
        groups.append(_merge(reversed(group)))
    if pending:
        return None
    return tuple(reversed(groups))


@dataclass(frozen=True)
class Env:
    shape: tuple
    dims: tuple  # Idx per dim
    linear: Idx | None = None
    # Per dim, the digits its index is made of: lets index maps compose exactly, so that
    # a value reached through reshape -> permute -> reshape has the index it started with.
    groups: tuple | None = None
    guard: Idx | None = None  # an extra condition under which loads are valid (cat branches)


def env_of(atoms, shape, linear: Idx | None = None) -> Env:
    """The environment over ``shape`` whose row-major linear index is the mixed-radix
    number of ``atoms`` ((Idx, extent) pairs, outer first)."""
    digits = [Digit(a, n, 1, n) for a, n in atoms]
    groups = regroup(digits, shape)
    assert groups is not None, (atoms, shape)
    return Env(tuple(shape), tuple(_group_idx(g) for g in groups), linear, groups)


def unravel(linear: Idx, shape) -> tuple:
    """Per-dim indices of a row-major linear index over ``shape``."""
    return env_of([(linear, math.prod(shape))], shape).dims


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
    for d, st in _strided_terms(env, strides, shape):
        terms.append(d.expr if st == 1 else f"{d.expr} * {st}")
        axes |= d.axes
    if offset:
        terms.append(str(offset))
    return Idx(" + ".join(terms) if terms else "0", axes)


def _strided_terms(env: Env, strides, shape) -> list:
    """(index, stride) pairs whose products add up to the offset of ``env`` in a tensor of
    ``shape`` laid out with ``strides``. Where the environment knows its digits, two digits
    of one kernel index that are neighbours both in the index and in memory are one term:
    a [B, S, H] buffer read at row m of its [B * S, H] view is ``m * H``, not
    ``(m // S) * (S * H) + (m % S) * H`` (a division per element, and, where S is taken
    at launch, by a number Triton cannot see)."""
    if env.groups is None:
        return [(d, st) for d, st, size in zip(env.dims, strides, shape) if not (d.is_zero or st == 0 or size == 1)]
    digits: list = []  # (digit, stride), outer first
    for group, st, size in zip(env.groups, strides, shape):
        if st == 0 or size == 1:
            continue
        inner = [d for d in group if d.size != 1]
        scale = [st * math.prod(d.size for d in inner[k + 1:]) for k in range(len(inner))]
        for d, s in zip(inner, scale):
            if digits:
                prev, prev_st = digits[-1]
                if prev.atom == d.atom and prev.lo == d.lo * d.size and prev_st == s * d.size:
                    digits[-1] = (Digit(d.atom, d.extent, d.lo, prev.size * d.size), s)
                    continue
            digits.append((d, s))
    return [(d.idx(), s) for d, s in digits]


def _squeezed(shape):
    return tuple(s for s in shape if s != 1)


def reshape_env(env: Env, shape) -> Env:
    """The environment of a reshape's operand (of ``shape``), given the reshape's own."""
    shape = tuple(shape)
    if shape == env.shape:
        return env
    if _squeezed(shape) == _squeezed(env.shape):
        nonunit = iter(k for k, s in enumerate(env.shape) if s != 1)
        picks = [None if s == 1 else next(nonunit) for s in shape]
        dims = tuple(ZERO if k is None else env.dims[k] for k in picks)
        groups = None if env.groups is None else tuple(() if k is None else env.groups[k] for k in picks)
        return replace(env, shape=shape, dims=dims, groups=groups)
    if env.groups is not None:
        groups = regroup([d for g in env.groups for d in g], shape)
        if groups is not None:
            return replace(env, shape=shape, dims=tuple(_group_idx(g) for g in groups), groups=groups)
    linear = linear_of(env)
    return Env(shape, unravel(linear, shape), linear, None, env.guard)


def broadcast_env(env: Env, src_shape) -> Env:
    """Operand environment of a broadcast from ``src_shape`` to ``env.shape``."""
    src_shape = tuple(src_shape)
    lead = len(env.shape) - len(src_shape)
    if src_shape == env.shape:
        return env
    dims = tuple(ZERO if s == 1 else env.dims[lead + k] for k, s in enumerate(src_shape))
    groups = None if env.groups is None else \
        tuple(() if s == 1 else env.groups[lead + k] for k, s in enumerate(src_shape))
    return Env(src_shape, dims, None, groups, env.guard)


def permute_env(env: Env, perm, src_shape) -> Env:
    dims = [None] * len(perm)
    for k, p in enumerate(perm):
        dims[p] = env.dims[k]
    if list(perm) == sorted(perm):
        return env
    groups = None
    if env.groups is not None:
        groups = [None] * len(perm)
        for k, p in enumerate(perm):
            groups[p] = env.groups[k]
        groups = tuple(groups)
    return Env(tuple(src_shape), tuple(dims), None, groups, env.guard)


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
    """Operand environment of one branch of a cat: index shifted, guarded by ``cond``.

    Where the cat's dim is one digit of a kernel index, the shifted index becomes a digit
    of its own (an atom running over the branch), so index maps below the branch still
    compose exactly: ``(k - 768) % 64`` rather than the unravelled linear index, whose
    divisions hide from Triton that neighbouring lanes read neighbouring addresses."""
    d = env.dims[dim]
    dims = list(env.dims)
    dims[dim] = Idx(f"({d.expr} - {shift})", d.axes) if shift else d
    guard = cond if env.guard is None else Idx(f"({env.guard.expr} & {cond.expr})", env.guard.axes | cond.axes)
    groups = None
    if env.groups is not None and len(env.groups[dim]) == 1:
        size = int(src_shape[dim])
        groups = list(env.groups)
        groups[dim] = (Digit(dims[dim], size, 1, size),)
        groups = tuple(groups)
    return Env(tuple(src_shape), tuple(dims), None, groups, guard)


def gathered_env(env: Env, dim: int, index: Idx, src_shape, digits: bool = False) -> Env:
    """Where a gather's table is evaluated: the gather's environment with ``dim`` read at
    ``index`` (a value loaded in the kernel, which no digit describes). ``digits``: the
    other dims keep theirs, for the analyses of which way reads run (codegen/access.py),
    where ``index`` stands for any row; index maps below the table, evaluated, would take
    a digit for the gathered dim's index."""
    dims = list(env.dims)
    dims[dim] = index
    groups = None
    if digits and env.groups is not None:
        groups = tuple(() if d == dim else g for d, g in enumerate(env.groups))
    return Env(tuple(src_shape), tuple(dims), None, groups, env.guard)


def operand_env(node, env) -> Env:
    """Where an index map's operand is evaluated, given where the map itself is."""
    src = node.args[0].shape
    if node.op == "broadcast":
        return broadcast_env(env, src)
    if node.op == "reshape":
        return reshape_env(env, src)
    if node.op == "permute":
        return permute_env(env, node.attrs[0], src)
    dim, start, step = node.attrs
    return slice_env(env, dim, start, step, src)


def env_key(env: Env):
    return (env.shape, env.dims, env.guard)
