"""The rewrite rules, declared as tables.

Each algebra rule is written once as ``lhs -> rhs`` over a small builder interface, and
instantiated twice: with egglog terms (``EgglogBuilder``) to make the rewrite, and with
PyTorch ops (``TorchBuilder``) to check soundness on random inputs (tests/test_rules.py).

Rulesets:

* ``algebra``  -- identities that make different spellings of one computation meet.
  Bounded: the saturation driver runs it for a few iterations only.
* ``fusion``   -- ``Load(Kernel(u)) == u``: a consumer may compute ``u`` itself instead
  of reading the buffer it was stored to. Always true as an equation; whether the fused
  kernel can be scheduled is decided (and re-checked) by extraction. Run to a fixpoint.
* ``views``    -- index maps that compose (reshape of a reshape).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..schema import ops


@dataclass(frozen=True)
class AlgebraRule:
    name: str
    arity: int  # number of pattern variables (Values)
    pattern: Callable  # (builder, *vars) -> (lhs, rhs)
    # Inputs on which the soundness test draws random values, per variable:
    # "any" (reals), "pos" (positive reals), "bool".
    domains: tuple[str, ...] = ()


def _u(k, op, x):
    return k.unary(op, x)


def _b(k, op, x, y):
    return k.binary(op, x, y)


ALGEBRA: list[AlgebraRule] = [
    AlgebraRule("mul-one", 1, lambda k, x: (_b(k, "mul", x, k.const(1.0)), x)),
    AlgebraRule("one-mul", 1, lambda k, x: (_b(k, "mul", k.const(1.0), x), x)),
    # (No x + 0 -> x: -0.0 + 0.0 is +0.0. x - 0 -> x holds for -0.0 too.)
    AlgebraRule("sub-zero", 1, lambda k, x: (_b(k, "sub", x, k.const(0.0)), x)),
    AlgebraRule("div-one", 1, lambda k, x: (_b(k, "div", x, k.const(1.0)), x)),
    AlgebraRule("neg-neg", 1, lambda k, x: (_u(k, "neg", _u(k, "neg", x)), x)),
    AlgebraRule("pow-one", 1, lambda k, x: (_b(k, "pow", x, k.const(1.0)), x)),
    AlgebraRule("pow-two", 1, lambda k, x: (_b(k, "pow", x, k.const(2.0)), _b(k, "mul", x, x))),
    AlgebraRule("pow-three", 1, lambda k, x: (_b(k, "pow", x, k.const(3.0)),
                                              _b(k, "mul", _b(k, "mul", x, x), x))),
    AlgebraRule("pow-half", 1, lambda k, x: (_b(k, "pow", x, k.const(0.5)), _u(k, "sqrt", x)), ("pos",)),
    AlgebraRule("pow-minus-half", 1, lambda k, x: (_b(k, "pow", x, k.const(-0.5)), _u(k, "rsqrt", x)),
                ("pos",)),
    AlgebraRule("pow-minus-one", 1, lambda k, x: (_b(k, "pow", x, k.const(-1.0)), _u(k, "reciprocal", x)),
                ("pos",)),
    AlgebraRule("one-div", 1, lambda k, x: (_b(k, "div", k.const(1.0), x), _u(k, "reciprocal", x)), ("pos",)),
    AlgebraRule("recip-sqrt", 1, lambda k, x: (_u(k, "reciprocal", _u(k, "sqrt", x)), _u(k, "rsqrt", x)),
                ("pos",)),
    AlgebraRule("sigmoid-spelled", 1, lambda k, x: (
        _b(k, "div", k.const(1.0), _b(k, "add", k.const(1.0), _u(k, "exp", _u(k, "neg", x)))),
        _u(k, "sigmoid", x))),
    AlgebraRule("silu-spelled", 1, lambda k, x: (
        _b(k, "div", x, _b(k, "add", k.const(1.0), _u(k, "exp", _u(k, "neg", x)))),
        _b(k, "mul", x, _u(k, "sigmoid", x)))),
    AlgebraRule("max-zero-relu", 1, lambda k, x: (_b(k, "maximum", x, k.const(0.0)), _u(k, "relu", x))),
    AlgebraRule("abs-neg", 1, lambda k, x: (_u(k, "abs", _u(k, "neg", x)), _u(k, "abs", x))),
    AlgebraRule("where-same", 2, lambda k, c, x: (k.where(c, x, x), x), ("bool", "any")),
    AlgebraRule("sub-neg", 2, lambda k, x, y: (_b(k, "sub", x, _u(k, "neg", y)), _b(k, "add", x, y))),
    AlgebraRule("add-neg", 2, lambda k, x, y: (_b(k, "add", x, _u(k, "neg", y)), _b(k, "sub", x, y))),
    AlgebraRule("add-comm", 2, lambda k, x, y: (_b(k, "add", x, y), _b(k, "add", y, x))),
    AlgebraRule("mul-comm", 2, lambda k, x, y: (_b(k, "mul", x, y), _b(k, "mul", y, x))),
]



@dataclass(frozen=True)
class MatmulRule:
    """A rule over matrices ``a`` [M, K], ``b`` [K, N] and a scalar constant ``s``."""
    name: str
    pattern: Callable  # (builder, a, b, s) -> (lhs, rhs)


# A scalar factor moves through a product: both places are in the e-graph, and extraction
# keeps the one that computes on fewer elements (an operand is recomputed per output tile).
MATMUL: list[MatmulRule] = [
    MatmulRule("dot-scale-left", lambda k, a, b, s: (k.dot(_b(k, "mul", a, s), b), _b(k, "mul", k.dot(a, b), s))),
    MatmulRule("dot-scale-right", lambda k, a, b, s: (k.dot(a, _b(k, "mul", b, s)), _b(k, "mul", k.dot(a, b), s))),
    MatmulRule("dot-div-left", lambda k, a, b, s: (k.dot(_b(k, "div", a, s), b), _b(k, "div", k.dot(a, b), s))),
    MatmulRule("dot-div-right", lambda k, a, b, s: (k.dot(a, _b(k, "div", b, s)), _b(k, "div", k.dot(a, b), s))),
    MatmulRule("dot-neg-left", lambda k, a, b, s: (k.dot(_u(k, "neg", a), b), _u(k, "neg", k.dot(a, b)))),
    MatmulRule("dot-neg-right", lambda k, a, b, s: (k.dot(a, _u(k, "neg", b)), _u(k, "neg", k.dot(a, b)))),
]

@dataclass(frozen=True)
class SoftmaxRule:
    """A rule over scores ``s`` (or weights ``x``) [*b, M, N], values ``v`` [*b, N, D] and a
    row vector ``r`` [*b, M, 1] (positive). ``exact=False``: the sides differ by rounding
    in the narrow dtype only (a value is rounded before a division instead of after, or
    the product's weights are rounded to ``v``'s dtype)."""
    name: str
    pattern: Callable  # (builder, s, v, r) -> (lhs, rhs)
    exact: bool = True
    row_factor: bool = False  # uses r (checked to be constant along its last axis)


def _stable_exp(k, s):
    """exp(s - rowmax(s)): softmax's numerator as torch decomposes it."""
    return _u(k, "exp", _b(k, "sub", s, k.bcast_in(k.rowmax(s))))


