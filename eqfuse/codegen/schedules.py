"""How a kernel of the plan runs: its schedule (``schedule_of``), the legality question
extraction asks of every kernel it weighs.

Four schedules (the fourth, attention, is written by codegen/attention.py):

* pointwise: a flat index over the output, ``XBLOCK`` elements per program; or, where
  it reads a tensor across the output's order, ``YBLOCK x XBLOCK`` tiles of a 2-D
  iteration (codegen/pointwise.py);
* row reduction: ``BLOCK_R`` rows per program and the reduced axis of length ``C``
  either whole in registers (persistent: ``BLOCK_C >= C``) or walked in ``BLOCK_C``
  chunks, one loop per reduction stage (looped). Every reduction in a kernel is over the
  same rows; a reduction reached through an index map that does not keep the rows raises
  ``Unschedulable``, which extraction uses as its legality check;
* matmul: a ``BLOCK_M x BLOCK_N`` output tile per program (grouped along M so that
  neighbouring programs share operand tiles in L2), one loop over K in ``BLOCK_K`` steps
  that feeds every product of the kernel (``tl.dot``, float32 accumulators). Operands are
  computed inside the loop as their tiles are loaded (prologue); the rest of the kernel
  is computed on the accumulators (epilogue). Batch dims are the grid's second axis.
  On Hopper and later, where both operands are plain reads a TMA descriptor can describe
  (codegen/tma.py), a second form is offered: persistent programs (``PROGRAMS`` in the
  config) walking the tiles of every matrix of the batch, operand tiles fetched by TMA,
  output tiles stored by TMA where their layout allows; the tile model and the autotuner
  choose between the two;
* attention: softmax products (``ExpDot``/``ExpSum``) streamed over the keys with a
  running max, one program per block of query rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import Unschedulable
from ..schema import ops
from ..schema.plan import KernelSpec, PNode, operand_cut, readers
from . import access, pointwise, tiles, tma
from .indexing import (
    Env,
    Idx,
    env_of,
    operand_env,
    reshape_env,
    strided_offset,
)

PERSISTENT_MAX = 16384  # widest row kept whole in registers
COLUMN_MIN = 256  # a reduced axis shorter than this stays whole in registers, whichever way it is read


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@dataclass(frozen=True)
class Schedule:
    kind: str  # pointwise | reduction | matmul | attention
    numel: int = 0  # pointwise
    inner: int = 0  # pointwise: X of a 2-D iteration [numel / X, X] (codegen/pointwise.py); 0: flat
    rows: int = 0  # reduction
    cols: int = 0
    reduce_shape: tuple = ()
    persistent: bool = True
    columns: bool = False  # reduction: reads run along the rows (a bias gradient summed over tokens)
    batch: tuple = ()  # matmul: [*batch, M, N] = [*batch, M, K] x [*batch, K, N]
    m: int = 0
    n: int = 0
    k: int = 0
    dot_dtype: str = ""
    dots: int = 0
    summed: bool = False  # matmul: the products are only added up (one accumulator, their K ranges end to end)
    d: int = 0  # attention: [*batch, M, N] scores, values [*batch, N, D]; k is q's head dim
    band: tuple | None = None  # attention: the diagonals a mask leaves (attention.masked_band)
    flash: object = None  # attention on Hopper: flash.Form, where the flash template computes the kernel
    tma: bool = False  # matmul: every operand can be read through a TMA descriptor (codegen/tma.py)
    tile_reads: int = 0  # matmul: loads after the K loop that vary along both M and N (a residual, a mask)
    gathered: int = 0  # matmul: operand loads beyond one per operand (a concatenation's parts, selected per element)
    gathered_sides: tuple = ()  # matmul: the operands (0: A, 1: B) computed from several reads, in registers
    special: bool = False  # matmul: the kernel computes a special function (``special_function``)
    rounded: bool = False  # matmul: the products are in their operands' dtype (an epilogue may read them so)

    @property
    def sizes(self) -> dict:
        """The size constexprs of the kernel."""
        if self.kind == "pointwise":
            return {"xnumel": self.numel, "X": self.inner} if self.inner else {"xnumel": self.numel}
        if self.kind == "reduction":
            return {"R": self.rows, "C": self.cols}
        if self.kind == "attention":
            head = {"E": self.k, "BLOCK_E": max(tiles.MIN_BLOCK, next_pow2(self.k))} if self.k else {}
            return {"M": self.m, "N": self.n, "D": self.d, "BLOCK_D": max(tiles.MIN_BLOCK, next_pow2(self.d)), **head}
        return {"M": self.m, "N": self.n, "K": self.k}

    def describe(self) -> str:
        if self.kind == "pointwise":
            tiled = f", tiled [{self.numel // self.inner} x {self.inner}] (a read across the output's order)" \
                if self.inner else ""
            return f"pointwise over {self.numel} elements{tiled}"
        if self.kind == "reduction":
            how = "whole row in registers" if self.persistent else "looped"
            if self.columns:
                how += ", tiles across rows (reads run along them)"
            return f"{self.rows} rows x {self.cols} reduced ({how})"
        batch = f"{math.prod(self.batch)} x " if self.batch else ""
        if self.kind == "attention":
            scores = f"[{self.m} x {self.k}] @ [{self.k} x {self.n}]" if self.k else f"[{self.m} x {self.n}]"
            band = f", row i sees keys i{self.band[0]:+d}..i{self.band[1]:+d} (other tiles skipped)" \
                if self.band else ""
            return (f"attention {batch}softmax({scores}) @ [{self.n} x {self.d}] {self.dot_dtype}, "
                    f"streamed over {self.n} keys{band}")
        products = f", {self.dots} products" if self.dots > 1 else ""
        if self.summed:
            products = f", sum of {self.dots} products"
        if self.gathered:
            products += f", operands gathered from {self.gathered} more reads"
        return f"matmul {batch}[{self.m} x {self.k}] @ [{self.k} x {self.n}] {self.dot_dtype}{products}"

    def grid(self, cfg: dict) -> tuple:
        if self.kind == "pointwise" and self.inner:
            return (-(-(self.numel // self.inner) // cfg["YBLOCK"]) * -(-self.inner // cfg["XBLOCK"]),)
        if self.kind == "pointwise":
            return (-(-self.numel // cfg["XBLOCK"]),)
        if self.kind == "reduction":
            return (-(-self.rows // cfg["BLOCK_R"]),)
        if self.kind == "attention":
            return (-(-self.m // cfg["BLOCK_M"]), math.prod(self.batch))
        if "PROGRAMS" in cfg:  # persistent: each program walks tiles PROGRAMS apart
            return (cfg["PROGRAMS"], 1)
        programs = -(-self.m // cfg["BLOCK_M"]) * -(-self.n // cfg["BLOCK_N"])
        return (programs, math.prod(self.batch))


MAX_GRID_Y = 65535


# The sizes a kernel can take at launch (codegen/sized.py), by kind: those of the axes its
# programs are laid out along, and attention's keys, which it walks in a loop; never one it
# reduces over in registers or blocks whole.
RUNTIME_SIZES = {"pointwise": ("xnumel", "X"), "reduction": ("R",), "matmul": ("M", "N"), "attention": ("M", "N")}


def _matmul_schedule(spec: KernelSpec, nodes: list) -> Schedule:
    """``nodes``: the walk of ``spec`` spelled out (``attention.spelled_out``), where its
    products are; the reductions extraction can store are the spec's own."""
    dots = [n for n in nodes if n.op == "dot"]
    reductions = [n for n in spec.walk() if n.op == "reduce"]
    if reductions:
        # the reductions, else where a product's operand leaves them (a normalised row:
        # its statistics may be no value extraction can store)
        inner = {id(n) for n in reductions}
        reading = readers(dots, inner, nodes)
        cuts = [c for d in dots for c in operand_cut(d, inner, reading)]
        raise Unschedulable("a reduction in a matmul kernel", store=[n.eclass for n in reductions] + cuts)
    forms = {(d.shape, d.args[0].shape[-1], d.args[0].dtype) for d in dots}
    if len(forms) != 1:
        raise Unschedulable("matmuls of different shapes in one kernel")
    (shape, k, dtype), = forms
    for d in dots:
        if any(x.op == "dot" for operand in d.args for x in operand.walk()):
            raise Unschedulable("a matmul inside another matmul's operand")
    for root, _ in spec.roots:
        if root.numel != math.prod(shape):
            raise Unschedulable(f"a root of {root.numel} elements in a matmul over {list(shape)}")
    batch = tuple(shape[:-2])
    if math.prod(batch) > MAX_GRID_Y:
        raise Unschedulable(f"a batch of {math.prod(batch)} matmuls (the grid takes {MAX_GRID_Y})")
    sched = Schedule("matmul", batch=batch, m=shape[-2], n=shape[-1], k=k, dot_dtype=dtype, dots=len(dots),
                     summed=len(dots) > 1 and summed_products(spec) is not None)
    loads = [(side, sum(n.op == "load" for n in a.walk())) for d in dots for side, a in enumerate(d.args)]
    return replace(sched, tma=all(operand_box(d.args[i], env, atoms) is not None
                                  for d in dots for i, env, atoms in _operand_sides(sched)),
                   tile_reads=_epilogue_tile_reads(spec, sched, dots),
                   gathered=sum(max(0, n - 1) for _, n in loads),
                   gathered_sides=tuple(sorted({side for side, n in loads if n > 1})),
                   special=special_function(spec), rounded=all(d.dtype == d.args[0].dtype for d in dots))


