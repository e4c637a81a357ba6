"""Buffers stored in the dtype their readers cast them to.

Extraction cuts a kernel where the cost model says, and the value it stores there is an
e-class's, whatever casts its readers apply: a training step's SwiGLU backward computes
the gate's gradient in float32 and stores it so, and both products that read it (the
input's gradient, the weight's) cast it to bfloat16 as it loads. Stored so, the buffer
costs twice its bytes, and the products, whose operand is then computed from a read, can
be neither cuBLAS calls (codegen/library.py) nor TMA loads: Qwen2's took 330 us a layer
generated against about 170 for cuBLAS (an H200, torch.profiler, the zoo's training step).

A temp buffer that every reader loads only to cast to one narrower float dtype is stored
in that dtype instead: the writer casts its value before the store, the readers load it
as it is. Rounding once at the store is rounding once at each load, bit for bit: the
values are the same.
"""

from __future__ import annotations

from ..schema import ops
from ..schema.plan import Plan, PNode, eager_reads, kernel_writers, returned_buffers, substitute

INDEX_MAPS = ("reshape", "permute")  # above a value: the cast goes under them, on the value itself


def narrow_stores(plan: Plan) -> None:
    """Rewrite ``plan`` in place as the module docstring says. Running it again changes
    nothing (the narrowed buffers' readers no longer cast)."""
    shut = returned_buffers(plan) | eager_reads(plan)
    writers = kernel_writers(plan)
    casts = _casts_of_loads(plan.kernels)
    for name, (dtype, reading) in casts.items():
        buffer = plan.buffers[name]
        if name in shut or buffer.kind != "temp" or len(writers.get(name, ())) != 1 or dtype is None:
            continue
        if not (ops.is_float(buffer.dtype) and ops.is_float(dtype)
                and ops.itemsize(dtype) < ops.itemsize(buffer.dtype)):
            continue
        writer = writers[name][0]
        writer.roots = [(_cast_under_index_maps(root, dtype) if out == name else root, out)
                        for root, out in writer.roots]
        buffer.dtype = dtype
        for spec, nodes in reading:
            new = {id(cast): PNode("load", load.attrs, (), load.shape, dtype, cast.eclass) for cast, load in nodes}
            spec.roots = [(substitute(root, new), out) for root, out in spec.roots]


def _casts_of_loads(kernels: list) -> dict:
    """buffer -> (the dtype every load of it is cast to, or None where some load is used
    otherwise or casts differ; [(kernel, [(cast node, load node)])])."""
    found: dict[str, list] = {}
    for spec in kernels:
        roots = {id(root) for root, _ in spec.roots}
        mine: dict[str, list] = {}
        for node in spec.walk():
            if node.op == "load" and id(node) in roots:
                found.setdefault(node.attrs[0], ["?", []])[0] = None  # stored as loaded: the value itself is wanted
            for arg in node.args:
                if arg.op != "load":
                    continue
                entry = found.setdefault(arg.attrs[0], ["?", []])
                target = node.attrs[0] if node.op == "cast" else None
                entry[0] = target if entry[0] in ("?", target) else None
                mine.setdefault(arg.attrs[0], []).append((node, arg))
        for name, nodes in mine.items():
            found[name][1].append((spec, nodes))
    return {name: (None if dtype == "?" else dtype, reading) for name, (dtype, reading) in found.items()}


def _cast_under_index_maps(root: PNode, dtype: str) -> PNode:
    """``root`` with its value cast to ``dtype`` below the reshapes and permutes on top; a
    value that was itself widened from ``dtype`` (exactly) is taken as it was."""
    if root.op in INDEX_MAPS:
        inner = _cast_under_index_maps(root.args[0], dtype)
        return PNode(root.op, root.attrs, (inner,), root.shape, dtype, root.eclass)
    if root.op == "cast" and root.args[0].dtype == dtype:
        return root.args[0]
    return PNode("cast", (dtype,), (root,), root.shape, dtype)
