"""The attention schedule: softmax products streamed over the key axis (flash attention).

A kernel whose plan holds ``ExpDot(s, v)`` / ``ExpSum(s)`` (see schema/terms.py; the
softmax rules produce them) gets one program per ``BLOCK_M`` rows of the scores ``s``
[*batch, M, N] and batch entry. The program walks N in ``BLOCK_N`` steps: it computes the
score tile (``s`` is any pointwise function of at most one product ``q @ k^T`` and of
masks, biases and scales), keeps a running row max, and rescales what it has accumulated
whenever the max grows, so the scores never leave registers:

    m_new = max(m, rowmax(s_tile));   alpha = exp(m - m_new);   p = exp(s_tile - m_new)
    l = l * alpha + rowsum(p);        acc = acc * alpha + p @ v_tile;   m = m_new

``ExpSum(s)`` is ``l`` at the end, ``ExpDot(s, v)`` is ``acc``, and ``Reduce_max(s)`` is
``m`` (a log-sum-exp needs it). Everything after them (the division by ``l``, casts, a
store of the log-sum-exp) runs on the program's rows after the loop.

Tiles a mask removes entirely are never visited: when the scores are certainly ``-inf``
wherever a condition on the row and column indices says so (a causal ``tril``, a
sliding window), the band of columns a row can see is found at compile time and each
program's loop runs over its rows' band only. Within the band, such a mask is the same
on every tile a program's rows see whole (below a causal diagonal, it keeps everything):
the loop is split in two, the tiles every row sees whole first, with no mask code at all,
then the few tiles the band's edge crosses, with the mask (see ``unmasked_scores``).
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import replace

import torch

from ..errors import Unschedulable
from ..schema import ops
from ..schema.plan import KernelSpec, PNode, chain_cut, operand_cut, readers, reads_any
from . import tma
from .indexing import Env, Idx, env_of, reshape_env, strided_offset
from .kernel import KernelWriter, Val, literal, operand_key
from .schedules import next_pow2
from .tiles import MIN_BLOCK, well_formed

# (BLOCK_M, BLOCK_N, num_warps, num_stages), each timed by the autotuner. The first is the
# untimed choice. On an H100 (benchmarks/attention_probe.py) 64 x 64 on 4 warps, two
# programs per SM, was the fastest for head dim 64 and for head dim 128 at 2048 keys,
# causal or not; 128 x 128 on 8 warps at 8192 keys, no mask. 64 x 32 on 2 stages is for
# head dims whose tiles the larger shapes cannot hold in shared memory.
TILES = [
    (64, 64, 4, 3),
    (128, 64, 4, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 32, 4, 2),
]
BAND_ANALYSIS_MAX = 1 << 28  # score elements (rows x columns) the mask analysis looks at
CONFIG_KEYS = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
# Offsets of K and V tiles are computed once, before the loops, where the accumulator
# takes at most this many registers per thread; above it (128 rows x 128 head dims on 4
# warps) the registers they hold made the kernel spill (H100: 38 spills, about 10% slower
# than recomputing them in the loop; benchmarks/attention_probe.py).
HOIST_MAX_ACC_REGS = 64
LOG2E = 1 / math.log(2)


def streams(spec: KernelSpec) -> list[PNode]:
    """The softmax products and sums of an attention kernel; none where there is no product
    (a softmax's ``ExpSum`` alone is an ordinary row reduction: see ``spelled_out``)."""
    flows = [n for n in spec.walk() if n.op in ("expdot", "expsum")]
    return flows if any(n.op == "expdot" for n in flows) else []


def spelled_out(spec: KernelSpec) -> KernelSpec:
    """``spec`` with each ``ExpSum(s)`` written as ``sum(exp(s - rowmax(s)))``, for the row
    reduction schedule (a softmax whose sum the rules turned into an ExpSum)."""
    walk = spec.walk()
    if not any(n.op == "expsum" for n in walk):
        return spec
    memo: dict[int, PNode] = {}
    # The row max the kernel computes anyway (a log-softmax subtracts it): one, not two
    maxima = {id(n.args[0]): n for n in walk if n.op == "reduce" and n.attrs[0] == "max"}

    def go(n: PNode) -> PNode:
        if id(n) not in memo:
            args = tuple(go(a) for a in n.args)
            if n.op == "expsum":
                (s,) = args
                row = s.shape[:-1] + (1,)
                known = maxima.get(id(n.args[0]))
                top = go(known) if known is not None else PNode("reduce", ("max",), (s,), row, s.dtype)
                shifted = PNode("binary", ("sub",), (s, PNode("broadcast", (), (top,), s.shape, s.dtype)),
                                s.shape, s.dtype)
                exp = PNode("unary", ("exp",), (shifted,), s.shape, s.dtype)
                memo[id(n)] = PNode("reduce", ("sum",), (exp,), row, n.dtype, n.eclass)
            else:
                memo[id(n)] = n if args == n.args else replace(n, args=args)
        return memo[id(n)]
    return replace(spec, roots=[(go(r), b) for r, b in spec.roots])


def attention_schedule(spec: KernelSpec, flows: list[PNode]):
    from .schedules import MAX_GRID_Y, Schedule

    scores = {id(f.args[0]): f.args[0] for f in flows}
    if len(scores) != 1:
        raise Unschedulable("softmax products over different scores in one kernel", store=_between_attentions(flows))
    (s,) = scores.values()
    *batch, m, n = s.shape
    inner = s.walk()
    for x in inner:
        if x.op in ("expdot", "expsum", "reduce"):
            raise Unschedulable(f"a {x.op} inside attention scores",
                                store=_score_operands_reading(s, {id(x)}))
    dots = [x for x in inner if x.op == "dot"]
    values = [f.args[1] for f in flows if f.op == "expdot"]
    outer = [d for d in dots if not any(x is d for o in dots if o is not d for x in o.walk())]
    _check_read_as_stored(values + [d.args[1] for d in outer])
    if len(dots) > 1:
        raise Unschedulable("more than one product in attention scores",
                            store=[c for d in outer
                                   for c in operand_cut(d, {id(x) for x in dots if x is not d}) or [d.eclass]])
    widths = {v.shape[-1] for v in values}
    if len(widths) > 1:
        raise Unschedulable("softmax products of different widths in one kernel")
    d = widths.pop() if widths else 1
    dtypes = {v.dtype for v in values} | {x.dtype for dot in dots for x in dot.args}
    if len(dtypes) > 1:
        raise Unschedulable(f"attention operands of dtypes {sorted(dtypes)}")
    dtype = dtypes.pop() if dtypes else "float32"
    if dtype not in ("float16", "bfloat16", "float32"):
        raise Unschedulable(f"attention operands of {dtype}")
    for v in values:
        if any(x.op in ("dot", "expdot", "expsum", "reduce") for x in v.walk()):
            raise Unschedulable("a product or reduction inside attention values")
    inside = {id(x) for x in inner} | {id(x) for v in values for x in v.walk()}
    outside = [x for x in spec.walk() if id(x) not in inside and x.op in ("dot", "reduce")]
    if any(x.op == "dot" for x in outside):
        raise Unschedulable("a product outside attention scores", store=_cut_points(outside, flows))
    if any(x.op == "reduce" and not (x.attrs[0] == "max" and x.args[0] is s) for x in outside):
        raise Unschedulable("a reduction in an attention kernel", store=_cut_points(outside, flows))
    rows = math.prod(batch) * m
    for root, _ in spec.roots:
        if root.numel not in (rows * d, rows):
            raise Unschedulable(f"a root of {root.numel} elements in attention over {list(s.shape)}")
    if math.prod(batch) > MAX_GRID_Y:
        raise Unschedulable(f"a batch of {math.prod(batch)} attention heads (the grid takes {MAX_GRID_Y})")
    e = dots[0].args[0].shape[-1] if dots else 0
    band = masked_band(s)
    from . import flash
    return Schedule("attention", batch=tuple(batch), m=m, n=n, k=e, d=d, dot_dtype=dtype, dots=len(values),
                    band=band, flash=flash.form(spec, band, m) if flash.device_supports() else None)


def _between_attentions(flows: list[PNode]) -> list:
    """Where to cut a kernel holding the softmax products of several scores (an attention
    whose q, k or v come from another's output, two layers in one kernel): of each
    attention, its scores' own products' operands and its values where they read
    another's softmax products. None named where no attention reads another (the repair
    then tries every value inside). Unnamed, the repair weighed about 120 values a round
    for a tiny BERT's 24 rounds."""
    groups: dict[int, list[PNode]] = {}
    for f in flows:
        groups.setdefault(id(f.args[0]), []).append(f)
    cuts = []
    for own in groups.values():
        others = {id(f) for group in groups.values() if group is not own for f in group}
        cuts += _score_operands_reading(own[0].args[0], others)
        cuts += [c for f in own if f.op == "expdot" and reads_any(f.args[1], others) for c in chain_cut(f.args[1])]
    return list(dict.fromkeys(cuts))


def _score_operands_reading(s: PNode, inner: set) -> list:
    """The operands of the scores' own products (``q @ k^T``, not the products that made
    q and k) that read a node whose id is in ``inner`` (another attention's softmax
    product, a normalisation's row reduction), down to their first node of two operands:
    storing one moves that part out of the kernel. (Naming every product below the
    scores named 123 values a round for a tiny 8-layer BERT, whose last layer's scores
    reach back through every layer.)"""
    products, seen, stack = [], set(), [s]
    while stack:  # depth first from the scores, stopping at products
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if x.op == "dot":
            products.append(x)
        else:
            stack.extend(reversed(x.args))
    reading = readers(products, inner)
    return [c for x in products for c in operand_cut(x, inner, reading)]


def _cut_points(outside: list[PNode], flows: list[PNode]) -> list:
    """The classes whose storing cuts the products and reductions ``outside`` the attention
    out of its kernel: of one reading the attention's output (an output projection), its
    operand holding a softmax product, down through index maps and casts to the first
    value of two operands (the guard of a row the mask leaves no key); of one the attention
    reads (a projection, a norm), its own value. A repair left to choose among every value
    inside stored the softmax product under the guard, whose row max then needed the
    scores stored too (GPT-2 and GPT-NeoX at 1024 tokens with a bool mask: a matmul kernel
    writing 12 x 1024 x 1024 scores, which attention then read)."""
    flow_ids = {id(f) for f in flows}
    cut = [x for x in outside if not (x.op == "reduce" and x.attrs[0] == "max")]  # a row max: of the scores,
    reading = readers(cut, flow_ids)  # or of what a cut above removes
    return [c for x in cut for c in operand_cut(x, flow_ids, reading) or [x.eclass]]


def _check_read_as_stored(operands: list[PNode]) -> None:
    """Keys and values (the scores' product's right operand, the softmax products' values)
    are loads, through index maps, casts and scales by constants only. Anything computed
    on them runs in the key loop, once per block of queries, in series with the tensor
    cores (the loads of a plain operand pipeline behind them): on an H100 k's rotary
    embedding cost 4 times the pointwise rate there (cos and sin loaded;
    results/streamed-work-probe_*.json), and on an H200 GPT-NeoX's partial rotary, its cos
    and sin computed from the positions, made attention 1590 us against cuDNN's 77
    (results/zoo-infer_NVIDIA-H200_*.json). Checked before the scores' other products, so
    that the repair stores a computed k (its projection and its rotary embedding), not the
    scores, which are cheaper to store at a few positions and a plan of [S, S] buffers at
    every length."""
    for operand in operands:
        computed = _computed_part(operand)
        if computed is not None:
            raise Unschedulable("keys or values computed inside an attention kernel (recomputed for every "
                                "block of queries: a kernel of their own stores them)", store=[computed.eclass])


def _computed_part(node: PNode) -> PNode | None:
    """The first node below index maps, casts and constant scales that is computed, if any."""
    if node.op in ("load", "const"):
        return None
    if node.op in ("broadcast", "reshape", "permute", "slice", "cast"):
        return _computed_part(node.args[0])
    if node.op == "binary" and node.attrs[0] == "mul":
        if any(a.op == "const" or (a.op == "broadcast" and a.args[0].op == "const") for a in node.args):
            return next((p for p in map(_computed_part, node.args) if p is not None), None)
    return node


def attention_env(sched, axes: str, shape) -> Env:
    """The environment of a tile over ``axes``: b batch, m rows, n score columns, j value
    rows (the same keys as a column vector), d value columns, e / f the head dim of q
    (row) and k^T (column)."""
    extents = {"b": math.prod(sched.batch), "m": sched.m, "n": sched.n, "j": sched.n, "d": sched.d,
               "e": sched.k, "f": sched.k}
    atoms = [(Idx(f"{x}index", frozenset(x)), extents[x]) for x in "b" + axes]
    return env_of(atoms, tuple(sched.batch) + tuple(shape))


# --- which columns a row can see ------------------------------------------------------------

def masked_band(s: PNode) -> tuple | None:
    """``(lo, hi)`` such that every score a row ``i`` may use has its column ``j`` in
    ``i + lo <= j <= i + hi`` (elsewhere the score is certainly -inf); None when no
    mask is known or it removes no whole diagonal.

    Extraction weighs the same scores in many candidate kernels (GPT-2's forward: 79
    times, most of a second of its extraction), each a new tree: the answer is kept by
    the tree's structure."""
    return _kept(_bands, _structure(s, {}), 256, _masked_band, s)


_bands: dict = {}  # the structure of a scores tree -> its band


def _kept(cache: dict, key, limit: int, compute, *args):
    """``cache[key]``, ``compute(*args)`` the first time (on one thread: the analyses are
    torch's CPU ops), the oldest entry dropped once ``limit`` are kept. The mask analysis
    keeps its answers so, by the structure of the trees asked about: extraction asks about
    the same scores and masks in many candidate kernels, each a new tree."""
    if key not in cache:
        if len(cache) >= limit:
            cache.pop(next(iter(cache)))
        with _one_thread():
            cache[key] = compute(*args)
    return cache[key]


@contextlib.contextmanager
def _one_thread():
    """torch's CPU ops on one thread, for the mask analysis: tensors of a score matrix's
    size at most, evaluated while the compile pool's workers start on every core. Over
    torch's thread pool each op waited for threads held elsewhere: on an H200 host,
    compiling GPT-2's block after torch.compile had, 11 analyses took 0.91 s (16 ms for
    one logical_and of 1M elements); on one thread they no longer showed in the profile.
    The thread count is the process's: torch ops another thread runs meanwhile get one too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _structure(node: PNode, memo: dict) -> tuple:
    """A hashable image of the tree under ``node``: equal for trees that compute the same."""
    key = memo.get(id(node))
    if key is None:
        key = memo[id(node)] = (node.op, node.attrs, node.shape, node.dtype,
                                tuple(_structure(a, memo) for a in node.args))
    return key


# A masked score written as a finite constant at or below this (the largest float16
# magnitude, negated): what torch's cuDNN attention turns a boolean mask into, and what
# transformers writes for half precision. Past it, exp(score - row max) is 0 in float32
# unless a row's scores span 65400, so a tile of such scores adds nothing to its row, as
# one of -inf does, provided the row sees some other key (else eager averages the values
# where -inf gives NaN): only then are such tiles skipped.
MASKED_AT_OR_BELOW = -65504.0


def _masked_band(s: PNode) -> tuple | None:
    *_, m, n = s.shape
    if m * n > BAND_ANALYSIS_MAX:
        return None
    band = _band(_certainly_neg_inf(s, -math.inf), m, n, every_row=False)
    return band if band is not None else _band(_certainly_neg_inf(s, MASKED_AT_OR_BELOW), m, n, every_row=True)


def _band(masked, m: int, n: int, every_row: bool) -> tuple | None:
    """The band of ``masked`` (see ``masked_band``); with ``every_row``, only where every
    row sees some key."""
    if masked is None:
        return None
    while masked.dim() > 2:  # a mask that differs between heads or batches: none of it
        masked = masked.all(0) if masked.shape[0] > 1 else masked[0]
    visible = ~masked.expand(m, n) if masked.dim() == 2 else ~masked.reshape(1, -1).expand(m, n)
    seen = visible.any(1)
    if not bool(seen.all() if every_row else seen.any()):
        return None
    rows = torch.arange(m)[seen]
    v = visible[seen].to(torch.int8)
    first = v.argmax(1)
    last = n - 1 - v.flip(1).argmax(1)
    lo, hi = int((first - rows).min()), int((last - rows).max())
    if lo <= -(m - 1) and hi >= n - 1:
        return None
    return lo, hi


def _certainly_neg_inf(node: PNode, floor: float = -math.inf):
    """A bool tensor broadcastable to ``node``'s shape, True where the value is -inf (or a
    constant at most ``floor`` on top of values that are not: see MASKED_AT_OR_BELOW)
    whatever the inputs; None where nothing is known."""
    op = node.op
    if op == "const":
        return torch.tensor(float(node.attrs[0]) <= floor)
    if op == "where":
        cond = _static_kept(node.args[0])
        a, b = (_certainly_neg_inf(x, floor) for x in node.args[1:])
        if cond is None:
            return a & b if a is not None and b is not None else None
        false = torch.tensor(False)
        return torch.where(cond.bool(), a if a is not None else false, b if b is not None else false)
    if op == "binary" and node.attrs[0] == "add":
        a, b = (_certainly_neg_inf(x, floor) for x in node.args)
        if a is None or b is None:
            return a if b is None else b
        return a | b
    if op == "binary" and node.attrs[0] in ("sub", "mul", "div"):
        other = _static_kept(node.args[1])
        if node.attrs[0] != "sub" and not (other is not None and bool((other > 0).all())):
            return None  # a scale must be a known positive number to keep -inf
        if floor > -math.inf and node.attrs[0] != "sub" and not bool(((other >= 1) if node.attrs[0] == "mul"
                                                                      else (other <= 1)).all()):
            return None  # nor may it bring a finite mask closer to 0
        return _certainly_neg_inf(node.args[0], floor)
    if op == "cast" and ops.is_float(node.dtype):
        return _certainly_neg_inf(node.args[0], floor)
    if op == "broadcast":
        return _certainly_neg_inf(node.args[0], floor)  # broadcasting is implicit for torch
    return None


def unmasked_scores(s: PNode, band) -> PNode | None:
    """The scores as they are where every row sees its keys whole: ``s`` with each
    subtree made of indices and constants (a causal mask, a -inf bias) that takes a single
    value on the band's diagonals ``j - i <= band[1]`` replaced by that value, and the
    selects and additions it decides folded away. None when the band has a lower edge (a
    sliding window keeps one masked loop), when such a subtree varies within the band (a
    mask that is not a band, a position bias), or when there is nothing to fold."""
    *_, m, n = s.shape
    if band is None or band[0] > -(m - 1) or band[1] < -(m - 1):  # a lower edge, or no pair inside
        return None
    folded: dict[int, PNode] = {}
    shapes: dict = {}  # _structure's memo

    def fold(node: PNode) -> PNode:
        if id(node) in folded:
            return folded[id(node)]
        out = node
        # Only through elementwise steps: below them the tile's indices are not (i, j).
        if node.op in ("broadcast", "unary", "binary", "where", "cast"):
            value = None if any(x.op == "load" for x in node.walk()) else \
                _inside_value(node, _structure(node, shapes), m, n, band[1])
            if value is None:
                out = _simplified(node, tuple(fold(a) for a in node.args))
            elif value is _VARIES:
                raise _Varies
            elif value is not _SCALAR:
                out = PNode("const", (value,), (), node.shape, node.dtype)
        folded[id(node)] = out
        return out

    try:
        out = fold(s)
    except _Varies:
        return None
    return None if out is s else out


def _scaled(scores: PNode) -> tuple:
    """``(x, c)`` from ``split_scale``, or ``(scores, None)``."""
    return split_scale(scores) or (scores, None)


class _Varies(Exception):
    """A static subtree of the scores takes more than one value inside the band."""


_VARIES, _SCALAR = object(), object()
_inside_values: dict = {}  # (structure, m, n, band's upper edge) -> _inside_value's answer


def _inside_value(node: PNode, structure: tuple, m: int, n: int, hi: int):
    """The one value a subtree of indices and constants takes on the diagonals
    ``j - i <= hi`` of an [m, n] score matrix: None where the subtree is not static (it
    holds a product), _SCALAR for a single number (nothing to fold), _VARIES where it takes
    several. Kept by the subtree's structure: evaluating it over the whole matrix took
    0.2 s at 2048 x 2048 keys, for each kernel generated or weighed."""
    return _kept(_inside_values, (structure, m, n, hi), 256, _value_inside, node, m, n, hi)


def _value_inside(node: PNode, m: int, n: int, hi: int):
    static = _static_kept(node)
    if static is None:
        return None
    if static.numel() <= 1:
        return _SCALAR
    inside = torch.arange(n)[None, :] - torch.arange(m)[:, None] <= hi
    value = _single_value(static, inside)
    return _VARIES if value is None else value


def _single_value(static: torch.Tensor, inside: torch.Tensor) -> float | None:
    """The one value ``static`` (broadcastable to [*batch, m, n]) takes where ``inside``;
    None if it takes several, or differs between heads."""
    while static.dim() > 2:
        if static.shape[0] > 1 and not bool((static == static[:1]).all()):
            return None
        static = static[0]
    picked = static.reshape((1,) * (2 - static.dim()) + tuple(static.shape)).expand(inside.shape)[inside]
    first = picked[0]
    return float(first) if bool((picked == first).all()) else None


def _simplified(node: PNode, args: tuple) -> PNode:
    """``node`` over ``args``, where a select on a constant condition is its branch and an
    addition of a constant 0 is the other operand."""
    if args == node.args:
        return node
    keep = None
    if node.op == "where" and args[0].op == "const":
        keep = args[1] if args[0].attrs[0] else args[2]
    if node.op == "binary" and node.attrs[0] in ("add", "sub") and args[1].op == "const" \
            and float(args[1].attrs[0]) == 0:
        keep = args[0]
    if node.op == "binary" and node.attrs[0] == "add" and args[0].op == "const" and float(args[0].attrs[0]) == 0:
        keep = args[1]
    if keep is not None and keep.shape == node.shape and keep.dtype == node.dtype:
        return keep
    return replace(node, args=args)


def log2_scaled(s: PNode, factor: float = LOG2E) -> PNode:
    """``s * factor`` with the factor folded into the constant scales, masks and biases it
    passes through, so that scores scaled by ``1/sqrt(d)`` become log2 units with one
    multiplication."""
    op = s.op
    if op == "const":
        return PNode("const", (float(s.attrs[0]) * factor,), (), s.shape, s.dtype)
    if op == "broadcast" or (op == "cast" and _cast_is_free(s)):
        return replace(s, args=(log2_scaled(s.args[0], factor),))
    if op == "where":
        c, a, b = s.args
        return replace(s, args=(c, log2_scaled(a, factor), log2_scaled(b, factor)))
    if op == "binary" and s.attrs[0] in ("add", "sub"):
        return replace(s, args=tuple(log2_scaled(a, factor) for a in s.args))
    if op == "binary" and s.attrs[0] in ("mul", "div"):
        a, c = s.args
        if s.attrs[0] == "mul" and a.op == "const":
            a, c = c, a
        k = float(c.attrs[0]) if c.op == "const" else 0.0
        if k != 0 and math.isfinite(k) and a.shape == s.shape and a.dtype == s.dtype:
            return log2_scaled(a, factor * k if s.attrs[0] == "mul" else factor / k)
    return PNode("binary", ("mul",), (s, PNode("const", (factor,), (), (), s.dtype)), s.shape, s.dtype)


def _cast_is_free(node: PNode) -> bool:
    """A cast the writer emits as nothing (to the same type, or from a narrow float to
    float32, which it computes in already): a scale passes it unchanged."""
    src, dst = node.args[0].dtype, node.dtype
    return dst == src or (dst == "float32" and src in ops.NARROW_FLOATS)


def split_scale(s: PNode) -> tuple[PNode, float] | None:
    """``(x, c)`` with ``s == x * c`` for a constant ``c > 0``, where the scores (in log2
    units) end in a multiplication by a constant, under free casts and a select whose
    other branch is -inf (-inf * c is -inf). The key loop then takes the row max of ``x``
    and scales it once per row (rounding is monotonic, so ``max(x) * c`` is the max of
    ``x * c``), and ``x * c - max`` becomes one FMA per score. None for other forms."""
    op = s.op
    if op == "cast" and _cast_is_free(s):
        inner = split_scale(s.args[0])
        return (replace(s, args=(inner[0],)), inner[1]) if inner is not None else None
    if op == "where":
        c, a, b = s.args
        for keep, other in ((a, b), (b, a)):
            if _is_neg_inf(other):
                inner = split_scale(keep)
                if inner is None or inner[0].shape != keep.shape:
                    return None
                args = (c, inner[0], other) if keep is a else (c, other, inner[0])
                return replace(s, args=args), inner[1]
        return None
    if op == "binary" and s.attrs[0] == "mul":
        a, k = s.args
        if a.op == "const":
            a, k = k, a
        if k.op == "const" and a.shape == s.shape and a.dtype == s.dtype:
            value = float(k.attrs[0])
            if 0 < value < math.inf:
                return a, value
    return None


def _is_neg_inf(node: PNode) -> bool:
    while node.op == "broadcast":
        node = node.args[0]
    return node.op == "const" and float(node.attrs[0]) == float("-inf")


def _static_kept(node: PNode):
    """``_static(node)``, kept by the subtree's structure for the next few trees that hold
    it: the candidate kernels of a graph share its mask, which at 2048 x 2048 scores took
    20-30 ms an op to evaluate again for each (Llama's inference graph: 7 times). Tensors
    of a score matrix's size: only a few are kept."""
    return _kept(_statics, _structure(node, {}), 8, _static, node)


_statics: dict = {}  # structure -> _static's value


def _static(node: PNode):
    """The value of a subtree made of indices and constants only (no loads), small: a
    broadcast is left to torch's implicit broadcasting. None if it reads memory."""
    op = node.op
    args = []
    for x in node.args:
        v = _static(x)
        if v is None:
            return None
        args.append(v)
    if op == "const":
        return torch.tensor(node.attrs[0], dtype=torch.float64 if ops.is_float(node.dtype) else torch.int64)
    if op == "iota":
        (axis,) = node.attrs
        shape = [1] * len(node.shape)
        shape[axis] = node.shape[axis]
        return torch.arange(node.shape[axis]).reshape(shape)
    if op == "unary":
        return ops.UNARY[node.attrs[0]].torch_fn(args[0])
    if op == "binary":
        return ops.BINARY[node.attrs[0]].torch_fn(args[0], args[1])
    if op == "where":
        return torch.where(args[0].bool(), args[1], args[2])
    if op == "cast":
        return args[0].to(ops.DTYPES[node.dtype])
    if op == "broadcast":
        return args[0]
    if op in ("reshape", "permute") and math.prod(node.shape) <= BAND_ANALYSIS_MAX:
        full = args[0].expand(node.args[0].shape)
        return full.reshape(node.shape) if op == "reshape" else full.permute(node.attrs[0])
    return None


# --- configurations ---------------------------------------------------------------------------

def candidates(sched) -> list[dict]:
    """Tile configurations in the model's order, clamped to the sizes, and where the
    kernel has the plain form on a Hopper GPU, the flash template's (codegen/flash.py):
    first where its tiles are 128 wide along the head dim (head dims 65 to 128), where it
    ran faster than the portable kernel in every case measured (H200, benchmarks/attention.py:
    0.98-1.04x SDPA's time at 128, the portable kernel 1.29-1.31x at S=2048), so that an
    untuned build runs it; after them elsewhere."""
    from . import flash
    out = []
    for bm, bn, warps, stages in TILES:
        cfg = {"BLOCK_M": max(MIN_BLOCK, min(bm, next_pow2(sched.m))),
               "BLOCK_N": max(MIN_BLOCK, min(bn, next_pow2(sched.n))),
               "num_warps": warps, "num_stages": stages}
        if cfg not in out:
            out.append(cfg)
    template = flash.candidates(sched)
    return template + out if flash.padded(sched.d) in (128, 256) else out + template


def runnable(cfg: dict) -> bool:
    """Whether a configuration (from a cache, or a user) is one an attention kernel can run
    with (the flash template's: the same keys and FLASH = 1 or 2, codegen/flash.py)."""
    if "FLASH" in cfg:
        return cfg["FLASH"] in (1, 2) and runnable({k: v for k, v in cfg.items() if k != "FLASH"})
    return well_formed(cfg, CONFIG_KEYS, ("BLOCK_M", "BLOCK_N"))


# --- the writer ---------------------------------------------------------------------------------

class AttentionWriter(KernelWriter):
    """Writes the streamed form; the score, value and epilogue expressions are the
    ordinary ones, evaluated at the environments below."""

    def __init__(self, spec, buffers, sched, runtime: frozenset = frozenset()):
        super().__init__(spec, buffers, sched, runtime)
        self.loop_axes = frozenset("nj")
        self.flows = streams(spec)
        self.scores = self.flows[0].args[0]
        # The scores each loop computes, in log2 units: masked (all of the band), and
        # unmasked (the tiles every row of a program sees whole) where the mask allows.
        # The writer keeps them: its memos are keyed by node id.
        # Each is (x, c): the scores are x * c, c a constant > 0 (see split_scale), or c
        # is None and x is the scores themselves.
        self.masked = _scaled(log2_scaled(self.scores))
        inner = unmasked_scores(self.scores, sched.band)
        self.unmasked = _scaled(log2_scaled(inner)) if inner is not None else None
        self.results: dict = {}  # node id -> Val after the loop
        self.offsets: dict = {}  # (buffer, offset tile at the loop's first key) -> its name
        self.cfg: dict = {}

    def env(self, axes: str, shape) -> Env:
        return attention_env(self.s, axes, shape)

    def out_env(self):
        return self.env("md", (self.s.m, self.s.d))

    def row_env(self):
        return self.env("m", (self.s.m, 1))

    def root_env(self, root):
        full = root.numel == math.prod(self.s.batch) * self.s.m * self.s.d
        base = self.out_env() if full else self.row_env()
        return reshape_env(base, root.shape)

    def tile_axes(self, root):
        # With D = 1 the output tile still spans BLOCK_D lanes: the base writer's store
        # gives its pointer the d axis from the value's axes
        full = root.numel == math.prod(self.s.batch) * self.s.m * self.s.d and self.s.d != 1
        return (("m", "mindex"), ("d", "dindex")) if full else (("m", "mindex"),)

    def _at_rows(self, env, want: Env, what: str):
        if env.dims != want.dims or env.guard is not None:
            raise Unschedulable(f"{what} reached through an index map that moves its rows")

    def _emit_expdot(self, node, env):
        self._at_rows(env, self.out_env(), "a softmax product")
        return self.results[id(node)]

    def _emit_expsum(self, node, env):
        self._at_rows(env, self.row_env(), "a softmax sum")
        return self.results[id(node)]

    def _emit_reduce(self, node, env):
        if node.attrs[0] != "max" or node.args[0] is not self.scores:
            raise Unschedulable("a reduction in an attention kernel")
        self._at_rows(env, self.row_env(), "a row max")
        return self.results["max"]

    def _emit_dot(self, node, env):
        self._at_rows(env, self.env("mn", (self.s.m, self.s.n)), "the scores' product")
        q = self.dot_operand(node.args[0], self.env("me", (self.s.m, self.s.k)), ("m", "e"),
                             "[BLOCK_M, BLOCK_E]")
        kt = self.dot_operand(node.args[1], self.env("fn", (self.s.k, self.s.n)), ("f", "n"),
                              "[BLOCK_E, BLOCK_N]")
        return self.assign(f"tl.dot({q}, {kt}{self.dot_precision()})", frozenset("mn"), "qk")

    def stream(self):
        """The loops over the key axis, and the results they leave."""
        lines = self.lines
        lines.append('m_run = tl.full([BLOCK_M], -float("inf"), tl.float32)')
        sums = [f for f in self.flows if f.op == "expsum"]
        prods = [f for f in self.flows if f.op == "expdot"]
        for i, _ in enumerate(sums):
            lines.append(f"l{i} = tl.zeros([BLOCK_M], dtype=tl.float32)")
        for i, _ in enumerate(prods):
            lines.append(f"acc{i} = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)")
        if self.unmasked is not None:
            self.key_loop("lo", "mid", self.unmasked, sums, prods, "Keys every row of the block sees: no mask.")
            self.key_loop("mid", "hi", self.masked, sums, prods, "Keys the mask's edge crosses.")
        else:
            self.key_loop("lo", "hi", self.masked, sums, prods)
        # A row with no score above -inf: softmax is 0 / 0 there, as in eager.
        lines.append('empty = (m_run == -float("inf"))[:, None]')
        for i, f in enumerate(sums):
            self.results[id(f)] = Val(f'tl.where(empty, float("nan"), l{i}[:, None])', frozenset("m"))
        for i, f in enumerate(prods):
            self.results[id(f)] = Val(f'tl.where(empty, float("nan"), acc{i})', frozenset("md"))
        self.results["max"] = Val(f"(m_run[:, None] * {math.log(2)!r})", frozenset("m"))

    def key_loop(self, start: str, stop: str, scores: tuple, sums, prods, note: str = ""):
        """One loop over key tiles ``start..stop``, with ``scores`` (in log2 units, as
        ``(x, c)``: see ``__init__``), under the comment ``note``. A loop that starts at 0
        and ends at ``mid`` (a multiple of BLOCK_N, at most N) has every tile inside the
        keys: no bounds mask either."""
        s = self.s
        self.open_loop()
        ragged = dict(self.uneven)
        if stop == "mid":
            self.uneven = {a: name for a, name in ragged.items() if a not in "nj"}
        x, scale = scores
        sv = self.emit(x, self.env("mn", (s.m, s.n)))
        score = sv.expr
        if not {"m", "n"} <= sv.axes:
            score = f"tl.broadcast_to({score}, [BLOCK_M, BLOCK_N])" if sv.axes else \
                f"tl.full([BLOCK_M, BLOCK_N], {score}, tl.float32)"
        if "n" in self.uneven:  # keys past the end count for nothing
            score = f'tl.where(nmask, {score}, -float("inf"))'
        body = self.loop
        # Row statistics are [BLOCK_M]: the running max m_run, and the sums l.
        # With a scale c: the row max of x times c (one multiplication per row), and
        # x * c - max in one FMA per score.
        c = f" * {literal(scale, 'float32')}" if scale is not None else ""
        body += [f"s_tile = ({score}).to(tl.float32)",
                 f"m_new = tl.maximum(m_run, tl.max(s_tile, 1){c})",
                 # A row that has seen only -inf keeps a finite reference (0): no NaN
                 # from -inf - -inf, and its sums stay 0 until a score arrives.
                 'm_ref = tl.where(m_new == -float("inf"), 0.0, m_new)',
                 "alpha = tl.exp2(m_run - m_ref)",
                 f"p = tl.exp2(s_tile{c} - m_ref[:, None])"]
        for i, _ in enumerate(sums):
            body.append(f"l{i} = l{i} * alpha + tl.sum(p, 1)")
        want = ops.TRITON_DTYPES[s.dot_dtype]
        for i, f in enumerate(prods):
            vt = self.dot_operand(f.args[1], self.env("jd", (s.n, s.d)), ("j", "d"), "[BLOCK_N, BLOCK_D]")
            body.append(f"acc{i} = tl.dot(p.to({want}), {vt}, acc{i} * alpha[:, None]{self.dot_precision()})")
        body.append("m_run = m_new")
        self.loop = None
        self.memo_loop = {}
        head = [f"# {note}"] if note else []
        head += [f"for n0 in range({start}, {stop}, BLOCK_N):",
                 "    nindex = n0 + narange",
                 "    jindex = n0 + jarange"]
        if "n" in self.uneven:
            head += ["    nmask = nindex < N", "    jmask = jindex < N"]
        self.uneven = ragged
        self.lines.extend(head)
        self.lines.extend("    " + b for b in body)

    def _emit_load(self, node, env, upcast: bool = True):
        """In a key loop, a load whose offset moves with the keys at a fixed stride (K and
        V tiles, a padding mask) reads at ``n0 * stride`` past a tile of offsets computed
        once, before the loops, at the first key: no index arithmetic per element per
        tile, only the add."""
        moving = self.key_stride(node, env)
        if moving is None:
            return super()._emit_load(node, env, upcast)
        atom, stride = moving
        buf, strides, offset = node.attrs
        if buf not in self.params:
            self.params.append(buf)
        off = strided_offset(env, strides, node.shape, offset)
        first = re.sub(rf"\b{atom}\b", atom[0] + "arange", off.expr)
        name = self.offsets.get((buf, first))
        if name is None:
            name = self.offsets[(buf, first)] = self.fresh("offs")
            self.lines.append(f"{name} = {first}")
        axes = off.axes | (env.guard.axes if env.guard is not None else frozenset())
        m = self.mask(axes, env.guard)
        ptr = f"{buf} + n0{self.index_dtype_cast} * {stride} + {name}"
        text = f"tl.load({ptr}, mask={m}, other=0)" if m else f"tl.load({ptr})"
        if upcast and node.dtype in ops.NARROW_FLOATS:
            text += ".to(tl.float32)"
        return self.assign(text, axes, "v")

    def key_stride(self, node, env) -> tuple[str, int] | None:
        """``(index, stride)`` where a load inside a key loop moves along one key index
        (``nindex`` or ``jindex``) and its offset is affine in it; None otherwise, or
        where the registers are too few to keep offset tiles (HOIST_MAX_ACC_REGS)."""
        sizes = {**self.cfg, **self.s.sizes}
        if self.loop is None or not sizes:
            return None
        if sizes["BLOCK_M"] * sizes["BLOCK_D"] > HOIST_MAX_ACC_REGS * 32 * sizes["num_warps"]:
            return None
        buf, strides, offset = node.attrs
        off = strided_offset(env, strides, node.shape, offset)
        moving = off.axes & self.loop_axes
        if len(moving) != 1:
            return None
        atom = f"{next(iter(moving))}index"
        affine = tma.atom_strides(env, strides, node.shape)
        if affine is None or atom not in affine:
            return None
        return atom, affine[atom][0]

    def dot_operand(self, node, env, axes, block) -> str:
        """As the base writer's, with a tile that does not move with the keys (the query
        tile) kept for the kernel, not the loop: both key loops use the one load."""
        key = operand_key(node, env, axes)
        if key in self.memo_outer:
            return self.memo_outer[key].expr
        expr = super().dot_operand(node, env, axes, block)
        val = self.memo_loop[key]
        if not self.in_loop(val.axes):
            self.memo_outer[key] = val
        return expr

    def head(self, cfg) -> list[str]:
        s = self.s
        blocks = {"m": (s.m, "BLOCK_M"), "n": (s.n, "BLOCK_N"), "j": (s.n, "BLOCK_N"),
                  "d": (s.d, "BLOCK_D"), "e": (s.k, "BLOCK_E"), "f": (s.k, "BLOCK_E")}
        sizes = {**cfg, **s.sizes}
        for axis, (size, blk) in blocks.items():
            if blk in sizes and (size % sizes[blk] or {"j": "N"}.get(axis, axis.upper()) in self.runtime):
                self.uneven[axis] = f"{axis}mask"
        cast = self.index_dtype_cast
        out = ["pid_m = tl.program_id(0)",
               f"mindex = pid_m{cast} * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]",
               "dindex = tl.arange(0, BLOCK_D)[None, :]",
               # the key indices of a tile, less its first key n0
               "narange = tl.arange(0, BLOCK_N)[None, :]",
               "jarange = tl.arange(0, BLOCK_N)[:, None]"]
        if s.k:
            out += ["eindex = tl.arange(0, BLOCK_E)[None, :]", "findex = tl.arange(0, BLOCK_E)[:, None]"]
        if s.batch:
            out.append(f"bindex = tl.program_id(1){cast}")
        for axis in "mde":
            if axis in self.uneven:
                out.append(f"{axis}mask = {axis}index < {axis.upper()}")
        if "f" in self.uneven:
            out.append("fmask = findex < E")
        lo, hi = "0", "N"
        if s.band is not None:  # the columns this program's rows can see
            b_lo, b_hi = s.band
            if b_lo > -(s.m - 1):
                lo = f"tl.maximum(0, pid_m * BLOCK_M + {b_lo}) // BLOCK_N * BLOCK_N"
            if b_hi < s.n - 1:
                hi = f"tl.minimum(N, (pid_m + 1) * BLOCK_M + {b_hi})"
        out += [f"lo = {lo}", f"hi = {hi}"]
        if self.unmasked is not None:
            # Columns j < pid_m * BLOCK_M + b_hi + 1 are seen by every row of the program
            # (j - i <= b_hi); in whole tiles, so that no tile there reaches past N.
            edge = f"tl.minimum(hi, pid_m * BLOCK_M + {s.band[1] + 1})"
            if s.band[1] + 1 < 0:
                edge = f"tl.maximum(0, {edge})"
            out.append(f"mid = {edge} // BLOCK_N * BLOCK_N")
        return out

    def write_body(self, cfg) -> list[str]:
        self.cfg = cfg
        head = self.head(cfg)
        self.stream()
        for root, buf in self.spec.roots:
            self.store(root, buf, self.root_env(root))
        return head