def _epilogue_tile_reads(spec: KernelSpec, sched: Schedule, dots: list) -> int:
    """How many loads outside the products' operands vary along both M and N: tiles
    read in the epilogue (a residual, a boolean mask), not fetched ahead by the K loop's
    pipelining. The tile model counts them against the TMA form (codegen/tiles.py)."""
    operand_loads = {id(n) for d in dots for a in d.args for n in a.walk() if n.op == "load"}
    out_env = matmul_envs(sched)[0]
    found = set()
    for root, _ in spec.roots:
        for load, env in access.loads_at(root, reshape_env(out_env, root.shape)):
            buf, strides, offset = load.attrs
            if id(load) not in operand_loads and {"m", "n"} <= strided_offset(env, strides, load.shape, offset).axes:
                found.add(id(load))
    return len(found)


def summed_products(spec: KernelSpec) -> PNode | None:
    """The add tree of the kernel whose leaves are all of its products, each used nowhere
    else (``x @ a + y @ b + z @ c``: a backward's gradient from three projections), or None.
    Such products share one accumulator, which their K loops fill one after the other: the
    registers and shared memory of a single matmul, however many products."""
    nodes = spec.walk()
    users: dict[int, int] = {}
    for n in nodes:
        for a in n.args:
            users[id(a)] = users.get(id(a), 0) + 1
    for root, _ in spec.roots:
        users[id(root)] = users.get(id(root), 0) + 1

    def leaves(n: PNode) -> list | None:
        if n.op == "dot":
            return [n]
        if n.op == "reshape" and n.args[0].op == "dot" and users[id(n.args[0])] == 1:
            return [n.args[0]]  # a batched product seen through its flattened view
        if n.op == "binary" and n.attrs[0] == "add" and all(users[id(a)] == 1 for a in n.args):
            parts = [leaves(a) for a in n.args]
            return None if None in parts else parts[0] + parts[1]
        return None

    dots = [n for n in nodes if n.op == "dot"]
    for n in reversed(nodes):  # parents first: the largest tree is met before its subtrees
        if n.op == "binary":
            found = leaves(n)
            if found is not None and len(found) == len(dots):
                return n
    return None


