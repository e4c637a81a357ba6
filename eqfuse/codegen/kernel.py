"""One kernel of the plan -> one ``@triton.jit`` function: ``KernelWriter`` writes the
kernel its schedule (codegen/schedules.py) describes, at a configuration (codegen/configs.py).

Float values narrower than float32 are computed in float32 and rounded where the graph
casts them and when they are stored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import torch

from ..errors import Unschedulable
from ..schema import ops
from ..schema.plan import KernelSpec, PNode
from . import matmul_templates, pointwise, tma
from .configs import LAUNCH_OPTIONS, default_config, fits, unaligned_config
from .indexing import (
    Env,
    Idx,
    env_key,
    env_of,
    gathered_env,
    operand_env,
    reshape_env,
    shifted_env,
    strided_offset,
)
from .schedules import (
    AXIS_INDEX,
    PART_A,
    PART_B,
    Schedule,
    _operand_sides,
    _pick,
    matmul_envs,
    online_softmax,
    operand_box,
    schedule_of,
    selection,
    shared_reads,
    special_function,
    summed_products,
)

# Axes a program takes one value of (its batch index, ``tl.program_id``): an offset along
# them alone is a scalar address, not a block of them
PROGRAM_AXES = frozenset("b")


# x ** e for the exponents torch's pow kernels special-case, as they compute them
EXACT_POWERS = {2.0: "({a} * {a})", 3.0: "({a} * {a} * {a})", -1.0: "(1.0 / {a})", -2.0: "(1.0 / ({a} * {a}))"}


# A row's product: Triton has no tl.prod; the module defines it (codegen/module.assemble)
PRODUCT = "_row_product"


PRODUCT_SOURCE = f'''@triton.jit
def _multiply(a, b):
    return a * b


@triton.jit
def {PRODUCT}(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _multiply)
'''


def _as_reduced(v: Val, dtype: str) -> Val:
    """An integer value reduced in its term's dtype: an index (a program's arange, int32
    in Triton) reduced as an int64 meets int64's neutral element (argmin's first position)."""
    if not ops.is_int(dtype):
        return v
    return replace(v, expr=f"tl.cast({v.expr}, {ops.TRITON_DTYPES[dtype]})")  # (a literal has no .to)


def _row_reduction(fn: str, tile: str, nan_aware: bool) -> str:
    """``fn`` over the rows of ``tile``. Triton's max and min skip NaN (max.f32 on a GPU,
    fmax in the interpreter); torch's amax and amin return it: ``nan_aware`` puts it back
    where a row holds one."""
    reduced = f"{fn}({tile}, 1)[:, None]"
    if not nan_aware:
        return reduced
    return f"tl.where(tl.max(({tile} != {tile}).to(tl.int8), 1)[:, None] > 0, float('nan'), {reduced})"


@dataclass
class Val:
    expr: str
    axes: frozenset


class KernelWriter:
    def __init__(self, spec: KernelSpec, buffers: dict, sched: Schedule, runtime: frozenset = frozenset()):
        self.spec = spec
        self.buffers = buffers
        self.param_order: list | None = None  # see generate_kernel
        self.s = sched
        # Sizes passed at launch rather than fixed (codegen/sized.py): their axes are masked
        # whatever the size the kernel was generated at, which may divide evenly by chance
        self.runtime = runtime
        self.lines: list[str] = []  # kernel body at row scope
        self.loop: list[str] | None = None  # body of the loop being written
        self.memo_outer: dict = {}
        self.memo_loop: dict = {}
        self.n = 0
        self.params: list[str] = []  # buffer names, in signature order
        self.loop_axes = frozenset("kj") if sched.kind == "matmul" else frozenset("c")
        self.uneven: dict[str, str] = {}  # axis -> the name of its mask, where blocks overhang
        big = any(self.buffers[b].numel >= 2**31 for b in self._buffer_names())
        self.index_dtype_cast = ".to(tl.int64)" if big else ""
        # The TMA form (matmul with PROGRAMS in its config): descriptors by box, the lines
        # that make them (once per program, before the loop over tiles), the buffers they read.
        self.descriptors: dict | None = None
        self.descriptor_lines: list[str] = []
        self.tma_params: set[str] = set()
        self.subtile = False  # the TMA form's epilogue computed half a tile at a time (subtiled)
        self.running_max: dict[int, Val] = {}  # scores -> the running max of their softmax's pass

    # --- small helpers -----------------------------------------------------------------------
    def _buffer_names(self):
        names = [n.attrs[0] for n in self.spec.walk() if n.op == "load"]
        names += [b for _, b in self.spec.roots]
        return list(dict.fromkeys(names))

    def fresh(self, prefix="t"):
        self.n += 1
        return f"{prefix}{self.n}"

    def in_loop(self, axes) -> bool:
        return self.loop is not None and bool(self.loop_axes & axes)

    def line(self, text: str, axes):
        (self.loop if self.in_loop(axes) else self.lines).append(text)

    def assign(self, expr: str, axes, prefix="t") -> Val:
        name = self.fresh(prefix)
        self.line(f"{name} = {expr}", axes)
        return Val(name, frozenset(axes))

    def mask(self, axes, guard: Idx | None = None) -> str | None:
        parts = [m for a, m in self.uneven.items() if a in axes]
        if guard is not None:
            parts.append(guard.expr)
        return " & ".join(parts) if parts else None

    # --- environments ------------------------------------------------------------------------
    def base_envs(self):
        if self.s.kind == "pointwise":
            x = Idx("xindex", frozenset("x"))
            return x, None
        r = Idx("rindex", frozenset("r"))
        c = Idx("cindex", frozenset("c"))
        outer = self.s.reduce_shape[:-1]
        # A reduced axis of length 1 has index 0 everywhere: then rows and columns coincide.
        full = env_of([(r, self.s.rows), (c, self.s.cols)], self.s.reduce_shape,
                      Idx("(rindex * C + cindex)", frozenset("rc")))
        row = env_of([(r, self.s.rows)], tuple(outer) + (1,), r)
        return full, row

    def matmul_envs(self):
        return matmul_envs(self.s)

    def root_env(self, root: PNode) -> Env:
        if self.s.kind == "pointwise" and self.s.inner:
            return pointwise.tiled_env(root, self.s.inner)
        if self.s.kind == "pointwise":
            x = Idx("xindex", frozenset("x"))
            return env_of([(x, root.numel)], root.shape, x)
        if self.s.kind == "matmul":
            return reshape_env(self.matmul_envs()[0], root.shape)
        full, row = self.base_envs()
        base = full if root.numel == self.s.rows * self.s.cols else row
        return reshape_env(base, root.shape) if root.shape != base.shape else base

    # --- values ------------------------------------------------------------------------------
    def emit(self, node: PNode, env: Env) -> Val:
        key = (id(node), env_key(env))
        if key in self.memo_outer:
            return self.memo_outer[key]
        if key in self.memo_loop:
            return self.memo_loop[key]
        if not node.shape and env.shape:
            # A rank-0 value used as a scalar operand: the same at every point.
            env = Env((), (), None, None, env.guard)
            key = (id(node), env_key(env))
            if key in self.memo_outer:
                return self.memo_outer[key]
        if tuple(env.shape) != tuple(node.shape):
            raise AssertionError(f"{node.op} of shape {node.shape} evaluated at {env.shape}")
        val = getattr(self, f"_emit_{node.op}")(node, env)
        memo = self.memo_loop if self.in_loop(val.axes) else self.memo_outer
        memo[key] = val
        return val

    def _emit_load(self, node, env, upcast: bool = True):
        buf, strides, offset = node.attrs
        if buf not in self.params:
            self.params.append(buf)
        off = strided_offset(env, strides, node.shape, offset)
        axes = off.axes | (env.guard.axes if env.guard is not None else frozenset())
        m = self.mask(axes, env.guard)
        ptr = f"{buf} + {off.expr}" if off.expr != "0" else buf
        if m and axes - PROGRAM_AXES and not off.axes - PROGRAM_AXES:
            # One address for the whole block under a block mask (a one-element buffer read
            # in one branch of a concatenation; a decode step's position, read once per
            # batch row for its rotary embedding): Triton takes no block mask for a scalar
            # pointer, so the mask is applied after the read (found by random graphs)
            text = f"tl.where({m}, tl.load({ptr}), 0)"
        else:
            text = f"tl.load({ptr}, mask={m}, other=0)" if m else f"tl.load({ptr})"
        if upcast and node.dtype in ops.NARROW_FLOATS:
            text += ".to(tl.float32)"
        return self.assign(text, axes, "x" if "x" in axes else "v")

    def _emit_const(self, node, env):
        (value,) = node.attrs
        return Val(literal(value, node.dtype), frozenset())

    def _emit_iota(self, node, env):
        (axis,) = node.attrs
        d = env.dims[axis]
        return Val(d.expr, d.axes) if not d.is_zero else Val("0", frozenset())

    def _emit_unary(self, node, env):
        a = self.emit(node.args[0], env)
        return self._stepped(ops.UNARY[node.attrs[0]], {"a": a.expr, **COMPUTE_BITS[node.dtype == "float64"]},
                             a.axes)

    def _emit_binary(self, node, env):
        a, b = self.emit(node.args[0], env), self.emit(node.args[1], env)
        op = ops.BINARY[node.attrs[0]]
        if op.name == "pow":
            return self._emit_pow(node, a)
        if op.name == "div" and (recip := reciprocal_of_constant(node)) is not None:
            return self.assign(f"({a.expr} * {recip})", a.axes)
        return self._stepped(op, {"a": a.expr, "b": b.expr}, a.axes | b.axes)

    def _stepped(self, op, names: dict, axes) -> Val:
        """``op``'s value over the operands ``names``, each of its steps (``lets``) assigned first."""
        for name, step in op.lets:
            names[name] = self.assign(step.format(**names), axes).expr
        return self.assign(op.triton.format(**names), axes)

    def _emit_pow(self, node, a):
        """x ** e for a constant e, as exp2(e * log2|x|), with the sign of x for odd integer e.
        Zero and infinities come out as torch has them; a negative x with a fractional e
        gives NaN, as in torch."""
        exp = node.args[1]
        if exp.op != "const":
            raise Unschedulable("pow with a tensor exponent")
        e = float(exp.attrs[0])
        if e == 0:  # x ** 0 is 1, NaN and zero included
            return self.assign(f"tl.where({a.expr} == {a.expr}, 1.0, 1.0)", a.axes)
        if e in EXACT_POWERS:  # as torch computes them: products, not exp2(e * log2|x|), whose
            # rounding overflows where the product does not (a 0.5-norm of the largest float)
            return self.assign(EXACT_POWERS[e].format(a=a.expr), a.axes)
        # exp2(e * log2|x|) in float64: in float32 the rounding of log2|x|, scaled by e, grew
        # to 9e-6 of the value (x ** 1.7 at 4e22; torch's powf is within 3e-7) and results
        # past the denormals' edge came out 0
        back = "tl.float64" if node.dtype == "float64" else "tl.float32"

        def power(x: str) -> str:
            return f"tl.exp2({e!r} * tl.log2(({x}).to(tl.float64))).to({back})"
        if e.is_integer():
            mag = self.assign(power(f"tl.abs({a.expr})"), a.axes)
            if int(e) % 2 == 0:
                return mag
            # x's sign, -0.0's too (1 / x < 0), negated as a product (Triton's -m is 0 - m)
            neg = f"{mag.expr} * -1.0"
            return self.assign(f"tl.where({a.expr} < 0, {neg}, tl.where(1.0 / {a.expr} < 0, {neg}, {mag.expr}))",
                               a.axes)
        if e in (0.5, -0.5):  # torch takes these as sqrt and rsqrt (-0.0 ** 0.5 is -0.0)
            return self.assign(f"tl.{'sqrt' if e > 0 else 'rsqrt'}({a.expr})", a.axes)
        # -inf ** e is +inf (e > 0) or +0 (e < 0) for a fractional e, as C's pow has it
        at_minus_inf = "0.0" if e < 0 else "float('inf')"
        return self.assign(f"tl.where({a.expr} == -float('inf'), {at_minus_inf}, {power(a.expr)})", a.axes)

    def _emit_where(self, node, env):
        c, a, b = (self.emit(x, env) for x in node.args)
        return self.assign(f"tl.where({c.expr}, {a.expr}, {b.expr})", c.axes | a.axes | b.axes)

    def _emit_cast(self, node, env):
        src = node.args[0]
        a = self.emit(src, env)
        dst = node.dtype
        if dst == src.dtype or (dst == "float32" and src.dtype in ops.NARROW_FLOATS):
            return a  # narrow floats are computed in float32 already
        if dst == "bool":
            return self.assign(f"({a.expr} != 0)", a.axes)
        if dst in ops.NARROW_FLOATS:  # rounded, and computed on in float32
            if not a.axes:  # a scalar: a literal (tl.cast makes it a tensor) or one element read
                return self.assign(f"tl.cast(tl.cast({a.expr}, {ops.TRITON_DTYPES[dst]}), tl.float32)", a.axes)
            return self.assign(f"{a.expr}.to({ops.TRITON_DTYPES[dst]}).to(tl.float32)", a.axes)
        if not a.axes:
            return Val(f"{a.expr}", a.axes) if ops.is_float(dst) else Val(f"int({a.expr})", a.axes)
        return self.assign(f"{a.expr}.to({compute_dtype(dst)})", a.axes)

    def _emit_index_map(self, node, env):
        return self.emit(node.args[0], operand_env(node, env))

    _emit_broadcast = _emit_reshape = _emit_permute = _emit_slice = _emit_index_map

    def _emit_cat(self, node, env):
        (dim,) = node.attrs
        a, b = node.args
        n0 = a.shape[dim]
        d = env.dims[dim]
        first = Idx(f"({d.expr} < {n0})", d.axes)
        second = Idx(f"({d.expr} >= {n0})", d.axes)
        va = self.emit(a, shifted_env(env, dim, 0, a.shape, first))
        vb = self.emit(b, shifted_env(env, dim, n0, b.shape, second))
        return self.assign(f"tl.where({first.expr}, {va.expr}, {vb.expr})", va.axes | vb.axes | d.axes)

    def _emit_gather(self, node, env):
        (dim,) = node.attrs
        x, index = node.args
        i = self.emit(index, env)
        inside = self.assign(f"(({i.expr} >= 0) & ({i.expr} < {x.shape[dim]}))", i.axes)
        # an index outside the table reads row 0 (a valid address), then NaN (0) in its place
        safe = self.assign(f"tl.where({inside.expr}, {i.expr}, 0)", i.axes)
        v = self.emit(x, gathered_env(env, dim, Idx(safe.expr, safe.axes), x.shape))
        missing = "float('nan')" if ops.is_float(node.dtype) else literal(0, node.dtype)  # False for a bool
        return self.assign(f"tl.where({inside.expr}, {v.expr}, {missing})", v.axes | inside.axes)

    def _emit_dot(self, node, env):
        # Every product is computed up front at the output tile (emit_dots); reaching one
        # anywhere else means an index map moves the tile.
        raise Unschedulable("a matmul reached through an index map that moves its output tile")

    def emit_dots(self):
        """One loop over K that feeds every product of the kernel; or, where the products
        are only summed (``summed_products``), their K ranges end to end into one
        accumulator: one loop where their reads share a layout (``shared_reads``), else a
        loop per product."""
        out_env, a_env, b_env = self.matmul_envs()
        dots = [n for n in self.spec.walk() if n.op == "dot"]
        if self.s.summed:
            acc = self.fresh("acc")
            self.lines.append(f"{acc} = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
            shared = shared_reads(dots, self.s.dot_dtype) if self.descriptors is None else None
            if shared is not None:
                self.summed_loop(shared, acc, a_env, b_env)
            else:
                for d in dots:
                    self.open_loop()
                    self.loop.append(f"{acc} = {self.dot_step(d, a_env, b_env, acc)}")
                    self.close_loop()
            total = summed_products(self.spec)
            self.memo_outer[(id(total), env_key(reshape_env(out_env, total.shape)))] = Val(acc, frozenset("mn"))
            return
        accs = [self.fresh("acc") for _ in dots]
        for acc in accs:
            self.lines.append(f"{acc} = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
        self.open_loop()
        for d, acc in zip(dots, accs):
            self.loop.append(f"{acc} = {self.dot_step(d, a_env, b_env, acc)}")
        self.close_loop()
        for d, acc in zip(dots, accs):
            self.memo_outer[(id(d), env_key(out_env))] = Val(acc, frozenset("mn"))

    def summed_loop(self, shared: tuple, acc: str, a_env: Env, b_env: Env):
        """Products whose operands are reads of one layout (``shared_reads``) as one K loop
        over their K ranges laid end to end: each step picks its product's buffers by
        address, then loads and multiplies as a single product does."""
        (a_parts, a_at), (b_parts, b_at) = shared
        for buf, _ in a_parts + b_parts:
            if buf not in self.params:
                self.params.append(buf)
        self.open_loop()
        for name, parts in ((PART_A, a_parts), (PART_B, b_parts)):
            self.loop.append(f"{name} = {_pick(parts)}")
        template = PNode("dot", (), (a_at, b_at), (self.s.m, self.s.n), self.s.dot_dtype)
        self.loop.append(f"{acc} = {self.dot_step(template, a_env, b_env, acc)}")
        if any(re.search(rf"\b({PART_A}|{PART_B})\b", line) for line in self.lines):
            # An operand constant along K (K = 1, or broadcast along it) is loaded before the
            # loop, where no part is picked yet (found by random graphs: a @ b + b @ a on
            # 1 x 1 matrices); the extraction then takes another plan
            raise Unschedulable("summed products with an operand constant along K")
        self.params = [p for p in self.params if p not in (PART_A, PART_B)]
        self.close_loop(parts=len(a_parts))

    def dot_step(self, d: PNode, a_env: Env, b_env: Env, acc: str) -> str:
        """One K step of product ``d``, added to ``acc`` (operand loads go in the loop)."""
        a = self.dot_operand(d.args[0], a_env, ("m", "k"), "[BLOCK_M, BLOCK_K]")
        b = self.dot_operand(d.args[1], b_env, ("j", "n"), "[BLOCK_K, BLOCK_N]")
        return f"tl.dot({a}, {b}, {acc}{self.dot_precision()})"

    def dot_precision(self) -> str:
        if self.s.dot_dtype != "float32":
            return ""
        import torch
        return ', input_precision="tf32"' if torch.backends.cuda.matmul.allow_tf32 else ', input_precision="ieee"'

    def dot_operand(self, node, env, axes, block) -> str:
        """An operand tile in the dot's input dtype. A plain read (through index maps only)
        is loaded as stored; a computed operand (prologue) is computed in float32, zeroed
        past the end of K (the other side's padding may not be finite) and rounded.
        ``axes`` names the tile's row and column axes; ``block`` is its shape."""
        base, benv = node, env
        while base.op in ("broadcast", "reshape", "permute"):
            base, benv = base.args[0], operand_env(base, benv)
        want = self.s.dot_dtype
        raw = base.op == "load" and base.dtype == want
        key = operand_key(node, env, axes)
        if key in self.memo_loop:
            return self.memo_loop[key].expr
        if self.descriptors is not None:
            out = self.assign(self.descriptor_load(node, env, axes), frozenset(axes), "a" if "m" in axes else "b")
            self.memo_loop[key] = out
            return out.expr
        v = self._emit_load(base, benv, upcast=False) if raw else self.emit(node, env)
        expr = v.expr
        kaxis = next(a for a in axes if a in "kjef")  # the contracted one
        # A load past K reads 0 through its mask; anything else (a computed value, or one
        # constant along K, as when K is 1) is zeroed there explicitly, which gives it the
        # K axis (a scalar operand becomes a row of the tile, then the whole tile).
        present = set(v.axes)
        if kaxis in self.uneven and (not raw or kaxis not in v.axes):
            expr = f"tl.where({self.uneven[kaxis]}, {expr}, 0.0)"
            present.add(kaxis)
        if not (set(axes) <= present):
            expr = f"tl.broadcast_to({expr}, {block})" if present else f"tl.full({block}, {expr}, tl.float32)"
        if not raw:
            expr = f"({expr}).to({ops.TRITON_DTYPES[want]})"
        out = v if expr == v.expr else self.assign(expr, frozenset(axes), "a" if "m" in axes else "b")
        self.memo_loop[key] = out
        return out.expr

    def descriptor(self, b: tma.Box, block: tuple) -> str:
        """The name of the descriptor of box ``b`` with tile ``block`` (made once per program);
        a batched box is 3-D, one matrix deep."""
        key = (b, block)
        if key not in self.descriptors:
            name = self.descriptors[key] = f"desc{len(self.descriptors) + 1}"
            base = f"{b.buf} + {b.offset}" if b.offset else b.buf
            shape, strides, tile = [*b.shape], [b.stride, 1], [*block]
            if b.batch:
                shape, strides, tile = [b.batch[1], *shape], [b.batch[0], *strides], [1, *tile]
            # An extent that is a size taken at launch is that size (a sized module: the
            # descriptor of x in x @ W, [M, K], follows the batch). Where an extent only
            # equals it by chance, the module at the next size tells (codegen/sized.py).
            named = {v: k for k, v in (("N", self.s.n), ("M", self.s.m)) if k in self.runtime}
            shape = [named.get(v, v) for v in shape]
            self.descriptor_lines.append(
                f"{name} = tl.make_tensor_descriptor({base}, shape=[{', '.join(map(str, shape))}], "
                f"strides=[{', '.join(map(str, strides))}], block_shape=[{', '.join(map(str, tile))}])")
            self.tma_params.add(b.buf)
        return self.descriptors[key]

    def batch_coord(self, b: tma.Box) -> str:
        """The batch coordinate of a 3-D box's tile ('' for a 2-D box): TMA takes int32."""
        if not b.batch:
            return ""
        return "bindex.to(tl.int32), " if self.index_dtype_cast else "bindex, "

    def descriptor_load(self, node, env, axes) -> str:
        """An operand tile fetched by TMA: ``[BLOCK_M, BLOCK_K]`` of A or ``[BLOCK_K, BLOCK_N]``
        of B, read as its buffer lies and transposed (a view) where K is not contiguous
        in it. Past the buffer's edges TMA reads zeros, so no mask."""
        row = "m" if "m" in axes else "n"
        side = _operand_sides(self.s)[0 if row == "m" else 1]
        b = operand_box(node, env, side[2])
        if b.buf not in self.params:
            self.params.append(b.buf)
        rblock, start = ("BLOCK_M", "pid_m * BLOCK_M") if row == "m" else ("BLOCK_N", "pid_n * BLOCK_N")
        k_inner = b.inner == side[2][1]
        block = (rblock, "BLOCK_K") if k_inner else ("BLOCK_K", rblock)
        name = self.descriptor(b, block)
        coords = f"[{self.batch_coord(b)}{start}, k0]" if k_inner else f"[{self.batch_coord(b)}k0, {start}]"
        tile = f"{name}.load({coords})"
        if b.batch:  # one matrix deep: the [1, rows, cols] block as a matrix
            tile += f".reshape({block[0]}, {block[1]})"
        # A wants [rows, K] and B [K, cols]: A read K-contiguous and B read N-contiguous are as stored
        as_stored = k_inner == (row == "m")
        return tile + ("" if as_stored else ".T")

    def descriptor_store(self, expr: str, buf: str, env: Env, shape) -> bool:
        """Store an output tile through a descriptor, in two halves along N (half the shared
        memory staging buffer), if its layout allows: lines written, True; else False.
        In a subtiled epilogue the tile is already a half, at column ``n0``."""
        item = ops.itemsize(self.buffers[buf].dtype)
        affine = tma.atom_strides(env, self.buffers[buf].layout, shape)
        b = tma.box(buf, item, 0, affine, "mindex", "nindex", "bindex" if self.s.batch else None)
        if b is None or b.inner != "nindex":
            return False
        name = self.descriptor(b, ("BLOCK_M", "BLOCK_N // 2"))
        at = f"{self.batch_coord(b)}pid_m * BLOCK_M"
        value = f"({expr}).to({buf}.dtype.element_ty)"
        if self.subtile:  # BLOCK_N here is the tile's width, which subtiled makes the half's
            deep = ".reshape(1, BLOCK_M, BLOCK_N)" if b.batch else ""
            self.lines.append(f"{name}.store([{at}, n0], {value}{deep})")
            return True
        out = self.fresh("out")
        self.lines.append(f"{out} = {value}")
        self.lines.append(f"{out}_lo, {out}_hi = {halves(out)}")
        deep = ".reshape(1, BLOCK_M, BLOCK_N // 2)" if b.batch else ""
        self.lines.append(f"{name}.store([{at}, pid_n * BLOCK_N], {out}_lo{deep})")
        self.lines.append(f"{name}.store([{at}, pid_n * BLOCK_N + BLOCK_N // 2], {out}_hi{deep})")
        return True

    def subtiled(self, epilogue: list[str]) -> list[str]:
        """The epilogue of the TMA form (written for a whole ``[BLOCK_M, BLOCK_N]`` tile)
        run on each half of the tile along N in turn: the accumulators split in two (a
        register renaming in the MMA layout), ``nindex`` and ``n0`` the half's columns.
        Half the epilogue's values are live at once. At 128 x 256 tiles with 8 warps the
        accumulator takes 128 of a thread's 255 registers, and an epilogue with a special
        function spills: gelu's backward (BERT) spilled 868 bytes a thread on the whole
        tile and took ptxas 1.7 s, on halves nothing and 1.1 s. On an H100, gelu(x@W+b) at
        8192x4096x4096 fp16 ran in 459 and 448 us against 473 and 476 whole (two runs;
        cuBLAS's product alone 401-406). A light epilogue (a residual add) ran slower on
        halves, 458 against 438-449 us: its loads no longer go out at once. So only an
        epilogue with a special function (``special_function``) is written so.
        Every ``BLOCK_N`` in the epilogue's lines is the tile's width, and becomes the half's."""
        accs = sorted(set(re.findall(r"\bacc\d+\b", "\n".join(epilogue))))
        out = [f"{a}_lo, {a}_hi = {halves(a)}" for a in accs]
        body = []
        for a in accs:  # half is a constexpr: the branch is chosen as the loop is unrolled
            body += ["if half == 0:", f"    {a}_half = {a}_lo", "else:", f"    {a}_half = {a}_hi"]
        body += [f"n0 = pid_n{self.index_dtype_cast} * BLOCK_N + half * (BLOCK_N // 2)",
                 "nindex = n0 + tl.arange(0, BLOCK_N // 2)[None, :]"]
        if "n" in self.uneven:
            body.append("nmask = nindex < N")
        for line in epilogue:
            line = re.sub(r"\b(acc\d+)\b", r"\1_half", line)
            body.append(re.sub(r"\bBLOCK_N\b", "(BLOCK_N // 2)", line))
        return out + ["for half in tl.static_range(2):"] + ["    " + b for b in body]

    def _emit_reduce(self, node, env):
        if self.s.kind != "reduction":
            raise Unschedulable("reduction in a pointwise kernel")
        full, row = self.base_envs()
        if env.dims != row.dims:
            raise Unschedulable("a reduction reached through an index map that moves its rows")
        if env.guard is not None:  # reads the row whole wherever it is used (a guard masks others' reads)
            return self.emit(node, row)
        op = node.attrs[0]
        neutral = literal(ops.reduce_identity(op, node.dtype), node.dtype)
        fn = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min", "prod": PRODUCT}[op]
        acc_dt = compute_dtype(node.dtype)
        cm = self.mask(frozenset("c"))
        nan_aware = op in ("max", "min") and ops.is_float(node.dtype)
        if self.s.persistent:
            v = _as_reduced(self.emit(node.args[0], full), node.dtype)
            masked = f"tl.where({cm}, {v.expr}, {neutral})" if cm else v.expr
            if "c" not in v.axes:  # constant along the row: broadcast before reducing
                masked = f"tl.where(tl.full([1, BLOCK_C], 1, tl.int1), {v.expr}, {neutral})" if not cm else masked
            if nan_aware:
                masked = self.assign(masked, v.axes | frozenset("rc")).expr
            return self.assign(_row_reduction(fn, masked, nan_aware), frozenset("r"), "red")
        # Looped: inner reductions first, at row scope, then one pass over the row.
        if self.loop is not None:
            raise Unschedulable("nested reduction loop")
        sums = [n for n in self.spec.walk() if n.op == "expsum" and n.args[0] is node.args[0]]
        if op == "max" and sums:  # the running max of that softmax's pass
            self.emit(sums[0], row)
            return self.running_max[id(node.args[0])]
        if op == "sum" and (picked := self._selected(node.args[0], full)) is not None:
            return picked
        for inner in _direct_reduces(node.args[0]):
            self.emit(inner, row)
        acc = self.fresh("acc")
        self.lines.append(f"{acc} = tl.full([BLOCK_R, BLOCK_C], {neutral}, {acc_dt})")
        self.open_loop()
        v = _as_reduced(self.emit(node.args[0], full), node.dtype)
        masked = f"tl.where({cm}, {v.expr}, {neutral})" if cm else v.expr
        nan = ", propagate_nan=tl.PropagateNan.ALL" if nan_aware else ""
        combine = {"sum": f"{acc} + {masked}", "max": f"tl.maximum({acc}, {masked}{nan})",
                   "min": f"tl.minimum({acc}, {masked}{nan})", "prod": f"{acc} * {masked}"}[op]
        self.loop.append(f"{acc} = {combine}")
        self.close_loop()
        return self.assign(_row_reduction(fn, acc, nan_aware), frozenset("r"), "red")

    def _selected(self, x: PNode, full: Env) -> Val | None:
        """A row sum of ``where(column == i, v, 0)``, with ``i`` one index per row (a gather:
        cross-entropy's ``logp[row, target[row]]``), as ``v`` read at column ``i`` only:
        one element instead of a pass over a vocabulary-wide row. None for other sums."""
        picked = selection(x)
        if picked is None:
            return None
        index, value, factor = picked
        i = self.emit(index, full)
        if "c" in i.axes:
            raise AssertionError("an index constant along the row varies along it")
        column = self.assign(f"({i.expr}).to(tl.int64)", i.axes | frozenset("r"), "col")
        pick = env_of([(Idx("rindex", frozenset("r")), self.s.rows), (Idx(column.expr, frozenset("r")), self.s.cols)],
                      self.s.reduce_shape, Idx(f"(rindex * C + {column.expr})", frozenset("r")))
        inside = Idx(f"(({column.expr} >= 0) & ({column.expr} < C))", frozenset("r"))
        v = self.emit(value, replace(pick, guard=inside))
        # The sum of one value and zeros: the value, a -0.0 made +0.0 as a sum from 0 makes it
        zero = literal(0, x.dtype)
        if factor is None:
            return self.assign(f"tl.where({inside.expr}, {v.expr} + {zero}, {zero})", v.axes | frozenset("r"), "red")
        # times r: v * r, and the other columns' 0 * r (NaN where r is not finite; a row
        # this long has other columns)
        r = self.emit(factor, full)
        if "c" in r.axes:
            raise AssertionError("a factor constant along the row varies along it")
        return self.assign(f"(tl.where({inside.expr}, {v.expr} * {r.expr}, {zero}) + {zero} * {r.expr}) + {zero}",
                           v.axes | r.axes | frozenset("r"), "red")

    def _emit_expsum(self, node, env):
        """``sum(exp(s - rowmax(s)))`` over a row too long for registers, in one pass. Each
        lane of the tile keeps a running max ``m`` and its sum ``l``, rescaled whenever its
        max grows; after the loop the lanes combine into the row's (the loop does no
        reduction across threads, as Inductor's online softmax). Eager's values: a row with
        a NaN has a NaN max and sum, a +inf gives inf - inf (NaN); a row of -inf only,
        0 / 0 in eager, gives NaN (the reference 0 in the loop keeps the sums at 0 until a
        score arrives)."""
        if self.s.kind != "reduction" or self.s.persistent:
            raise AssertionError("ExpSum is written out in this schedule (attention.spelled_out)")
        full, row = self.base_envs()
        if env.dims != row.dims:
            raise Unschedulable("a softmax sum reached through an index map that moves its rows")
        if env.guard is not None:
            return self.emit(node, row)
        if self.loop is not None:
            raise Unschedulable("nested reduction loop")
        (scores,) = node.args
        for inner in _direct_reduces(scores):
            self.emit(inner, row)
        m, total = self.fresh("m"), self.fresh("l")
        self.lines += [f'{m} = tl.full([BLOCK_R, BLOCK_C], -float("inf"), tl.float32)',
                       f"{total} = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)"]
        self.open_loop()
        v = self.emit(scores, full)
        tile = f"({v.expr}).to(tl.float32)"
        if "c" not in v.axes:
            tile = f"tl.broadcast_to({tile}, [BLOCK_R, BLOCK_C])"
        cm = self.mask(frozenset("c"))
        if cm:
            tile = f'tl.where({cm}, {tile}, -float("inf"))'
        t, grown, ref = self.fresh("s"), self.fresh("m"), self.fresh("ref")
        self.loop += [f"{t} = {tile}",
                      f"{grown} = tl.maximum({m}, {t}, propagate_nan=tl.PropagateNan.ALL)",
                      f'{ref} = tl.where({grown} == -float("inf"), 0.0, {grown})',
                      f"{total} = {total} * tl.exp({m} - {ref}) + tl.exp({t} - {ref})",
                      f"{m} = {grown}"]
        self.close_loop()
        top = self.assign(_row_reduction("tl.max", m, True), frozenset("r"), "m")
        top_ref = self.assign(f'tl.where({top.expr} == -float("inf"), 0.0, {top.expr})', frozenset("r"), "ref")
        row_sum = self.assign(f"tl.sum({total} * tl.exp({m} - {top_ref.expr}), 1)[:, None]", frozenset("r"), "l")
        self.running_max[id(scores)] = top
        return self.assign(f'tl.where({top.expr} == -float("inf"), float("nan"), {row_sum.expr})', frozenset("r"),
                           "red")

    def open_loop(self):
        self.loop = []
        self.memo_loop = {}

    def close_loop(self, parts: int = 1):
        """Ends the loop being written. A matmul loop with ``parts`` > 1 walks that many K
        ranges one after the other (each padded to whole BLOCK_K steps): ``part`` says
        which, and the K indices are within it."""
        body = self.loop
        self.loop = None
        self.memo_loop = {}
        if self.s.kind == "matmul" and self.descriptors is not None:
            head = ["for k0 in range(0, K, BLOCK_K):"]  # TMA: tiles by coordinates, zeros past K
        elif self.s.kind == "matmul" and parts > 1:
            head = [f"for k1 in range(0, {parts} * tl.cdiv(K, BLOCK_K) * BLOCK_K, BLOCK_K):",
                    "    part = k1 // (tl.cdiv(K, BLOCK_K) * BLOCK_K)",
                    "    k0 = k1 - part * (tl.cdiv(K, BLOCK_K) * BLOCK_K)",
                    "    kindex_a = k0 + tl.arange(0, BLOCK_K)[None, :]",
                    "    kindex_b = k0 + tl.arange(0, BLOCK_K)[:, None]"]
        elif self.s.kind == "matmul":
            head = ["for k0 in range(0, K, BLOCK_K):",
                    "    kindex_a = k0 + tl.arange(0, BLOCK_K)[None, :]",
                    "    kindex_b = k0 + tl.arange(0, BLOCK_K)[:, None]"]
        else:
            head = ["for c0 in range(0, C, BLOCK_C):", "    cindex = c0 + tl.arange(0, BLOCK_C)[None, :]"]
            if "c" in self.uneven:
                head.append("    cmask = cindex < C")
        if self.s.kind == "matmul" and self.descriptors is None and "k" in self.uneven:
            head += ["    kmask_a = kindex_a < K", "    kmask_b = kindex_b < K"]
        self.lines.extend(head)
        self.lines.extend("    " + b for b in body)

    # --- the kernel ----------------------------------------------------------------------------
    def store(self, root: PNode, buf: str, env: Env):
        v = self.emit(root, env)
        lin = strided_offset(env, self.buffers[buf].layout, root.shape)  # graph outputs: eager's strides
        # A unit M or N has index 0, yet the tile still has BLOCK_M x BLOCK_N lanes, of
        # which the mask keeps the first: the pointer takes the tile's shape.
        for axis, name in self.tile_axes(root):
            if axis not in lin.axes:
                lin = Idx(f"{lin.expr} + 0 * {name}", lin.axes | {axis})
        # A value that varies along axes its address does not (a one-element output of a
        # reduction kernel, its row's lanes masked past R): the pointer takes them too, as
        # Triton stores no block through a smaller pointer (found by random graphs)
        for axis in sorted(v.axes - lin.axes):
            if axis in AXIS_INDEX:
                lin = Idx(f"{lin.expr} + 0 * {AXIS_INDEX[axis]}", lin.axes | {axis})
        axes = lin.axes
        block = {"x": "[1, XBLOCK]" if self.s.inner else "[XBLOCK]", "y": "[YBLOCK, 1]", "yx": "[YBLOCK, XBLOCK]",
                 "r": "[BLOCK_R, 1]", "c": "[1, BLOCK_C]", "rc": "[BLOCK_R, BLOCK_C]",
                 "m": "[BLOCK_M, 1]", "n": "[1, BLOCK_N]", "mn": "[BLOCK_M, BLOCK_N]",
                 "d": "[1, BLOCK_D]", "md": "[BLOCK_M, BLOCK_D]"}
        want = "".join(a for a in "yxrcmnd" if a in axes)
        expr = v.expr
        if want and not set(want) <= set(v.axes):
            expr = f"tl.where(tl.full({block[want]}, 1, tl.int1), {expr}, {expr})"
        if buf not in self.params:
            self.params.append(buf)
        if self.descriptors is not None and want == "mn" and self.descriptor_store(expr, buf, env, root.shape):
            return
        m = self.mask(axes)
        ptr = f"{buf} + {lin.expr}" if lin.expr != "0" else buf
        text = f"tl.store({ptr}, ({expr}).to({buf}.dtype.element_ty)" + (f", mask={m})" if m else ")")
        self.line(text, axes)

    def tile_axes(self, root: PNode) -> tuple:
        """(axis, index) pairs a stored tile spans even where the root does not vary."""
        return (("m", "mindex"), ("n", "nindex")) if self.s.kind == "matmul" else ()

    def write(self, cfg: dict) -> str:
        s = self.s
        head = []
        pid = f"tl.program_id(0){self.index_dtype_cast}"
        if s.kind == "attention":
            head = self.write_body(cfg)
        elif s.kind == "pointwise":
            if s.inner:
                head += pointwise.head(s.numel, s.inner, cfg, self.uneven, self.index_dtype_cast, self.runtime)
            else:
                if s.numel % cfg["XBLOCK"] or "xnumel" in self.runtime:
                    self.uneven["x"] = "xmask"
                head.append(f"xindex = {pid} * XBLOCK + tl.arange(0, XBLOCK)")
                if "x" in self.uneven:
                    head.append("xmask = xindex < xnumel")
            for root, buf in self.spec.roots:
                self.store(root, buf, self.root_env(root))
        elif s.kind == "matmul":
            persistent = "PROGRAMS" in cfg
            if persistent:
                self.descriptors = {}
                self.subtile = special_function(self.spec)
            tile = self.matmul_head(cfg)
            self.emit_dots()
            epilogue = len(self.lines)
            for root, buf in self.spec.roots:
                self.store(root, buf, self.root_env(root))
            if self.subtile:
                self.lines[epilogue:] = self.subtiled(self.lines[epilogue:])
            if persistent:
                # Tiles numbered matrix by matrix: a batch index, then the tile in the matrix
                head += self.descriptor_lines + tile[:2]
                count = f"tiles_m * tiles_n * {math.prod(s.batch)}" if s.batch else "tiles_m * tiles_n"
                head.append(f"for tile in tl.range(tl.program_id(0), {count}, PROGRAMS, flatten=True):")
                self.lines = ["    " + line for line in tile[2:] + self.lines]
            else:
                head += tile
        else:
            if s.rows % cfg["BLOCK_R"] or "R" in self.runtime:
                self.uneven["r"] = "rmask"
            if not (s.persistent and s.cols == cfg["BLOCK_C"]):
                self.uneven["c"] = "cmask"
            head.append(f"rindex = {pid} * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]")
            if "r" in self.uneven:
                head.append("rmask = rindex < R")
            if s.persistent:
                head.append("cindex = tl.arange(0, BLOCK_C)[None, :]")
                if "c" in self.uneven:
                    head.append("cmask = cindex < C")
            full_roots = [(r, b) for r, b in self.spec.roots if r.numel == s.rows * s.cols and s.cols != 1]
            row_roots = [(r, b) for r, b in self.spec.roots if (r, b) not in full_roots]
            for root, buf in row_roots:
                self.store(root, buf, self.root_env(root))
            if full_roots:
                if not s.persistent:
                    for root, _ in full_roots:
                        for inner in _direct_reduces(root):
                            self.emit(inner, self.base_envs()[1])
                    self.open_loop()
                for root, buf in full_roots:
                    self.store(root, buf, self.root_env(root))
                if not s.persistent:
                    self.close_loop()
        if self.param_order:
            last = len(self.param_order)
            self.params.sort(key=lambda p: self.param_order.index(p) if p in self.param_order else last)
        params = list(self.params) + [k if k in self.runtime else f"{k}: tl.constexpr" for k in s.sizes]
        params += [f"{k}: tl.constexpr" for k in cfg if k not in LAUNCH_OPTIONS]
        doc = ", ".join(self.spec.fx_nodes) or "(no FX node)"
        body = head + self.lines
        out = ["@triton.jit", f"def {self.spec.name}({', '.join(params)}):",
               f'    """FX nodes: {doc}"""']
        out += ["    " + b for b in body]
        return "\n".join(out) + "\n"

    def matmul_head(self, cfg: dict) -> list[str]:
        """Program (or, persistent, tile number) -> output tile, in groups of GROUP_M
        tile-rows: tiles computed together read the same operand tiles, which then come
        from L2. The first two lines (tile counts) are outside a persistent loop."""
        s = self.s
        for axis, size, blk, name in (("m", s.m, "BLOCK_M", "mmask"), ("n", s.n, "BLOCK_N", "nmask"),
                                      ("k", s.k, "BLOCK_K", "kmask_a"), ("j", s.k, "BLOCK_K", "kmask_b")):
            if size % cfg[blk] or axis.upper() in self.runtime:
                self.uneven[axis] = name
        cast = self.index_dtype_cast
        persistent = "PROGRAMS" in cfg
        pid = "tile % (tiles_m * tiles_n)" if persistent and s.batch else "tile" if persistent else "tl.program_id(0)"
        head = ["tiles_m = tl.cdiv(M, BLOCK_M)",
                "tiles_n = tl.cdiv(N, BLOCK_N)",
                f"pid = {pid}",
                "group = pid // (GROUP_M * tiles_n)",
                "group_rows = tl.minimum(tiles_m - group * GROUP_M, GROUP_M)",
                "pid_m = group * GROUP_M + (pid % (GROUP_M * tiles_n)) % group_rows",
                "pid_n = (pid % (GROUP_M * tiles_n)) // group_rows",
                f"mindex = pid_m{cast} * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]",
                f"nindex = pid_n{cast} * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]"]
        if s.batch and persistent:
            head.append(f"bindex = (tile // (tiles_m * tiles_n)){cast}")
        elif s.batch:
            head.append(f"bindex = tl.program_id(1){cast}")
        if "m" in self.uneven:
            head.append("mmask = mindex < M")
        if "n" in self.uneven:
            head.append("nmask = nindex < N")
        return head


def halves(tile: str) -> str:
    """A ``[BLOCK_M, BLOCK_N]`` tile split into its left and right halves along N (columns
    0 .. BLOCK_N/2 and the rest), as Triton can without moving data between threads."""
    return f"tl.split(tl.permute(tl.reshape({tile}, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))"


def operand_key(node: PNode, env, axes) -> tuple:
    """What an operand tile is memoised under. Its axes are part of what it is: a value
    with no axis of its own (a 1 x 1 matrix, broadcast) is the left tile of one product and
    the right tile of another (found by random graphs: the second product of a backward
    reused the first one's tile, and its gradient came out 16 times too large)."""
    return ("operand", id(node), env_key(env), tuple(axes))


def _direct_reduces(node: PNode) -> list[PNode]:
    """Reductions (and softmax sums) under ``node`` not nested in another, innermost first."""
    found, seen = [], set()

    def go(n):
        if id(n) in seen:
            return
        seen.add(id(n))
        if n.op in ("reduce", "expsum"):
            found.append(n)
            return
        for a in n.args:
            go(a)
    go(node)
    return found


def compute_dtype(dtype: str) -> str:
    if dtype in ops.NARROW_FLOATS:
        return "tl.float32"
    if dtype == "bool":
        return "tl.int1"
    return ops.TRITON_DTYPES[dtype]


# the names a unary op's form may use for the bits of its compute dtype (ops.ODD)
COMPUTE_BITS = {False: {"int": "tl.int32", "float": "tl.float32", "sign": "(-0x7FFFFFFF - 1)"},
                True: {"int": "tl.int64", "float": "tl.float64", "sign": "(-0x7FFFFFFFFFFFFFFF - 1)"}}


def reciprocal_of_constant(node) -> str | None:
    """A float32 division by a constant as a product by its reciprocal, as Inductor lowers
    it: within an ulp of the division (the reciprocal of the float32 divisor, rounded
    once), while IEEE division costs as much as an exponential (Gemma-2's logit
    soft-capping, ``tanh(logits / 30) * 30``, was compute-bound with it). NaN, infinities
    and signed zeros come out as the division's. Not where the reciprocal leaves the
    normal floats (its rounding would lose digits), nor in float64 (a literal is float32),
    nor of a whole number, whose quotient is exact where the product is not: ``round(x,
    decimals=3)`` is ``round(x * 1000) / 1000``, a rotary frequency ``arange(0, d, 2) / d``."""
    divisor = node.args[1]
    if divisor.op != "const" or node.dtype not in ("float32", *ops.NARROW_FLOATS) or _whole(node.args[0]):
        return None
    c = float(torch.tensor(float(divisor.attrs[0]), dtype=torch.float32))
    if c == 0 or not math.isfinite(c):
        return None
    recip = float(torch.tensor(1.0 / c, dtype=torch.float32))
    if not torch.finfo(torch.float32).tiny <= abs(recip) < math.inf:
        return None
    return literal(recip, "float32")


def _whole(node) -> bool:
    """Whether ``node``'s values are whole numbers by what computes them."""
    if not ops.is_float(node.dtype) or node.op == "iota":
        return True
    if node.op == "const":
        return float(node.attrs[0]).is_integer()
    if node.op == "cast":
        return _whole(node.args[0])
    if node.op == "unary":
        return node.attrs[0] in ("round", "floor", "ceil", "trunc")
    return node.op == "binary" and node.attrs[0] in ("add", "sub", "mul") and all(map(_whole, node.args))


def literal(value, dtype: str) -> str:
    if dtype == "bool":
        return "True" if value else "False"  # tl.int1: a condition, not an int32
    if not ops.is_float(dtype):
        return str(int(value))
    v = float(value)
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else '-float("inf")'
    return repr(v)


@dataclass
class Generated:
    text: str
    sched: Schedule
    cfg: dict
    params: list  # parameter buffers, in signature order
    aligned: list  # those read or written through TMA descriptors: 16-byte aligned addresses only
    constexprs: dict | None = None  # a template's (codegen/flash.py), in place of sizes and config
    launch: dict | None = None  # likewise its launch options
    grid: tuple | None = None  # and its grid, where the schedule's is not it
    template: str = ""  # what the template is, for people reading the plan


def generate_kernel(spec: KernelSpec, buffers: dict, cfg: dict | None = None,
                    runtime: frozenset = frozenset(), order: list | None = None) -> Generated:
    """Source of one kernel, for ``cfg`` if it fits the kernel, else for the default.
    ``runtime``: size names (``RUNTIME_SIZES``) passed at launch instead of as constexprs.
    ``order``: the parameters' order where another form of the kernel fixed it (the
    launcher runs this one in its place with the same arguments)."""
    from .attention import spelled_out
    sched = schedule_of(spec)
    if sched.kind != "attention" and not online_softmax(sched):
        spec = spelled_out(spec)
    if cfg is None or not fits(sched, cfg):
        cfg = default_config(sched)
    if cfg.get("FLASH"):
        from . import flash
        g = flash.generate(spec, sched, buffers, cfg, runtime)
        if g is not None:
            return g
        cfg = unaligned_config(sched, cfg)  # the portable kernel (the default may be the template)
    if cfg.get("TEMPLATE"):
        g = matmul_templates.generate(spec, sched, buffers, cfg, runtime)
        if g is not None:
            return g
        cfg = unaligned_config(sched, cfg)
    if sched.kind == "attention":
        from .attention import AttentionWriter
        w = AttentionWriter(spec, buffers, sched, runtime)
    else:
        w = KernelWriter(spec, buffers, sched, runtime)
    w.param_order = order
    text = w.write(cfg)
    return Generated(text, sched, cfg, w.params, [p for p in w.params if p in getattr(w, "tma_params", ())])


def generate(spec: KernelSpec, buffers: dict, cfg: dict | None = None) -> tuple[str, Schedule, dict, list]:
    """Source of one kernel: (text, schedule, config, parameter buffers)."""
    g = generate_kernel(spec, buffers, cfg)
    return g.text, g.sched, g.cfg, g.params
