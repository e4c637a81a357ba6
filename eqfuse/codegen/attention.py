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
program's loop runs over its rows' band only.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..errors import Unschedulable
from ..schema import ops
from ..schema.plan import KernelSpec, PNode
from .indexing import Env, Idx, env_of, reshape_env
from .kernel import KernelWriter, Val, literal, next_pow2
from .tiles import MIN_BLOCK, well_formed

# (BLOCK_M, BLOCK_N, num_warps, num_stages): the shapes FlashAttention's Triton kernels
# run well with on Hopper and Ampere. The first is the untimed choice: on an H100 it was
# the fastest or within 7% of it for head dims 64 and 128, causal or not (S=2048).
TILES = [
    (64, 64, 4, 3),
    (128, 64, 4, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (64, 64, 4, 4),
    (128, 64, 4, 3),
    (128, 32, 4, 3),
    (64, 128, 4, 3),
    (64, 32, 4, 2),
    (128, 32, 8, 3),
]
BAND_ANALYSIS_MAX = 1 << 28  # score elements (rows x columns) the mask analysis looks at
CONFIG_KEYS = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
LOG2E = 1 / math.log(2)


def streams(spec: KernelSpec) -> list[PNode]:
    """The softmax products and sums of an attention kernel; none where there is no product
    (a softmax's ``ExpSum`` alone is an ordinary row reduction: see ``spelled_out``)."""
    flows = [n for n in spec.walk() if n.op in ("expdot", "expsum")]
    return flows if any(n.op == "expdot" for n in flows) else []


def spelled_out(spec: KernelSpec) -> KernelSpec:
    """``spec`` with each ``ExpSum(s)`` written as ``sum(exp(s - rowmax(s)))``, for the row
    reduction schedule (a softmax whose sum the rules turned into an ExpSum)."""
    if not any(n.op == "expsum" for n in spec.walk()):
        return spec
    memo: dict[int, PNode] = {}

    def go(n: PNode) -> PNode:
        if id(n) not in memo:
            args = tuple(go(a) for a in n.args)
            if n.op == "expsum":
                (s,) = args
                row = s.shape[:-1] + (1,)
                top = PNode("reduce", ("max",), (s,), row, s.dtype)
                shifted = PNode("binary", ("sub",), (s, PNode("broadcast", (), (top,), s.shape, s.dtype)),
                                s.shape, s.dtype)
                exp = PNode("unary", ("exp",), (shifted,), s.shape, s.dtype)
                memo[id(n)] = PNode("reduce", ("sum",), (exp,), row, n.dtype, n.eclass)
            else:
                memo[id(n)] = n if args == n.args else replace(n, args=args)
        return memo[id(n)]
    return replace(spec, roots=[(go(r), b) for r, b in spec.roots])


def attention_schedule(spec: KernelSpec, flows: list[PNode]):
    from .kernel import MAX_GRID_Y, Schedule

    scores = {id(f.args[0]): f.args[0] for f in flows}
    if len(scores) != 1:
        raise Unschedulable("softmax products over different scores in one kernel")
    (s,) = scores.values()
    *batch, m, n = s.shape
    inner = s.walk()
    for x in inner:
        if x.op in ("expdot", "expsum", "reduce"):
            raise Unschedulable(f"a {x.op} inside attention scores")
    dots = [x for x in inner if x.op == "dot"]
    if len(dots) > 1:
        raise Unschedulable("more than one product in attention scores")
    values = [f.args[1] for f in flows if f.op == "expdot"]
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
    for x in spec.walk():
        if id(x) in inside or x.op in ("expdot", "expsum"):
            continue
        if x.op == "dot":
            raise Unschedulable("a product outside attention scores")
        if x.op == "reduce" and not (x.attrs[0] == "max" and x.args[0] is s):
            raise Unschedulable("a reduction in an attention kernel")
    rows = math.prod(batch) * m
    for root, _ in spec.roots:
        if root.numel not in (rows * d, rows):
            raise Unschedulable(f"a root of {root.numel} elements in attention over {list(s.shape)}")
    if math.prod(batch) > MAX_GRID_Y:
        raise Unschedulable(f"a batch of {math.prod(batch)} attention heads (the grid takes {MAX_GRID_Y})")
    e = dots[0].args[0].shape[-1] if dots else 0
    return Schedule("attention", batch=tuple(batch), m=m, n=n, k=e, d=d, dot_dtype=dtype,
                    dots=len(values), band=masked_band(s))


# --- which columns a row can see ------------------------------------------------------------

def masked_band(s: PNode) -> tuple | None:
    """``(lo, hi)`` such that every score a row ``i`` may use has its column ``j`` in
    ``i + lo <= j <= i + hi`` (elsewhere the score is certainly -inf); None when no
    mask is known or it removes no whole diagonal."""
    *_, m, n = s.shape
    if m * n > BAND_ANALYSIS_MAX:
        return None
    masked = _certainly_neg_inf(s)
    if masked is None:
        return None
    while masked.dim() > 2:  # a mask that differs between heads or batches: none of it
        masked = masked.all(0) if masked.shape[0] > 1 else masked[0]
    visible = ~masked.expand(m, n) if masked.dim() == 2 else ~masked.reshape(1, -1).expand(m, n)
    seen = visible.any(1)
    if not bool(seen.any()):
        return None
    rows = torch.arange(m)[seen]
    v = visible[seen].to(torch.int8)
    first = v.argmax(1)
    last = n - 1 - v.flip(1).argmax(1)
    lo, hi = int((first - rows).min()), int((last - rows).max())
    if lo <= -(m - 1) and hi >= n - 1:
        return None
    return lo, hi


def _certainly_neg_inf(node: PNode):
    """A bool tensor broadcastable to ``node``'s shape, True where the value is -inf
    whatever the inputs; None where nothing is known."""
    op = node.op
    if op == "const":
        return torch.tensor(float(node.attrs[0]) == float("-inf"))
    if op == "where":
        cond = _static(node.args[0])
        a, b = (_certainly_neg_inf(x) for x in node.args[1:])
        if cond is None:
            return a & b if a is not None and b is not None else None
        false = torch.tensor(False)
        return torch.where(cond.bool(), a if a is not None else false, b if b is not None else false)
    if op == "binary" and node.attrs[0] == "add":
        a, b = (_certainly_neg_inf(x) for x in node.args)
        if a is None or b is None:
            return a if b is None else b
        return a | b
    if op == "binary" and node.attrs[0] in ("sub", "mul", "div"):
        other = _static(node.args[1])
        if node.attrs[0] != "sub" and not (other is not None and bool((other > 0).all())):
            return None  # a scale must be a known positive number to keep -inf
        return _certainly_neg_inf(node.args[0])
    if op == "cast" and ops.is_float(node.dtype):
        return _certainly_neg_inf(node.args[0])
    if op == "broadcast":
        return _certainly_neg_inf(node.args[0])  # broadcasting is implicit for torch
    return None


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
    """Tile configurations in the model's order, clamped to the sizes."""
    out = []
    for bm, bn, warps, stages in TILES:
        cfg = {"BLOCK_M": max(MIN_BLOCK, min(bm, next_pow2(sched.m))),
               "BLOCK_N": max(MIN_BLOCK, min(bn, next_pow2(sched.n))),
               "num_warps": warps, "num_stages": stages}
        if cfg not in out:
            out.append(cfg)
    return out


def runnable(cfg: dict) -> bool:
    """Whether a configuration (from a cache, or a user) is one an attention kernel can run with."""
    return well_formed(cfg, CONFIG_KEYS, ("BLOCK_M", "BLOCK_N"))


# --- the writer ---------------------------------------------------------------------------------

class AttentionWriter(KernelWriter):
    """Writes the streamed form; the score, value and epilogue expressions are the
    ordinary ones, evaluated at the environments below."""

    def __init__(self, spec, buffers, sched):
        super().__init__(spec, buffers, sched)
        self.loop_axes = frozenset("nj")
        self.flows = streams(spec)
        self.scores = self.flows[0].args[0]
        self.in_scores = {id(x) for x in self.scores.walk()}
        self.results: dict = {}  # node id -> Val after the loop

    # environments: b batch, m rows, n score columns, j value rows (the same keys as a
    # column vector), d value columns, e / f the head dim of q (row) and k^T (column)
    def atoms(self):
        s = self.s
        return {"b": (Idx("bindex", frozenset("b")), math.prod(s.batch)),
                "m": (Idx("mindex", frozenset("m")), s.m),
                "n": (Idx("nindex", frozenset("n")), s.n),
                "j": (Idx("jindex", frozenset("j")), s.n),
                "d": (Idx("dindex", frozenset("d")), s.d),
                "e": (Idx("eindex", frozenset("e")), s.k),
                "f": (Idx("findex", frozenset("f")), s.k)}

    def env(self, axes: str, shape) -> Env:
        a = self.atoms()
        return env_of([a[x] for x in "b" + axes], tuple(self.s.batch) + tuple(shape))

    def out_env(self):
        return self.env("md", (self.s.m, self.s.d))

    def row_env(self):
        return self.env("m", (self.s.m, 1))

    def root_env(self, root):
        full = root.numel == math.prod(self.s.batch) * self.s.m * self.s.d
        base = self.out_env() if full else self.row_env()
        return reshape_env(base, root.shape)

    def tile_axes(self, root):
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

    def _emit_binary(self, node, env):
        """In the scores, a division by a constant is a multiplication by its reciprocal
        (within an ulp of float32; IEEE division costs as much as the exponential)."""
        divisor = node.args[1]
        if node.attrs[0] == "div" and id(node) in self.in_scores and divisor.op == "const" \
                and float(divisor.attrs[0]) != 0 and math.isfinite(1.0 / float(divisor.attrs[0])):
            a = self.emit(node.args[0], env)
            return self.assign(f"({a.expr} * {literal(1.0 / float(divisor.attrs[0]), 'float32')})", a.axes)
        return super()._emit_binary(node, env)

    def _emit_dot(self, node, env):
        self._at_rows(env, self.env("mn", (self.s.m, self.s.n)), "the scores' product")
        q = self.dot_operand(node.args[0], self.env("me", (self.s.m, self.s.k)), ("m", "e"),
                             "[BLOCK_M, BLOCK_E]")
        kt = self.dot_operand(node.args[1], self.env("fn", (self.s.k, self.s.n)), ("f", "n"),
                              "[BLOCK_E, BLOCK_N]")
        return self.assign(f"tl.dot({q}, {kt}{self.dot_precision()})", frozenset("mn"), "qk")

    def stream(self):
        """The loop over the key axis, and the results it leaves."""
        s = self.s
        lines = self.lines
        lines.append('m_run = tl.full([BLOCK_M, 1], -float("inf"), tl.float32)')
        sums = [f for f in self.flows if f.op == "expsum"]
        prods = [f for f in self.flows if f.op == "expdot"]
        for i, _ in enumerate(sums):
            lines.append(f"l{i} = tl.zeros([BLOCK_M, 1], dtype=tl.float32)")
        for i, _ in enumerate(prods):
            lines.append(f"acc{i} = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)")
        self.open_loop()
        sv = self.emit(self.scores, self.env("mn", (s.m, s.n)))
        score = sv.expr
        if not {"m", "n"} <= sv.axes:
            score = f"tl.broadcast_to({score}, [BLOCK_M, BLOCK_N])" if sv.axes else \
                f"tl.full([BLOCK_M, BLOCK_N], {score}, tl.float32)"
        if "n" in self.uneven:  # keys past the end count for nothing
            score = f'tl.where(nmask, {score}, -float("inf"))'
        body = self.loop
        # Scores in log2 units, so that each exponential is one exp2.
        body += [f"s_tile = ({score}).to(tl.float32) * {LOG2E!r}",
                 "m_new = tl.maximum(m_run, tl.max(s_tile, 1)[:, None])",
                 # A row that has seen only -inf keeps a finite reference (0): no NaN
                 # from -inf - -inf, and its sums stay 0 until a score arrives.
                 'm_ref = tl.where(m_new == -float("inf"), 0.0, m_new)',
                 "alpha = tl.exp2(m_run - m_ref)",
                 "p = tl.exp2(s_tile - m_ref)"]
        for i, _ in enumerate(sums):
            body.append(f"l{i} = l{i} * alpha + tl.sum(p, 1)[:, None]")
        want = ops.TRITON_DTYPES[s.dot_dtype]
        for i, f in enumerate(prods):
            vt = self.dot_operand(f.args[1], self.env("jd", (s.n, s.d)), ("j", "d"), "[BLOCK_N, BLOCK_D]")
            body.append(f"acc{i} = tl.dot(p.to({want}), {vt}, acc{i} * alpha{self.dot_precision()})")
        body.append("m_run = m_new")
        self.close_loop()
        # A row with no score above -inf: softmax is 0 / 0 there, as in eager.
        empty = 'm_run == -float("inf")'
        for i, f in enumerate(sums):
            self.results[id(f)] = Val(f'tl.where({empty}, float("nan"), l{i})', frozenset("m"))
        for i, f in enumerate(prods):
            self.results[id(f)] = Val(f'tl.where({empty}, float("nan"), acc{i})', frozenset("md"))
        self.results["max"] = Val(f"(m_run * {math.log(2)!r})", frozenset("m"))

    def close_loop(self):
        body = self.loop
        self.loop = None
        self.memo_loop = {}
        head = ["for n0 in range(lo, hi, BLOCK_N):",
                "    nindex = n0 + tl.arange(0, BLOCK_N)[None, :]",
                "    jindex = n0 + tl.arange(0, BLOCK_N)[:, None]"]
        if "n" in self.uneven:
            head += ["    nmask = nindex < N", "    jmask = jindex < N"]
        self.lines.extend(head)
        self.lines.extend("    " + b for b in body)

    def head(self, cfg) -> list[str]:
        s = self.s
        blocks = {"m": (s.m, "BLOCK_M"), "n": (s.n, "BLOCK_N"), "j": (s.n, "BLOCK_N"),
                  "d": (s.d, "BLOCK_D"), "e": (s.k, "BLOCK_E"), "f": (s.k, "BLOCK_E")}
        sizes = {**cfg, **s.sizes}
        for axis, (size, blk) in blocks.items():
            if blk in sizes and size % sizes[blk]:
                self.uneven[axis] = f"{axis}mask"
        cast = self.index_dtype_cast
        out = ["pid_m = tl.program_id(0)",
               f"mindex = pid_m{cast} * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]",
               "dindex = tl.arange(0, BLOCK_D)[None, :]"]
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
        return out

    def write_body(self, cfg) -> list[str]:
        head = self.head(cfg)
        self.stream()
        for root, buf in self.spec.roots:
            self.store(root, buf, self.root_env(root))
        return head