# The index each axis of a block is laid out along, where the kernel's head names one
AXIS_INDEX = {"x": "xindex", "y": "yindex", "r": "rindex", "c": "cindex", "m": "mindex", "n": "nindex",
              "d": "dindex"}


# The operand buffers of a summed loop's current product (KernelWriter.summed_loop).
PART_A, PART_B = "part_a", "part_b"


def shared_reads(dots: list, dtype: str) -> tuple | None:
    """Where every product's left operand is a plain read (index maps over a load of the
    dot dtype) with one layout, and so is every right operand: per side, the (buffer,
    offset) of each product's read and the operand as read from the side's PART buffer
    at offset 0. Else None.

    Summed products in one loop over their K ranges, the buffers picked by address per
    step, compile like a single product; a loop per product made Triton's pipeliner take
    44 s over three (H100, GPT-2's cat(dq, dk, dv) @ W^T: 0.4 s and 54 us one loop, 44 s
    and 67 us three)."""
    sides = []
    for i, name in ((0, PART_A), (1, PART_B)):
        shapes = {_read_layout(d.args[i], dtype) for d in dots}
        if len(shapes) != 1 or None in shapes:
            return None
        parts = [base_read(d.args[i]).attrs for d in dots]
        sides.append(([(buf, offset) for buf, _, offset in parts], _reread(dots[0].args[i], name)))
    return tuple(sides)


def base_read(node: PNode) -> PNode:
    """What is under an operand's index maps (broadcast, reshape, permute): a load where
    the operand is a plain read."""
    while node.op in ("broadcast", "reshape", "permute"):
        node = node.args[0]
    return node


def _read_layout(node: PNode, dtype: str):
    """The index maps and read layout of a plain read of ``dtype`` (its buffer and offset
    aside), or None where ``node`` computes."""
    chain = []
    while node.op in ("broadcast", "reshape", "permute"):
        chain.append((node.op, node.attrs, node.shape))
        node = node.args[0]
    if node.op != "load" or node.dtype != dtype:
        return None
    return tuple(chain), node.attrs[1], node.shape