# What flash attention relies on, as rules. A factor constant along a row of the left
# operand (softmax's 1 / rowsum) moves out of the product along that row; what is left,
# a product (or a sum) of exp(s - rowmax(s)), is an ExpDot (ExpSum), which the code
# generator streams over N with a running max (codegen/attention.py). Softmax computed in
# float32 and rounded for the product is matched with its casts.
SOFTMAX: list[SoftmaxRule] = [
    SoftmaxRule("dot-row-div", lambda k, x, v, r: (
        k.dot(_b(k, "div", x, k.bcast_in(r)), v), _b(k, "div", k.dot(x, v), k.bcast_out(r))), row_factor=True),
    SoftmaxRule("dot-row-mul", lambda k, x, v, r: (
        k.dot(_b(k, "mul", x, k.bcast_in(r)), v), _b(k, "mul", k.dot(x, v), k.bcast_out(r))), row_factor=True),
    SoftmaxRule("dot-row-div-rounded", lambda k, x, v, r: (
        k.dot(k.narrow(_b(k, "div", x, k.bcast_in(r))), v),
        k.narrow(_b(k, "div", k.wide(k.dot(k.narrow(x), v)), k.bcast_out(r)))), exact=False, row_factor=True),
    SoftmaxRule("dot-row-mul-rounded", lambda k, x, v, r: (
        k.dot(k.narrow(_b(k, "mul", x, k.bcast_in(r))), v),
        k.narrow(_b(k, "mul", k.wide(k.dot(k.narrow(x), v)), k.bcast_out(r)))), exact=False, row_factor=True),
    SoftmaxRule("softmax-sum", lambda k, s, v, r: (k.rowsum(_stable_exp(k, s)), k.expsum(s))),
    SoftmaxRule("softmax-dot", lambda k, s, v, r: (k.dot(_stable_exp(k, s), v), k.expdot(s, v))),
    SoftmaxRule("softmax-dot-rounded", lambda k, s, v, r: (k.dot(k.narrow(_stable_exp(k, s)), v), k.expdot(s, v)),
                exact=False),
]

