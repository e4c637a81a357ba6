"""Plan objects: what extraction hands to code generation. Plain data, printable.

A ``PNode`` is one kernel-level operation with its shape and dtype; a kernel is a set of
root PNodes, each stored to a buffer. Loads name the buffer they read and the strided
view they read it through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .values import BufRef


def contiguous_strides(shape) -> tuple:
    """Row-major element strides of ``shape``."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


def _walk_from(roots) -> list:
    """The nodes under ``roots``, each once, children before parents (depth first, a
    node's arguments in order, each root's walk after the one before)."""
    seen, order = set(), []
    for root in roots:
        if id(root) in seen:
            continue
        seen.add(id(root))
        stack = [(root, iter(root.args))]  # a deep plan must not hit the recursion limit
        while stack:
            node, args = stack[-1]
            for a in args:
                if id(a) not in seen:
                    seen.add(id(a))
                    stack.append((a, iter(a.args)))
                    break
            else:
                stack.pop()
                order.append(node)
    return order


@dataclass(eq=False)
class PNode:
    op: str  # load const iota unary binary where cast reduce broadcast reshape permute slice cat
    #          gather dot expdot expsum
    attrs: tuple
    args: tuple
    shape: tuple
    dtype: str
    eclass: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def walk(self):
        """Each distinct node once, children before parents."""
        return _walk_from([self])

    def __repr__(self):
        inner = ", ".join([repr(a) for a in self.attrs] + [f"<{a.op}>" for a in self.args])
        return f"{self.op}({inner}) : {list(self.shape)} {self.dtype}"


@dataclass(frozen=True)
class BufArg:
    """A plan buffer passed as an argument to an eager fallback."""
    name: str


