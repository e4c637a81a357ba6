"""Which way a kernel's reads run: the load nodes under a value with the environments they
are evaluated at, and, for a load, the kernel index digit that moves along its unit-stride
dimension. The schedules use it to lay out tiles so that neighbouring lanes read
neighbouring addresses (codegen/pointwise.py; column reductions in codegen/kernel.py)."""

from __future__ import annotations

from dataclasses import replace

from ..schema.plan import PNode
from .indexing import ZERO, Digit, Env, Idx, env_key, gathered_env, operand_env, shifted_env, strided_offset

INDEX_MAPS = ("broadcast", "reshape", "permute", "slice")


def loads_at(node: PNode, env: Env) -> list:
    """(load, the environment it is evaluated at) for every load under ``node`` evaluated at
    ``env``, not looking inside reductions (they are evaluated over their own shape)."""
    out: list = []
    _walk(node, env, out, set())
    return out


def _walk(node: PNode, env: Env, out: list, seen: set):
    key = (id(node), env_key(env))
    if key in seen:
        return
    seen.add(key)
    if node.op == "load":
        out.append((node, env))
    elif node.op in INDEX_MAPS:
        _walk(node.args[0], operand_env(node, env), out, seen)
    elif node.op == "cat":
        (dim,) = node.attrs
        a, b = node.args
        # Which branch a point takes does not matter here, and a shifted index still moves
        # with the same kernel digits: the branches keep the cat's digit structure.
        anywhere = Idx("True")
        for part, shift in ((a, 0), (b, a.shape[dim])):
            _walk(part, replace(shifted_env(env, dim, shift, part.shape, anywhere), groups=env.groups), out, seen)
    elif node.op == "gather":  # the table's reads along its other dims run as stored (a row of an embedding)
        (dim,) = node.attrs
        table, index = node.args
        _walk(index, env, out, seen)
        _walk(table, gathered_env(env, dim, ZERO, table.shape, digits=True), out, seen)
    elif node.op != "reduce":
        for a in node.args:
            if tuple(a.shape) == tuple(env.shape):  # a rank-0 operand is the same everywhere
                _walk(a, env, out, seen)


def unit_stride_digit(load: PNode, env: Env) -> Digit | None:
    """The lowest digit of the kernel index along the load's unit-stride dimension: the
    index whose neighbouring values read neighbouring addresses. None where unknown (no
    digit structure, or no unit-stride dimension)."""
    _, strides, _ = load.attrs
    if env.groups is None:
        return None
    for stride, size, group in zip(strides, load.shape, env.groups):
        if stride == 1 and size > 1 and group:
            return group[-1]
    return None


def address_step(load: PNode, env: Env, index: str, point: dict) -> int:
    """Elements the load's address moves when kernel index ``index`` steps by one from
    ``point`` (index name -> value): computed on the offset expression itself, so it holds
    where the digit structure is lost (after a cat, a reshape of a shifted index)."""
    return address_steps(load, env)(index, point)


def address_steps(load: PNode, env: Env):
    """``address_step`` of one load at ``env`` as a function of (index, point), its offset
    expression written and compiled once (a reduction's schedule asks four steps a load:
    written each time, they were half of the schedule's time in BERT's extraction)."""
    _, strides, offset = load.attrs
    code = compile(strided_offset(env, strides, load.shape, offset).expr, "<offset>", "eval")
    empty = {"__builtins__": {}}

    def step(index: str, point: dict) -> int:
        here = eval(code, empty, dict(point))  # noqa: S307 - our own index arithmetic
        return eval(code, empty, {**point, index: point[index] + 1}) - here  # noqa: S307
    return step


def meta_view(shape, strides, offset: int = 0):
    """A meta tensor (no memory) viewing ``shape`` at ``strides`` and ``offset``: torch
    then works out what views of it keep a view."""
    import torch
    extent = offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    return torch.empty(extent, device="meta").as_strided(shape, strides, offset)


def strided_view(node: PNode):
    """``(buffer, meta tensor)``: the strides and offset at which ``node`` reads its buffer,
    where it is a load under index maps torch can express as a view; None otherwise. A
    meta tensor keeps strides and offsets through slices, permutes, views and expands,
    without memory."""
    if node.op == "load":
        buf, strides, offset = node.attrs
        return buf, meta_view(node.shape, strides, offset)
    if node.op not in INDEX_MAPS:
        return None
    inner = strided_view(node.args[0])
    if inner is None:
        return None
    buf, t = inner
    try:
        if node.op == "slice":
            dim, start, step = node.attrs
            strides = list(t.stride())
            strides[dim] *= step
            t = t.as_strided(node.shape, strides, t.storage_offset() + start * t.stride(dim))
        elif node.op == "permute":
            t = t.permute(*node.attrs[0])
        elif node.op == "reshape":
            t = t.view(node.shape)
        else:
            t = t.expand(node.shape)
    except RuntimeError:  # a reshape that is no view of these strides
        return None
    return buf, t if tuple(t.shape) == tuple(node.shape) else None


def grouped_view(node: PNode):
    """``(buffer, meta tensor, group)`` for an operand of attention whose heads are the
    stored heads each repeated ``group`` times in a row (grouped-query attention: k and v
    through ``repeat_interleave``, or ``expand`` and ``reshape``, as transformers'
    ``repeat_kv`` writes it), the meta tensor viewing the stored heads: head ``h`` reads
    stored head ``h // group``. ``group`` is 1 where ``node`` is a plain strided view;
    None where it is neither. Above the merge of (stored heads, repeats) only permutes
    that keep the dims up to the heads in place are taken."""
    plain = strided_view(node)
    if plain is not None:
        return (*plain, 1)
    chain, inner = [], None
    while node.op in INDEX_MAPS:
        chain.append(node)
        inner = strided_view(node.args[0])
        if inner is not None:
            break
        node = node.args[0]
    if inner is None or node.op != "reshape":
        return None
    buf, t = inner
    merged = _merged_repeats(t, tuple(node.shape))
    if merged is None:
        return None
    repeats, head = merged
    t = t.select(repeats, 0)
    for above in reversed(chain[:-1]):
        perm = above.attrs[0] if above.op == "permute" else None
        if perm is None or list(perm[:head + 1]) != list(range(head + 1)):
            return None
        t = t.permute(*perm)
    return buf, t, node.shape[head] // t.shape[head]


def _merged_repeats(t, shape: tuple):
    """(the repeats dim, the heads dim) where ``shape`` is ``t``'s with a dim of stride 0
    (the repeats) merged into the dim before it (the stored heads); None otherwise."""
    for d in range(1, t.dim()):
        if t.stride(d) == 0 and t.shape[d] > 1:
            merged = (*t.shape[:d - 1], t.shape[d - 1] * t.shape[d], *t.shape[d + 1:])
            if merged == shape:
                return d, d - 1
    return None