# A product over a concatenated K axis is the sum of the products over its parts: the
# backward of a fused q/k/v projection multiplies the concatenation of three gradients.
# Fused into the product, the concatenation is a three-way select in the K loop's operand
# loads, which are then neither pipelined nor TMA-fetched (H100, GPT-2 backward: 121 us
# against about 45 for the plain product); as a sum of products it is one kernel whose K
# loops read each part as stored, into one accumulator (codegen summed_products). Rounded
# once, as the single product is, where the sum stays in that kernel; a sum of products
# kept in separate kernels rounds each (the sides differ by rounding in the narrow dtype).
# A view that only regroups the leading axes passes through a concatenation along the
# last one, so that the rule sees the product's operand as a concatenation.
# (name, lhs -> rhs; a [*, Ka], b [*, Kb], w [*, Ka + Kb, N], cat along the last axis of a)
CONCAT = [
    ("reshape-cat-last", "reshape(cat(a, b), [*s, Ka + Kb])  ->  cat(reshape(a, [*s, Ka]), reshape(b, [*s, Kb]))"),
    ("dot-cat-split", "cat(a, b) @ w  ->  a @ w[..., :Ka, :] + b @ w[..., Ka:, :]"),
]


# Casts through a wider float and back are the identity on the narrow value.
CAST_ROUNDTRIPS = [
    ("float16", "float32"), ("bfloat16", "float32"), ("float16", "float64"),
    ("bfloat16", "float64"), ("float32", "float64"),
]


class TorchBuilder:
    """Evaluates a rule's sides with PyTorch, for the soundness tests."""

    def unary(self, op, x):
        return ops.UNARY[op].torch_fn(x)

    def binary(self, op, x, y):
        if op == "pow" and y.dim() == 0:  # a constant exponent, as the graph has it (0.5 is sqrt in torch)
            y = y.item()
        return ops.BINARY[op].torch_fn(torch.as_tensor(x, dtype=torch.float64, device="cpu"), y)

    def where(self, c, x, y):
        return torch.where(c, x, y)

    def const(self, value):
        return torch.tensor(value, dtype=torch.float64, device="cpu")

    def dot(self, a, b):
        return a @ b

    # Softmax rules: broadcasts are implicit in torch; ``narrow`` rounds to float16.
    def bcast_in(self, x):
        return x

    bcast_out = bcast_in

    def narrow(self, x):
        return x.to(torch.float16).to(x.dtype)

    def wide(self, x):
        return x

    def rowmax(self, x):
        return x.amax(-1, keepdim=True)

    def rowsum(self, x):
        return x.sum(-1, keepdim=True)

    def expdot(self, s, v):
        return self.dot(torch.exp(s - self.rowmax(s)), v)

    def expsum(self, s):
        return self.rowsum(torch.exp(s - self.rowmax(s)))


