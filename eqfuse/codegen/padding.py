"""Long rows of odd widths padded to whole cache lines.

A buffer whose rows are not a multiple of 16 bytes long leaves every row but the first
unaligned: cuBLAS takes such a matrix only with kernels that load one element at a time,
TMA not at all. GPT-2's vocabulary of 50257 does this to the gradient of its logits
([4096 x 50257] bf16): the two products reading it ran as Triton kernels of 1598 and 1112
us, against cuBLAS's 377-446 in torch.compile, which pads the rows (H200, training step,
docs/zoo.md). So an intermediate buffer with rows of at least ``MIN_ROW`` elements that
are not whole multiples of 16 bytes gets its rows padded to ``ROW_ALIGNMENT`` bytes, as
Inductor's comprehensive padding does; the memory grows by a few percent at most.

Only buffers that kernels alone read and write as laid out: not the graph's inputs or
outputs (eager's strides), not what an eager step reads, not one that a kernel loads
through another view than its own shape. Sized modules (codegen/sized.py) are not padded:
a padded stride is not linear in a size that the rows follow.
"""

from __future__ import annotations

from ..schema import ops
from ..schema.plan import KernelSpec, Plan, PNode, contiguous_strides, returned_buffers, step_reads, substitute

ALIGNMENT = 16  # bytes: what cuBLAS's vectorised kernels and TMA need of a row stride
ROW_ALIGNMENT = 128  # bytes: a row starting a cache line, as Inductor pads
MIN_ROW = 1024  # elements: shorter rows keep their width (padding would cost more than it gives)


def padded_strides(shape: tuple, itemsize: int) -> tuple | None:
    """Contiguous strides of ``shape`` with its rows padded, or None where they need none."""
    if len(shape) < 2 or shape[-1] < MIN_ROW or (shape[-1] * itemsize) % ALIGNMENT == 0:
        return None
    per_line = ROW_ALIGNMENT // itemsize
    row = -(-shape[-1] // per_line) * per_line
    return contiguous_strides((*shape[:-1], row))[:-1] + (1,)


def pad_rows(plan: Plan) -> None:
    """Rewrite ``plan`` in place: the intermediate buffers described above get padded
    rows, and the kernels' loads of them read them so. Running it again changes nothing."""
    shut = set(returned_buffers(plan))
    for step in plan.steps:
        if not isinstance(step, KernelSpec):
            shut |= step_reads(step)
    candidates = {}
    for name, b in plan.buffers.items():
        if b.kind == "temp" and b.strides is None and name not in shut and b.dtype in ops.DTYPES:
            strides = padded_strides(tuple(b.shape), ops.itemsize(b.dtype))
            if strides is not None:
                candidates[name] = strides
    loads = [(spec, n) for spec in plan.kernels for n in spec.walk() if n.op == "load" and n.attrs[0] in candidates]
    for _, n in loads:  # read through another view than its own: left as it is
        b = plan.buffers[n.attrs[0]]
        if (tuple(n.shape), tuple(n.attrs[1]), n.attrs[2]) != (tuple(b.shape), contiguous_strides(tuple(b.shape)), 0):
            candidates.pop(b.name, None)
    for name, strides in candidates.items():
        plan.buffers[name].strides = strides
    for spec in {id(spec): spec for spec, _ in loads}.values():
        new = {id(n): PNode("load", (n.attrs[0], candidates[n.attrs[0]], 0), (), n.shape, n.dtype, n.eclass)
               for n in spec.walk() if n.op == "load" and n.attrs[0] in candidates}
        if new:
            spec.roots = [(substitute(root, new), out) for root, out in spec.roots]