def _reread(node: PNode, buf: str) -> PNode:
    """``node`` with its read taken from ``buf`` at offset 0."""
    if node.op == "load":
        return replace(node, attrs=(buf, node.attrs[1], 0))
    return replace(node, args=(_reread(node.args[0], buf),))


def _pick(parts: list) -> str:
    """The address of the current part's buffer: a select over ``part``, innermost last."""
    expr = None
    for i, (buf, offset) in reversed(list(enumerate(parts))):
        at = f"{buf} + {offset}" if offset else buf
        expr = at if expr is None else f"tl.where(part == {i}, {at}, {expr})"
    return expr


def matmul_envs(s: Schedule) -> tuple:
    """Environments of the output tile and of the two operand tiles."""
    b = (Idx("bindex", frozenset("b")), math.prod(s.batch))
    m, n = (Idx("mindex", frozenset("m")), s.m), (Idx("nindex", frozenset("n")), s.n)
    ka, kb = (Idx("kindex_a", frozenset("k")), s.k), (Idx("kindex_b", frozenset("j")), s.k)
    return (env_of([b, m, n], s.batch + (s.m, s.n)),
            env_of([b, m, ka], s.batch + (s.m, s.k)),
            env_of([b, kb, n], s.batch + (s.k, s.n)))


def _operand_sides(s: Schedule) -> tuple:
    """(operand position, its tile's environment, (row index, K index, batch index or None))
    for A and B."""
    _, a_env, b_env = matmul_envs(s)
    batch = "bindex" if s.batch else None
    return ((0, a_env, ("mindex", "kindex_a", batch)), (1, b_env, ("nindex", "kindex_b", batch)))


def operand_box(node: PNode, env: Env, atoms: tuple) -> tma.Box | None:
    """The descriptor box of a matmul operand read as stored (through index maps only),
    or None where TMA cannot fetch its tile (a prologue, batch dims that do not fold into
    one index, strides or an offset TMA does not take)."""
    base, benv = node, env
    while base.op in ("broadcast", "reshape", "permute"):
        base, benv = base.args[0], operand_env(base, benv)
    if base.op != "load" or base.dtype not in ("float16", "bfloat16", "float32"):
        return None
    buf, strides, offset = base.attrs
    affine = tma.atom_strides(benv, strides, base.shape)
    return tma.box(buf, ops.itemsize(base.dtype), offset, affine, *atoms)


def schedule_of(spec: KernelSpec) -> Schedule:
    from .attention import attention_schedule, spelled_out, streams
    flows = streams(spec)
    if flows:
        return attention_schedule(spec, flows)
    nodes = spelled_out(spec).walk()
    if any(n.op == "dot" for n in nodes):
        return _matmul_schedule(spec, nodes)
    reduces = [n for n in nodes if n.op == "reduce"]
    if not reduces:
        sizes = {root.numel for root, _ in spec.roots}
        if len(sizes) != 1:
            raise Unschedulable("pointwise roots of different sizes")
        return Schedule("pointwise", numel=sizes.pop(), inner=pointwise.inner_extent(spec))
    shapes = {tuple(r.args[0].shape) for r in reduces}
    if len(shapes) != 1:
        raise Unschedulable(f"reductions over different shapes {sorted(shapes)}")
    shape = shapes.pop()
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    for root, _ in spec.roots:
        if root.numel not in (rows * cols, rows):
            raise Unschedulable(f"root of {root.numel} elements in a {rows}x{cols} reduction")
        if root.numel == rows * cols and not _ends_with(root.shape, cols):
            # Stored through its flat index, unravelled per element, and read again by a
            # loop of its own (H100, GPT-2's backward: a bias gradient storing the
            # concatenated q/k/v gradients, 131 us for 38 MB in and out)
            raise Unschedulable(f"an output of shape {list(root.shape)} across the rows of a {rows}x{cols} reduction")
    columns = cols >= COLUMN_MIN and _reads_run_along_rows(reduces, rows, cols, shape)
    return Schedule("reduction", rows=rows, cols=cols, reduce_shape=shape, columns=columns,
                    persistent=next_pow2(cols) <= PERSISTENT_MAX and not columns)


def _ends_with(shape, cols: int) -> bool:
    """Whether trailing dims of ``shape`` make up ``cols``: the reduction's rows, in order."""
    inner = 1
    for d in reversed(shape):
        if inner == cols:
            return True
        inner *= d
    return inner == cols