class EgglogBuilder:
    """Builds a rule's sides as egglog patterns; constants match any dtype."""

    def __init__(self, bare_broadcasts: bool = False):
        from egglog import i64, var
        self._var, self._i64 = var, i64
        self._n = 0
        self.bare_broadcasts = bare_broadcasts  # softmax rules: match rows of length 1

    def unary(self, op, x):
        from ..schema.terms import Unary
        return Unary(op, x)

    def binary(self, op, x, y):
        from ..schema.terms import Binary
        return Binary(op, x, y)

    def where(self, c, x, y):
        from ..schema.terms import Where
        return Where(c, x, y)

    def const(self, value):
        from ..schema.terms import Const, float_bits
        self._n += 1
        return Const(float_bits(value), self._var(f"cdt{self._n}", self._i64))

    def scalar(self):
        """Any constant."""
        from ..schema.terms import Const
        return Const(self._var("sbits", self._i64), self._var("sdt", self._i64))

    def dot(self, a, b):
        from ..schema.terms import Dot
        return Dot(a, b)

    # Softmax rules. Shapes and dtypes the right side needs are bound from the left side's
    # analyses (``conditions``): the product's shape, the narrow and the wide float.
    def _fresh(self, name, sort):
        self._n += 1
        return self._var(f"{name}{self._n}", sort)

    def bcast_in(self, x):
        from egglog import Vec

        from ..schema.terms import Broadcast
        if self.bare_broadcasts:
            return x
        return Broadcast(x, self._fresh("shape", Vec[self._i64]))

    def bcast_out(self, x):
        from egglog import Vec

        from ..schema.terms import Broadcast
        return Broadcast(x, self._var("out_shape", Vec[self._i64]))

    def narrow(self, x):
        from ..schema.terms import Cast
        return Cast(x, self._var("narrow", self._i64))

    def wide(self, x):
        from ..schema.terms import Cast
        self.uses_wide = True
        return Cast(x, self._var("wide", self._i64))

    def rowmax(self, x):
        from ..schema.terms import Reduce
        return Reduce("max", x)

    def rowsum(self, x):
        from ..schema.terms import Reduce
        return Reduce("sum", x)

    def expdot(self, s, v):
        from ..schema.terms import ExpDot
        return ExpDot(s, v)

    def expsum(self, s):
        from ..schema.terms import ExpSum
        return ExpSum(s)


def _softmax_rules(rounding_kept: bool = False) -> list:
    """SOFTMAX's rules (those marked ``exact`` only, where ``rounding_kept``)."""
    from egglog import Vec, eq, i64, rule, union, var

    from ..schema.terms import Value, vdtype, vshape

    rules = []
    # Each rule twice: with its broadcasts, and for rows of length 1 without them (the
    # translator broadcasts only what changes shape).
    for r, bare in [(r, bare) for r in SOFTMAX if r.exact or not rounding_kept for bare in (False, True)]:
        k = EgglogBuilder(bare_broadcasts=bare)
        s, v, row, root = var("s", Value), var("v", Value), var("r", Value), var("root", Value)
        lhs, rhs = r.pattern(k, s, v, row)
        conds = [eq(root).to(lhs)]
        if r.row_factor:
            # r must be constant along the row it scales; its broadcast takes the product's shape.
            # The other factor must be the product's whole left operand, not a scalar constant
            # (2.0 * r with r of shape [M, 1] is also a product with a row factor, and would
            # leave a product of a scalar: an outer product's scaled column, found by fuzzing)
            rs, xs = var("rs", Vec[i64]), var("xs", Vec[i64])
            conds += [eq(vshape(row)).to(rs), eq(rs[rs.length() - i64(1)]).to(i64(1)),
                      eq(vshape(s)).to(xs), eq(xs.length()).to(rs.length()),
                      eq(vshape(root)).to(var("out_shape", Vec[i64]))]
        if getattr(k, "uses_wide", False):  # the float the weights were computed in
            conds.append(eq(vdtype(s)).to(var("wide", i64)))
        rules.append(rule(*conds, name=r.name + ("/unit" if bare else "")).then(union(root).with_(rhs)))
    return rules


