"""Long rows of odd widths padded to whole cache lines.

A buffer whose rows are not a multiple of 16 bytes long leaves every row but the first
unaligned: cuBLAS takes such a matrix only with kernels that load one element at a time
(GPT-2's LM head, a vocabulary of 50257: 3362 us on an H200 against torch.compile's 441),
TMA not at all. So an intermediate buffer with rows of at least ``MIN_ROW`` elements that
are not whole multiples of 16 bytes gets its rows padded to ``ROW_ALIGNMENT`` bytes, as
Inductor's comprehensive padding does; the memory grows by a few percent at most.

Only buffers that kernels alone read and write as laid out: not the graph's inputs or
outputs (eager's strides), not what an eager step reads, not one that a kernel loads
through another view than its own shape. Sized modules (codegen/sized.py) are not padded:
a padded stride is not linear in a size that the rows follow.

A product's operand that the graph is handed with such rows is copied into a padded
buffer first: in a training step the gradient of GPT-2's logits comes from the loss's
graph, [4096 x 50257] bf16 (the copy: 212 us on an H200). One copy per operand, read by
every product that reads it, where it holds at least ``MIN_COPIED`` elements (a smaller
one costs its launch). cuBLAS then takes the products reading it, the odd dim along the
rows (K = 50257 for the input's gradient, M for the weight's) split off (library.odd_dims):
Inductor instead pads that dim with zeros in both operands (``pad_mm``), a second copy.

A product the graph returns is written in eager's layout, so its rows stay odd however
the intermediates are padded: GPT-2's LM head ([4096 x 768] @ [768 x 50257], the logits
returned) ran as a generated kernel, about 600 us on an H200 against torch.compile's 548,
which returns the logits with rows 50264 apart. Such an output is returned with padded
rows too where that makes its product a cuBLAS call (``padded_product_outputs``), its odd
N split off: the values are eager's, the strides are not (as torch.compile's are not).
Only an output returned as itself, never as a view of another.
"""

from __future__ import annotations

from ..schema import ops
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
from .kmajor import fresh_buffer_name
from .library import ALIGNMENT, library_call  # ALIGNMENT: bytes cuBLAS's vectorised kernels and TMA need of a stride
from .schedules import base_read

ROW_ALIGNMENT = 128  # bytes: a row starting a cache line, as Inductor pads
MIN_ROW = 1024  # elements: shorter rows keep their width (padding would cost more than it gives)
MIN_COPIED = 1 << 20  # elements: a product's unaligned operand smaller than this is read as it is
COPY_SUFFIX = "_aligned"


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
    shut = returned_buffers(plan) | eager_reads(plan)
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


def padded_product_outputs(plan: Plan) -> None:
    """Rewrite ``plan`` in place: each graph output with long unaligned rows that one
    kernel writes, a product cuBLAS would take but for those rows, gets padded rows (the
    module docstring's last paragraph). Running it again changes nothing."""
    returned = {value for kind, value in plan.outputs if kind == "buffer"}
    shut = eager_reads(plan) | {value.buf for kind, value in plan.outputs if kind == "view"}
    writers = kernel_writers(plan)
    for name in sorted(returned - shut):
        b = plan.buffers[name]
        strides = padded_strides(tuple(b.shape), ops.itemsize(b.dtype)) if b.dtype in ops.DTYPES else None
        if (strides is None or tuple(b.layout) != contiguous_strides(tuple(b.shape))
                or len(writers.get(name, ())) != 1 or _loaded(plan, name)):
            continue
        writer = writers[name][0]
        if library_call(writer, plan.buffers) is not None:
            continue
        b.strides, was = strides, b.strides
        if library_call(writer, plan.buffers) is None:
            b.strides = was


def _loaded(plan: Plan, name: str) -> bool:
    return any(n.op == "load" and n.attrs[0] == name for spec in plan.kernels for n in spec.walk())


def stored_order(load: PNode) -> tuple:
    """The load's dims from the largest stride to the smallest: the order it is stored in
    (a transposed read of a row-major buffer has it reversed)."""
    strides = load.attrs[1]
    return tuple(sorted(range(len(strides)), key=lambda d: -strides[d]))


def unaligned(shape: tuple, strides: tuple, offset: int, dtype: str) -> bool:
    """Whether a read of ``shape`` at ``strides`` (in stored order: unit stride last) reads
    long rows whose other strides are not whole multiples of 16 bytes, every element once."""
    itemsize = ops.itemsize(dtype)
    if len(shape) < 2 or strides[-1] != 1 or shape[-1] < MIN_ROW or 0 in strides:
        return False
    return any((s * itemsize) % ALIGNMENT for s, n in zip(strides[:-1], shape[:-1]) if n > 1) \
        or (offset * itemsize) % ALIGNMENT != 0


def aligned_operands(plan: Plan) -> None:
    """Rewrite ``plan`` in place: each large operand of a product that is a plain read of
    unaligned rows (``unaligned``, in the order the rows are stored: a transposed read
    too) is copied into a padded buffer by a kernel of its own, before the first kernel
    reading it, and the products read the copy. Running it again changes nothing (the
    copies' rows are aligned)."""
    wanted: dict[tuple, list] = {}  # the stored read (buffer, shape, strides, offset) -> [(kernel, load, order)]
    for spec in plan.kernels:
        for dot in (n for n in spec.walk() if n.op == "dot"):
            for operand in dot.args:
                load = base_read(operand)
                if load.op != "load" or load.numel < MIN_COPIED:
                    continue
                order = stored_order(load)
                buf, strides, offset = load.attrs
                shape, strides = tuple(load.shape[d] for d in order), tuple(strides[d] for d in order)
                if unaligned(shape, strides, offset, load.dtype):
                    wanted.setdefault((buf, shape, strides, offset), []).append((spec, load, order))
    if not wanted:
        return
    copies: dict[int, list] = {}  # the first kernel reading an operand -> the copies placed before it
    reads: dict[int, dict] = {}  # kernel id -> {id(load): the load of the copy}
    for n, ((buf, shape, strides, offset), users) in enumerate(wanted.items()):
        first, load, _ = users[0]
        dtype = load.dtype
        name = fresh_buffer_name(f"buf_{buf}{COPY_SUFFIX}", plan.buffers)
        # rows of a whole number of 16 bytes read at unaligned strides (a slice): the copy is contiguous
        padded = padded_strides(shape, ops.itemsize(dtype)) or contiguous_strides(shape)
        plan.buffers[name] = Buffer(name, shape, dtype, "temp", padded)
        stored = PNode("load", (buf, strides, offset), (), shape, dtype)
        copies.setdefault(id(first), []).append(
            KernelSpec(f"{first.name}{COPY_SUFFIX}{n or ''}", [(stored, name)], list(first.fx_nodes)))
        for spec, load, order in users:
            view = [0] * len(order)
            for i, d in enumerate(order):
                view[d] = padded[i]
            reads.setdefault(id(spec), {})[id(load)] = PNode("load", (name, tuple(view), 0), (), load.shape,
                                                             dtype, load.eclass)
    steps = []
    for step in plan.steps:
        steps += copies.get(id(step), [])
        if id(step) in reads:
            step.roots = [(substitute(root, reads[id(step)]), out) for root, out in step.roots]
        steps.append(step)
    plan.steps[:] = steps
