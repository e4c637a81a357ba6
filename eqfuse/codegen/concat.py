"""Concatenations written in place: each part stored where the concatenation holds it.

A kernel whose value is ``cat(a, b, ...)`` copies its parts into the concatenation's
buffer, or computes every part at every element and keeps one (``tl.where``). In a
training step that is where a fused projection's gradient is made: Phi-3's backward
computes the gate and up projections' gradients (92 us) and then copies them into their
concatenation, [4096 x 16384] bf16, for the fused weight's gradient (65 us, twice a step
at two layers; an H200, benchmarks/zoo.py --profile). Inductor writes such parts into the
concatenation's buffer instead (its ConcatKernel), and so does this pass:

- a part that the kernel loads whole from a buffer another kernel writes becomes a view
  of the concatenation's buffer at the part's offset (``Buffer.view_of``): its writer
  stores it in place, its readers read it there, and the copy is gone;
- the parts the kernel computes become roots of their own, each stored into such a view:
  a pointwise kernel whose parts have one size computes each element once (its reads of
  a shared operand, the gradient both halves are made from, once too).

A kernel left with no roots is dropped. A sum of products over the parts, which the rule
dot-cat-split made of a product of the concatenation (``a @ w[:Ka] + b @ w[Ka:]``), is that
product again once the parts lie side by side: one product over adjacent slices of one
buffer on each side (``_joined_products``), which cuBLAS then takes (Phi-3's input
gradient of the fused projection, 545 us generated against about 494 for cuBLAS). The
concatenation's buffer is allocated where its first part is written (codegen/module.py),
and lives as long as any view of it.

Only parts that nothing else ties to their own memory: a temporary buffer that one kernel
writes contiguously, that no eager step reads and the graph does not return, and that
every kernel loads whole as it is laid out; and only where the concatenation's buffer is
laid out row-major (padded rows allowed), so that each part's stores keep their order.
Sized modules keep their copies (an offset is not linear in the size that rows follow).
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import Unschedulable
from ..schema.plan import (
    Buffer,
    KernelSpec,
    Plan,
    PNode,
    contiguous_strides,
    eager_reads,
    kernel_writers,
    returned_buffers,
    substitute,
)
from . import schedules
from .access import strided_view
from .kmajor import fresh_buffer_name

PART_SUFFIX = "_part"


def concat_in_place(plan: Plan) -> None:
    """Rewrite ``plan`` in place as the module docstring says. Running it again changes
    nothing (no kernel is left storing a concatenation of its parts)."""
    facts = _Facts(plan)
    for spec in list(plan.kernels):
        for root, out in list(spec.roots):
            if root.op == "cat":
                _write_in_place(plan, facts, spec, root, out)
        if not spec.roots:  # its FX nodes now run where the parts are stored
            for writer in facts.writers_of_moved.pop(id(spec), []):
                writer.fx_nodes += [n for n in spec.fx_nodes if n not in writer.fx_nodes]
            plan.steps.remove(spec)
    if facts.bases:
        for spec in plan.kernels:
            joined = _joined_products(spec, plan.buffers)
            if joined is not None:
                spec.roots = [(joined, spec.roots[0][1])]


class _Facts:
    """What the pass asks of the plan, gathered once: which buffers are tied to their own
    memory, who writes each, and which are loaded only whole as laid out."""

    def __init__(self, plan: Plan):
        self.shut = returned_buffers(plan) | eager_reads(plan)
        self.writers = kernel_writers(plan)
        self.position = {id(step): i for i, step in enumerate(plan.steps)}
        self.partial = set()  # buffers some kernel loads through another view than their own
        for kernel in plan.kernels:
            for n in kernel.walk():
                if n.op == "load" and n.attrs[0] in plan.buffers:
                    b = plan.buffers[n.attrs[0]]
                    if (n.attrs, tuple(n.shape)) != ((b.name, contiguous_strides(tuple(b.shape)), 0), tuple(b.shape)):
                        self.partial.add(b.name)
        self.bases = {b.view_of[0] for b in plan.buffers.values() if b.view_of is not None}
        self.writers_of_moved: dict[int, list] = {}  # id(cat kernel) -> the kernels now storing its parts


def _write_in_place(plan: Plan, facts: _Facts, spec: KernelSpec, root: PNode, out: str) -> None:
    base = plan.buffers[out]
    layout = tuple(base.layout)
    dim = root.attrs[0]
    if (base.view_of is not None or tuple(base.shape) != tuple(root.shape) or not _row_major(base.shape, layout)
            or facts.writers.get(out) != [spec]):
        return
    moved, computed, start = {}, [], 0  # moved: part buffer -> offset; computed: [(part, offset)]
    for part in _parts(root, dim):
        if part.numel == 0:
            return
        offset = start * layout[dim]
        start += part.shape[dim]
        if part.op == "load" and part.attrs[0] not in moved and _movable(plan, facts, spec, part):
            moved[part.attrs[0]] = offset
        else:
            computed.append((part, offset))
    if computed and not _computable(spec, root, [p for p, _ in computed]):
        return
    if not moved and len(computed) < 2:
        return
    facts.bases.add(out)
    views = {}
    for name, offset in moved.items():
        b = plan.buffers[name]
        b.strides, b.view_of = layout, (out, offset)
        views[name] = (name, layout, 0)
        facts.writers_of_moved.setdefault(id(spec), []).extend(facts.writers[name])
    roots = [(r, o) for r, o in spec.roots if r is not root]
    for part, offset in computed:
        name = fresh_buffer_name(f"{out}{PART_SUFFIX}", plan.buffers)
        plan.buffers[name] = Buffer(name, tuple(part.shape), part.dtype, "temp", layout, (out, offset))
        roots.append((part, name))
    spec.roots = roots
    for kernel in plan.kernels:  # every load of a moved part reads it where it now is
        new = {id(n): PNode("load", views[n.attrs[0]], (), n.shape, n.dtype, n.eclass)
               for n in kernel.walk() if n.op == "load" and n.attrs[0] in views}
        if new:
            kernel.roots = [(substitute(r, new), o) for r, o in kernel.roots]


def _parts(node: PNode, dim: int) -> list:
    """The parts a concatenation along ``dim`` joins, nested concatenations along it flattened."""
    if node.op == "cat" and node.attrs[0] == dim:
        return [p for arg in node.args for p in _parts(arg, dim)]
    return [node]


def _row_major(shape, strides) -> bool:
    """Whether ``strides`` keep the dims of ``shape`` in row-major order, the last one unit
    (rows padded or not): a part's view then stores in the order it did alone."""
    kept = [s for n, s in zip(shape, strides) if n > 1]
    return (not kept or kept[-1] == 1) and all(a >= b for a, b in zip(kept, kept[1:]))


