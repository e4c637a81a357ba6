"""Buffers stored in the order the products reading them want.

A kernel stores its value in the order of its shape, whatever order its readers read it
in. A training step's attention backward gives the gradients of q, k and v as
[batch, heads, seq, head dim], and the kernel applying RoPE's backward to them stores
them so; the products after it (the projections' input gradient, their weights'
gradients) read them as [batch * seq, heads * head dim], which no strides of a
[batch, heads, seq, head dim] row-major buffer express. So the products read them
through index arithmetic as generated kernels, where cuBLAS would take them as they are
stored in [batch, seq, heads, head dim] order (Llama-3.2-1B's training step: ten such
products a layer).

A temp buffer that a product reads through a permute gets the strides of that permute's
order where that makes more of the kernels reading or writing it cuBLAS calls
(codegen/library.py), as Inductor fixes a buffer's layout to the stride order its
consumer requires. The unit-stride dim stays the last, so the writer and the other
readers touch the memory in the same runs as before. Only buffers that kernels alone
read and write, each load of them reading the whole buffer as its shape lays it out (as
codegen/padding.py pads rows). The values are the same; only where they lie changes.
"""

from __future__ import annotations

from ..schema import ops
from ..schema.plan import (
    KernelSpec,
    Plan,
    PNode,
    contiguous_strides,
    eager_reads,
    kernel_writers,
    returned_buffers,
    substitute,
)
from .library import library_call

KEEP_RANK = ("slice",)  # between a load and the permute above it: the dims are still the buffer's


def order_stores(plan: Plan) -> None:
    """Rewrite ``plan`` in place as the module docstring says. Running it again changes
    nothing (the buffers it orders have strides, and it leaves such buffers alone)."""
    shut = returned_buffers(plan) | eager_reads(plan)
    writers = kernel_writers(plan)
    loads: dict[str, list] = {}  # buffer -> [(kernel, load)]
    for spec in plan.kernels:
        for node in spec.walk():
            if node.op == "load":
                loads.setdefault(node.attrs[0], []).append((spec, node))
    for name, orders in _orders_products_read(plan.kernels).items():
        b = plan.buffers[name]
        if (b.kind != "temp" or b.strides is not None or name in shut or len(writers.get(name, ())) != 1
                or b.dtype not in ops.DTYPES or not _whole_reads(b, loads[name])):
            continue
        for order in orders:
            if _ordered_if_better(plan, name, order, loads[name], writers[name][0]):
                break


def _orders_products_read(kernels: list) -> dict:
    """buffer -> the orders (permutes of all its dims, the last kept last) that products'
    operands read it in, first met first."""
    found: dict[str, list] = {}
    for spec in kernels:
        for dot in (n for n in spec.walk() if n.op == "dot"):
            for operand in dot.args:
                order = _read_order(operand)
                if order is not None:
                    buf, perm = order
                    if perm not in found.setdefault(buf, []):
                        found[buf].append(perm)
    return found


def _read_order(operand: PNode) -> tuple | None:
    """(buffer, permute) where ``operand`` reads a buffer through index maps whose first
    permute above the load (past slices only) keeps the last dim last."""
    chain = []
    node = operand
    while node.op in ("reshape", "permute", "slice", "broadcast"):
        chain.append(node)
        node = node.args[0]
    if node.op != "load":
        return None
    for above in reversed(chain):
        if above.op == "permute":
            perm = tuple(above.attrs[0])
            if perm[-1] == len(perm) - 1 and perm != tuple(range(len(perm))):
                return node.attrs[0], perm
            return None
        if above.op not in KEEP_RANK:
            return None
    return None


def _whole_reads(buffer, reads: list) -> bool:
    layout = (tuple(buffer.shape), contiguous_strides(tuple(buffer.shape)), 0)
    return all((tuple(n.shape), tuple(n.attrs[1]), n.attrs[2]) == layout for _, n in reads)


def permuted_strides(shape: tuple, perm: tuple) -> tuple:
    """Strides of ``shape`` under which ``permute(perm)`` of it is contiguous."""
    inner = contiguous_strides(tuple(shape[d] for d in perm))
    strides = [0] * len(shape)
    for i, d in enumerate(perm):
        strides[d] = inner[i]
    return tuple(strides)


def _ordered_if_better(plan: Plan, name: str, perm: tuple, reads: list, writer: KernelSpec) -> bool:
    """Store ``name`` in ``perm``'s order where more of the kernels touching it are then
    library calls; else leave it as it was. Whether it was stored so."""
    buffer = plan.buffers[name]
    specs = list({id(s): s for s in [writer] + [spec for spec, _ in reads]}.values())
    was = [list(spec.roots) for spec in specs]
    before = sum(library_call(spec, plan.buffers) is not None for spec in specs)
    strides = permuted_strides(tuple(buffer.shape), perm)
    buffer.strides = strides
    for spec in specs:
        new = {id(n): PNode("load", (name, strides, 0), (), n.shape, n.dtype, n.eclass)
               for n in spec.walk() if n.op == "load" and n.attrs[0] == name}
        if new:
            spec.roots = [(substitute(root, new), out) for root, out in spec.roots]
    if sum(library_call(spec, plan.buffers) is not None for spec in specs) > before:
        return True
    buffer.strides = None
    for spec, roots in zip(specs, was):
        spec.roots = roots
    return False