def _concat_rules() -> list:
    """CONCAT's rules. Each new term gets its shape and dtype, so that the rules chain
    (a concatenation of three is two nested ones)."""
    from egglog import Vec, eq, i64, rule, set_, union, var

    from ..schema.terms import Binary, Cat, Dot, Reshape, Slice, Value, vdtype, vshape

    a, b, w, root = var("a", Value), var("b", Value), var("w", Value), var("root", Value)
    d, dt = var("d", i64), var("dt", i64)
    s, sa, sb, sw = (var(n, Vec[i64]) for n in ("s", "sa", "sb", "sw"))

    def typed(term, shape, dtype):
        return [set_(vshape(term)).to(shape), set_(vdtype(term)).to(dtype)]

    parts = [eq(vshape(a)).to(sa), eq(vshape(b)).to(sb), eq(d).to(sa.length() - i64(1)), eq(vdtype(root)).to(dt)]
    ka, kb = sa[d], sb[d]

    last = s.length() - i64(1)
    ra, rb = Reshape(a, s.set(last, ka)), Reshape(b, s.set(last, kb))
    regrouped = Cat(ra, rb, last)
    reshape_cat = rule(eq(root).to(Reshape(Cat(a, b, d), s)), *parts, eq(s[last]).to(ka + kb),
                       name="reshape-cat-last").then(
        *typed(ra, s.set(last, ka), dt), *typed(rb, s.set(last, kb), dt), *typed(regrouped, s, dt),
        union(root).with_(regrouped))

    k_axis = sw.length() - i64(2)
    wa, wb = Slice(w, k_axis, i64(0), i64(1), ka), Slice(w, k_axis, ka, i64(1), kb)
    pa, pb = Dot(a, wa), Dot(b, wb)
    summed = Binary("add", pa, pb)
    dot_split = rule(eq(root).to(Dot(Cat(a, b, d), w)), *parts, eq(vshape(w)).to(sw), eq(vshape(root)).to(s),
                     name="dot-cat-split").then(
        *typed(wa, sw.set(k_axis, ka), dt), *typed(wb, sw.set(k_axis, kb), dt),
        *typed(pa, s, dt), *typed(pb, s, dt), *typed(summed, s, dt), union(root).with_(summed))
    return [reshape_cat, dot_split]


def _algebra_rules(rounding_kept: bool = False, extra: tuple = ()) -> list:
    """The algebra ruleset's rules, with ``extra`` (a user's AlgebraRules) among them."""
    from egglog import eq, i64, rule, union, var

    from ..schema.terms import Cast, Value, dtype_code, vdtype

    rules = []
    for r in (*ALGEBRA, *extra):
        k = EgglogBuilder()
        xs = [var(f"v{i}", Value) for i in range(r.arity)]
        lhs, rhs = r.pattern(k, *xs)
        root = var("root", Value)
        rules.append(rule(eq(root).to(lhs), name=r.name).then(union(root).with_(rhs)))

    for r in MATMUL:
        k = EgglogBuilder()
        lhs, rhs = r.pattern(k, var("a", Value), var("b", Value), k.scalar())
        root = var("root", Value)
        rules.append(rule(eq(root).to(lhs), name=r.name).then(union(root).with_(rhs)))

    rules += _softmax_rules(rounding_kept)
    rules += _concat_rules()

    x, root, d = var("x", Value), var("root", Value), var("d", i64)
    for narrow, wide in () if rounding_kept else CAST_ROUNDTRIPS:
        n, w = dtype_code(narrow), dtype_code(wide)
        rules.append(rule(eq(root).to(Cast(Cast(x, w), n)), eq(vdtype(x)).to(i64(n)),
                          name=f"cast-{narrow}-{wide}-{narrow}").then(union(root).with_(x)))
    rules.append(rule(eq(root).to(Cast(x, d)), eq(vdtype(x)).to(d), name="cast-noop")
                 .then(union(root).with_(x)))
    return rules


def _fusion_rules() -> list:
    from egglog import eq, rule, union, var

    from ..schema.terms import Kernel, Load, Value

    u, root = var("u", Value), var("root", Value)
    return [rule(eq(root).to(Load(Kernel(u))), name="fuse-load-kernel").then(union(root).with_(u))]