def _movable(plan: Plan, facts: _Facts, spec: KernelSpec, load: PNode) -> bool:
    """Whether the buffer ``load`` reads may become a view of a concatenation's buffer."""
    name = load.attrs[0]
    b = plan.buffers.get(name)
    if (b is None or b.kind != "temp" or b.strides is not None or b.view_of is not None or b.dtype != load.dtype
            or name in facts.shut or name in facts.partial or name in facts.bases):
        return False
    writers = facts.writers.get(name, [])
    return len(writers) == 1 and writers[0] is not spec and facts.position[id(writers[0])] < facts.position[id(spec)]


def _computable(spec: KernelSpec, root: PNode, parts: list) -> bool:
    """Whether ``spec``, a pointwise kernel, stays one with the computed ``parts`` as roots
    in place of ``root``: every root then of one size."""
    try:
        if schedules.schedule_of(spec).kind != "pointwise":
            return False
    except Unschedulable:
        return False
    sizes = {p.numel for p in parts} | {r.numel for r, _ in spec.roots if r is not root}
    return len(sizes) == 1


def _joined_products(spec: KernelSpec, buffers: dict) -> PNode | None:
    """The one product that ``spec``'s root, a sum of 2-D products (maybe reshaped, as a
    linear layer's batch of rows is), is where their left operands are adjacent slices
    along K of one buffer's memory and so are their right ones (each a plain read under
    index maps that keep a view: a transpose, a reshape of rows), or None."""
    if len(spec.roots) != 1:
        return None
    root = spec.roots[0][0]
    reshapes, total = [], root
    while total.op == "reshape":
        reshapes.append(total)
        total = total.args[0]
    terms, stack = [], [total]
    while stack:
        node = stack.pop()
        if node.op == "binary" and node.attrs[0] == "add" and node.dtype == total.dtype:
            stack += reversed(node.args)
        elif node.op == "dot" and len(node.shape) == 2 and node.dtype == total.dtype:
            terms.append(node)
        else:
            return None
    if len(terms) < 2:
        return None
    lefts = [_stored_read(t.args[0], buffers) for t in terms]
    rights = [_stored_read(t.args[1], buffers) for t in terms]
    if None in lefts or None in rights:
        return None
    order = sorted(range(len(terms)), key=lambda i: lefts[i][2])  # the sum's terms in any order (add-comm)
    lefts, rights = [lefts[i] for i in order], [rights[i] for i in order]
    left, right = _adjacent(lefts, 1), _adjacent(rights, 0)
    if left is None or right is None:
        return None
    first = terms[0]
    a = PNode("load", left[:3], (), left[3], first.args[0].dtype)
    b = PNode("load", right[:3], (), right[3], first.args[1].dtype)
    joined = PNode("dot", first.attrs, (a, b), tuple(total.shape), total.dtype)
    for reshape in reversed(reshapes):
        joined = replace(reshape, args=(joined,))
    return joined


def _stored_read(node: PNode, buffers: dict) -> tuple | None:
    """(memory's buffer, strides, offset in it, shape) of a 2-D plain read under index
    maps that keep a view (``strided_view``), or None: a broadcast row, or a computed one."""
    view = strided_view(node)
    if view is None or view[1].dim() != 2 or 0 in view[1].stride():
        return None
    name, t = view
    offset = t.storage_offset()
    base = buffers[name].view_of
    if base is not None:
        name, offset = base[0], base[1] + offset
    return name, tuple(t.stride()), offset, tuple(t.shape)


def _adjacent(reads: list, dim: int) -> tuple | None:
    """The one read that ``reads`` (``_stored_read``'s) are, in order, where each starts
    along ``dim`` where the one before ends, in one buffer at one layout; else None."""
    name, strides, offset, shape = reads[0]
    length = shape[dim]
    for other in reads[1:]:
        rest = tuple(n for d, n in enumerate(other[3]) if d != dim)
        if (other[:2] != (name, strides) or other[2] != offset + length * strides[dim]
                or rest != tuple(n for d, n in enumerate(shape) if d != dim)):
            return None
        length += other[3][dim]
    joined = list(shape)
    joined[dim] = length
    return name, strides, offset, tuple(joined)