def _reads_run_along_rows(reduces, rows: int, cols: int, shape) -> bool:
    """Whether most of what the reductions read has its unit stride along the rows, not
    along the reduced axis: ``dy.sum(0)`` of a [tokens, features] gradient reduces rows
    of a transposed view. A row per program would then read one element per cache sector;
    tiles many rows wide read whole sectors. A value read once per row (a cross-entropy's
    target) is read alike either way and counts for neither: counted, it turned Qwen2's
    cross-entropy backward (whose sum reads only the targets) into 16-row tiles, 1.6 ms
    where a row per program takes under 1."""
    r, c = Idx("rindex", frozenset("r")), Idx("cindex", frozenset("c"))
    full = env_of([(r, rows), (c, cols)], shape)
    point = {"rindex": max(0, rows // 2 - 1), "cindex": max(0, cols // 2 - 1)}

    def steps(step, index: str) -> set:
        # Two neighbouring steps: one of them may cross a digit boundary (the row index of
        # [S, rows] partials at S/2 * rows, a head boundary of [heads x 64] features), both
        # only where the index has no unit digit at all.
        return {abs(step(index, {**point, index: max(0, point[index] - back)})) for back in (0, 1)}

    along_rows = along_cols = 0
    for red in reduces:
        for load, env in access.loads_at(red.args[0], full):
            step = access.address_steps(load, env)
            across = steps(step, "cindex")
            if 1 in across:
                along_cols += load.numel
            elif across != {0} and 1 in steps(step, "rindex"):
                along_rows += load.numel
    return along_rows > along_cols


def special_function(spec: KernelSpec) -> bool:
    """Whether the kernel computes a special function (exp, erf, sqrt, tanh...: a unary op
    the cost model rates 2 or more), which takes registers for its own temporaries."""
    return any(n.op == "unary" and ops.UNARY[n.attrs[0]].cost >= 2 for n in spec.walk())


def selection(x: PNode) -> tuple[PNode, PNode, PNode | None] | None:
    """(i, v, r) where ``x`` is ``where(column == i, v, 0)``, times ``r`` if ``r`` is not
    None, with ``i`` and ``r`` constant along the row (a gather as schema/handlers/indexing.py has it;
    cross-entropy's one-hot gradient times the loss's): its row sum is ``v * r`` at column
    ``i`` plus the other columns' ``0 * r``."""
    factor = None
    if x.op == "binary" and x.attrs[0] == "mul":
        a, b = x.args
        x, factor = (a, b) if a.op == "where" else (b, a)
        if not _row_constant(factor):
            return None
    if x.op != "where" or not _is_zero(x.args[2]):
        return None
    test, value = x.args[0], x.args[1]
    if test.op != "binary" or test.attrs[0] != "eq":
        return None
    last = len(x.shape) - 1
    sides = [a for a in test.args if not (a.op == "iota" and a.attrs[0] == last)]
    if len(sides) != 1 or not _row_constant(sides[0]):
        return None
    return sides[0], value, factor


def _row_constant(node: PNode) -> bool:
    """Whether ``node`` is the same along its last axis, by its form: constants, values
    broadcast or read with a stride of 0 along it, and pointwise functions of them."""
    if not node.shape or node.shape[-1] == 1 or node.op == "const":
        return True
    if node.op == "broadcast":  # (aligned from the right, as torch broadcasts)
        inner = node.args[0]
        return not inner.shape or inner.shape[-1] == 1
    if node.op == "load":
        return node.attrs[1][-1] == 0
    if node.op == "iota":
        return node.attrs[0] != len(node.shape) - 1
    if node.op in ("unary", "binary", "where", "cast"):
        return all(_row_constant(a) for a in node.args)
    return False


def _is_zero(node: PNode) -> bool:
    while node.op in ("broadcast", "cast"):
        node = node.args[0]
    return node.op == "const" and float(node.attrs[0]) == 0


def online_softmax(sched: Schedule) -> bool:
    """Whether a kernel of this schedule computes a softmax's ``ExpSum`` in one pass with a
    running max (rows too long for registers); elsewhere it is written out as
    ``sum(exp(s - rowmax(s)))``."""
    return sched.kind == "reduction" and not sched.persistent and not sched.columns


def looped_passes(spec: KernelSpec) -> int:
    """The passes over the row a looped reduction kernel makes: one per reduction, one
    for each ``ExpSum`` (whose running max also serves a ``Reduce_max`` of its scores),
    none for a sum that selects one element, and one for the outputs."""
    walk = spec.walk()
    scores = {id(n.args[0]) for n in walk if n.op == "expsum"}
    reduces = [n for n in walk if n.op == "reduce" and not (n.attrs[0] == "max" and id(n.args[0]) in scores)
               and not (n.attrs[0] == "sum" and selection(n.args[0]) is not None)]
    return 1 + len(reduces) + len(scores)