def _views_rules() -> list:
    from egglog import Vec, eq, i64, rule, set_, union, var

    from ..schema.terms import Broadcast, LoadStrided, Permute, Reshape, Slice, Tensor, Value, vdtype, vshape

    x, root = var("x", Value), var("root", Value)
    s1, s2 = var("s1", Vec[i64]), var("s2", Vec[i64])
    t, strides, perm = var("t", Tensor), var("strides", Vec[i64]), var("perm", Vec[i64])
    dim, start, step, size, offset, dt = (var(n, i64) for n in ("dim", "start", "step", "size", "offset", "dt"))
    # A slice of a read is a read at an offset, and a slice passes below a permutation: a
    # product's operand sliced by dot-cat-split stays a plain read (which TMA can fetch).
    sliced_read = LoadStrided(t, s1.set(dim, size), strides.set(dim, strides[dim] * step),
                              offset + start * strides[dim])
    inner = Slice(x, perm[dim], start, step, size)
    return [
        rule(eq(root).to(Slice(LoadStrided(t, s1, strides, offset), dim, start, step, size)),
             eq(vdtype(root)).to(dt), name="slice-read")
        .then(set_(vshape(sliced_read)).to(s1.set(dim, size)), set_(vdtype(sliced_read)).to(dt),
              union(root).with_(sliced_read)),
        rule(eq(root).to(Slice(Permute(x, perm), dim, start, step, size)), eq(vshape(x)).to(s1),
             eq(vdtype(root)).to(dt), eq(vshape(root)).to(s2), name="slice-permute")
        .then(set_(vshape(inner)).to(s1.set(perm[dim], size)), set_(vdtype(inner)).to(dt),
              set_(vshape(Permute(inner, perm))).to(s2), set_(vdtype(Permute(inner, perm))).to(dt),
              union(root).with_(Permute(inner, perm))),
        rule(eq(root).to(Reshape(Reshape(x, s1), s2)), name="reshape-reshape")
        .then(union(root).with_(Reshape(x, s2))),
        rule(eq(root).to(Reshape(x, s1)), eq(vshape(x)).to(s1), name="reshape-same-shape")
        .then(union(root).with_(x)),
        rule(eq(root).to(Broadcast(x, s1)), eq(vshape(x)).to(s1), name="broadcast-same-shape")
        .then(union(root).with_(x)),
    ]


RULESET_NAMES = ("algebra", "fusion", "views")


@dataclass(frozen=True)
class RuleChoice:
    """The option ``rules`` read: the rulesets that run, a user's rules (which join the
    algebra ruleset) and the built-in rules left out (an ablation)."""
    enabled: tuple
    extra: tuple = ()
    dropped: frozenset = frozenset()


def rule_entries(option) -> tuple:
    """The option ``rules`` as a tuple of its entries (one name or rule given alone)."""
    return (option,) if isinstance(option, (str, AlgebraRule)) else tuple(option)


def chosen(option) -> RuleChoice:
    """The option ``rules``: ruleset names (RULESET_NAMES), ``AlgebraRule``s of one's own,
    and ``"-name"`` for a built-in rule to leave out. ValueError names what is unknown."""
    entries = rule_entries(option)
    enabled = tuple(e for e in entries if isinstance(e, str) and not e.startswith("-"))
    extra = tuple(e for e in entries if isinstance(e, AlgebraRule))
    dropped = frozenset(e[1:] for e in entries if isinstance(e, str) and e.startswith("-"))
    known = {name for _, name, _ in catalogue()}
    problems = [f"unknown ruleset {e!r}" for e in enabled if e not in RULESET_NAMES]
    problems += [f"no built-in rule {name!r} to leave out" for name in sorted(dropped - known)]
    problems += [f"{e!r} is neither a ruleset name, '-<rule>' nor an AlgebraRule" for e in entries
                 if not isinstance(e, (str, AlgebraRule))]
    clashing = [r.name for r in extra if r.name in known]
    problems += [f"rule {name!r} has the name of a built-in rule" for name in clashing]
    if problems:
        raise ValueError("; ".join(problems) + f" (rulesets: {', '.join(RULESET_NAMES)})")
    return RuleChoice(enabled, extra, dropped)


def choice_key(option) -> tuple:
    """The option ``rules`` as the plan cache keys it: a user's rule by its sides' text."""
    return tuple((e.name, rule_text(e), e.domains) if isinstance(e, AlgebraRule) else e
                 for e in rule_entries(option))