@dataclass
class Buffer:
    name: str
    shape: tuple
    dtype: str
    kind: str  # input | temp | output | external
    strides: tuple | None = None  # None: contiguous (graph outputs keep eager's strides)
    # (base buffer, element offset): this buffer is a view of the base's memory, which is
    # allocated in its place (a concatenation's part written in place: codegen/concat.py)
    view_of: tuple | None = None

    @property
    def layout(self) -> tuple:
        return self.strides if self.strides is not None else contiguous_strides(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class KernelSpec:
    name: str
    roots: list  # [(PNode, buffer name)]
    fx_nodes: list = field(default_factory=list)

    def walk(self):
        """Each distinct node once, children before parents (the roots' walks in turn).

        Kept after the first call: the scheduler, the code generator and the cost model
        walk a kernel a dozen times, and extraction weighs thousands of kernels. Plan nodes
        are not changed once built (a rewrite makes new ones), so the walk only goes stale
        if ``roots`` is given other nodes, which the key checks."""
        key = tuple(id(root) for root, _ in self.roots)
        cached = self.__dict__.get("_walk")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_walk"] = (key, _walk_from([root for root, _ in self.roots]))
        return list(cached[1])

    def known_walk(self, nodes: list) -> KernelSpec:
        """This spec, told its walk: a builder that made its nodes children first, in the
        order ``walk`` visits them, has it without walking. Returns the spec."""
        self.__dict__["_walk"] = (tuple(id(root) for root, _ in self.roots), list(nodes))
        return self


@dataclass
class FallbackStep:
    node: str
    target: Any
    args: Any
    kwargs: Any
    reason: str
    outputs: list  # external buffer names
    multi: bool
    writes: str | None = None  # the input buffer it writes in place (frontend/writes.py)


@dataclass
class LibraryCall:
    """A step that runs a library routine where a generated kernel would add nothing: a
    plain matrix product as ``torch.<op>`` (mm, bmm: cuBLAS on a GPU, codegen/library.py)
    over views of the buffers it reads, writing its output into the planned buffer."""
    name: str  # the name of the kernel it replaces
    op: str  # mm | bmm | addmm | baddbmm
    operands: list  # [BufRef] the left and right matrices (stacks of them for bmm), then the one added
    out: Any  # BufRef of the output's buffer, as the product lays it out
    description: str  # for explain(): the product's shapes and dtype
    fx_nodes: list = field(default_factory=list)
    split: tuple = ()  # ((dim "m" | "n" | "k", where its odd tail starts), ...): codegen/library.py torch_calls
    summed: tuple = ()  # ((left, right, out) BufRefs, ...): further products added onto the output, in turn

    def __str__(self) -> str:
        return f"{self.name}: torch.{self.op}, {self.description}"


@dataclass
class Plan:
    inputs: list  # [Buffer] in call order
    buffers: dict  # name -> Buffer
    steps: list  # KernelSpec | LibraryCall | FallbackStep, in execution order
    outputs: list  # per flat output: ("buffer", name) | ("view", BufRef) | ("const", v) | ("opaque", name)
    cost: float = 0.0
    cost_unfused: float = 0.0

    @property
    def kernels(self) -> list[KernelSpec]:
        return [s for s in self.steps if isinstance(s, KernelSpec)]

    @property
    def fallbacks(self) -> list[FallbackStep]:
        return [s for s in self.steps if isinstance(s, FallbackStep)]

    @property
    def library_calls(self) -> list[LibraryCall]:
        return [s for s in self.steps if isinstance(s, LibraryCall)]

    @property
    def written_inputs(self) -> tuple:
        """The positions of the inputs its steps write in place."""
        written = {s.writes for s in self.fallbacks if s.writes is not None}
        return tuple(i for i, b in enumerate(self.inputs) if b.name in written)


def operand_cut(node: PNode, inner: set, reading: set | None = None) -> list:
    """The e-classes whose storing separates ``node`` from the nodes it reads whose ids are
    in ``inner``: its first operand that reads one, then down that operand's single-operand
    nodes (index maps, casts, unary ops) to the first node of two operands; none where no
    operand reads one. Unschedulable names them for extraction's repair, which otherwise
    tries every value inside the kernel (code generation: a product reading a normalised
    row, attention reading its projections). ``reading``: ``readers`` of ``inner`` over
    ``node`` and its kin, where a caller cuts several products from one set."""
    reading = readers([node], inner) if reading is None else reading
    for operand in node.args:
        if id(operand) in reading:
            return chain_cut(operand)
    return []


def readers(roots, inner: set, walk: list | None = None) -> set:
    """The ids of the nodes under ``roots`` that are or read a node whose id is in
    ``inner``, in one walk (a kernel's products share their operands: a walk per operand
    took 47 of the 61 s T5's tiny backward graph spent extracting). ``walk``: a walk,
    children first, of nodes that include those under ``roots`` (a kernel's own walk,
    kept with it), taken instead of walking them again; whether a node reads one of
    ``inner`` depends only on the nodes under it, so the others change nothing."""
    found: set = set()
    for n in _walk_from(roots) if walk is None else walk:
        i = id(n)
        if i in inner:
            found.add(i)
            continue
        for a in n.args:
            if id(a) in found:
                found.add(i)
                break
    return found


def reads_any(node: PNode, inner: set) -> bool:
    """Whether ``node`` is or reads a node whose id is in ``inner``."""
    return id(node) in readers([node], inner)


def chain_cut(node: PNode) -> list:
    """The e-classes of ``node`` and down its single-operand nodes (index maps, casts,
    unary ops) to the first node of two operands: storing any of them cuts ``node`` off
    from what it reads."""
    cuts = [node.eclass]
    while len(node.args) == 1:
        node = node.args[0]
        cuts.append(node.eclass)
    return cuts


def substitute(node: PNode, new: dict) -> PNode:
    """``node`` with the nodes whose id ``new`` maps replaced, rebuilding what is above them."""
    memo: dict[int, PNode] = {}

    def go(n: PNode) -> PNode:
        if id(n) in new:
            return new[id(n)]
        if id(n) not in memo:
            args = tuple(go(a) for a in n.args)
            memo[id(n)] = n if all(a is b for a, b in zip(args, n.args)) else \
                PNode(n.op, n.attrs, args, n.shape, n.dtype, n.eclass)
        return memo[id(n)]
    return go(node)


def rewrite_kernels(plan: Plan, rewrite) -> None:
    """In place: each kernel of ``plan`` that ``rewrite(kernel, plan.buffers)`` turns into
    ``(kernels, new buffers)`` replaced by those kernels, the buffers added (a stage pass:
    split reductions, split-K, K-major copies); a kernel it returns None for kept."""
    steps = []
    for step in plan.steps:
        parts = rewrite(step, plan.buffers) if isinstance(step, KernelSpec) else None
        if parts is None:
            steps.append(step)
            continue
        kernels, buffers = parts
        plan.buffers.update({b.name: b for b in buffers})
        steps += kernels
    plan.steps[:] = steps


def step_reads(step) -> set:
    """The buffers a step of a plan reads: a kernel's loads, a library call's operands, an
    eager step's arguments."""
    if isinstance(step, KernelSpec):
        return {n.attrs[0] for n in step.walk() if n.op == "load"}
    if isinstance(step, LibraryCall):
        return {v.buf for v in step.operands} | {v.buf for a, b, _ in step.summed for v in (a, b)}
    found = set()

    def go(o):
        if isinstance(o, BufRef):
            found.add(o.buf)
        elif isinstance(o, BufArg):
            found.add(o.name)
        elif isinstance(o, (list, tuple)):
            for x in o:
                go(x)
        elif isinstance(o, dict):
            for x in o.values():
                go(x)
    go(step.args)
    go(step.kwargs)
    return found


def last_uses(plan: Plan) -> dict:
    """buffer -> the index of the last step that reads or writes it."""
    last: dict = {}
    for index, step in enumerate(plan.steps):
        for buf in (*step_reads(step), *step_writes(step)):
            last[buf] = index
    return last


def step_writes(step) -> list:
    """The buffers a step of a plan writes."""
    if isinstance(step, KernelSpec):
        return [buf for _, buf in step.roots]
    if isinstance(step, LibraryCall):
        return [step.out.buf]
    return step.outputs


def returned_buffers(plan: Plan) -> set:
    """The buffers the graph's outputs are, or are views of."""
    names = set()
    for kind, value in plan.outputs:
        if kind in ("buffer", "opaque"):
            names.add(value)
        elif kind == "view":
            names.add(value.buf)
    return names


def eager_reads(plan: Plan) -> set:
    """The buffers a step that is not a kernel reads (an eager step, a library call): laid
    out and typed as the plan says, whatever a pass would prefer."""
    reads = set()
    for step in plan.steps:
        if not isinstance(step, KernelSpec):
            reads |= step_reads(step)
    return reads


def kernel_writers(plan: Plan) -> dict:
    """buffer -> the kernels that write it, in order."""
    writers: dict[str, list] = {}
    for spec in plan.kernels:
        for _, out in spec.roots:
            writers.setdefault(out, []).append(spec)
    return writers