def rulesets(rounding_kept: bool = False, choice: RuleChoice | None = None):
    """The rulesets (by the names in RULESET_NAMES), built anew for each e-graph.
    ``rounding_kept`` (the option ``emulate_precision_casts``): without the rules whose
    right side skips a rounding to a narrow float that the left side makes (the softmax
    rules marked ``exact=False``, and a narrow value's round trip through a wider float,
    which under the option is how a half-precision op's result is rounded). ``choice``:
    a user's rules added, the rules it leaves out left out.

    The rules are built once per ``rounding_kept`` and set of a user's rules (egglog's
    declarations are immutable; building them took 0.17 s, 40% of compiling a small graph);
    the ruleset objects that hold them are new for each e-graph.
    """
    from egglog import ruleset

    choice = choice or RuleChoice(RULESET_NAMES)
    lists = _rule_lists(rounding_kept, choice.extra)
    # (a softmax rule's twin for rows of length 1 is "<name>/unit": left out with it)
    return {name: ruleset(*[r for r in rules if r.decl.name.split("/")[0] not in choice.dropped], name=name)
            for name, rules in lists.items()}


@functools.lru_cache(maxsize=8)
def _rule_lists(rounding_kept: bool, extra: tuple) -> dict[str, tuple]:
    return {"algebra": tuple(_algebra_rules(rounding_kept, extra)), "fusion": tuple(_fusion_rules()),
            "views": tuple(_views_rules())}


class ShowBuilder:
    """Writes a rule's sides as text, for the catalogue."""

    def unary(self, op, x):
        return f"{op}({x})"

    def binary(self, op, x, y):
        return f"{op}({x}, {y})"

    def where(self, c, x, y):
        return f"where({c}, {x}, {y})"

    def const(self, value):
        return repr(value)

    def dot(self, a, b):
        return f"({a} @ {b})"

    def bcast_in(self, x):
        return x

    bcast_out = bcast_in

    def narrow(self, x):
        return f"narrow({x})"

    def wide(self, x):
        return f"wide({x})"

    def rowmax(self, x):
        return f"rowmax({x})"

    def rowsum(self, x):
        return f"rowsum({x})"

    def expdot(self, s, v):
        return f"expdot({s}, {v})"

    def expsum(self, s):
        return f"expsum({s})"


def rule_text(r: AlgebraRule) -> str:
    """An algebra rule's sides as text: ``mul(x, 1.0)  ->  x``."""
    lhs, rhs = r.pattern(ShowBuilder(), *"xyzw"[: r.arity])
    return f"{lhs}  ->  {rhs}"


def catalogue() -> list[tuple[str, str, str]]:
    """(ruleset, name, description) for every rule, for ``eqfuse rules``."""
    rows = []
    for r in ALGEBRA:
        rows.append(("algebra", r.name, rule_text(r)))
    for r in MATMUL:
        lhs, rhs = r.pattern(ShowBuilder(), "a", "b", "s")
        rows.append(("algebra", r.name, f"{lhs}  ->  {rhs}"))
    for r in SOFTMAX:
        lhs, rhs = r.pattern(ShowBuilder(), "s" if not r.row_factor else "x", "v", "r")
        rows.append(("algebra", r.name, f"{lhs}  ->  {rhs}"))
    rows += [("algebra", name, text) for name, text in CONCAT]
    for narrow, wide in CAST_ROUNDTRIPS:
        rows.append(("algebra", f"cast-{narrow}-{wide}-{narrow}",
                     f"cast(cast(x:{narrow}, {wide}), {narrow})  ->  x"))
    rows.append(("algebra", "cast-noop", "cast(x:d, d)  ->  x"))
    rows.append(("fusion", "fuse-load-kernel", "Load(Kernel(u))  ->  u"))
    rows.append(("views", "reshape-reshape", "reshape(reshape(x, s1), s2)  ->  reshape(x, s2)"))
    rows.append(("views", "reshape-same-shape", "reshape(x:s, s)  ->  x"))
    rows.append(("views", "broadcast-same-shape", "broadcast(x:s, s)  ->  x"))
    rows.append(("views", "slice-read", "slice(read(t, strides, offset), d, start, step)  ->  "
                                       "read(t, strides[d] * step, offset + start * strides[d])"))
    rows.append(("views", "slice-permute", "slice(permute(x, p), d)  ->  permute(slice(x, p[d]), p)"))
    return rows
