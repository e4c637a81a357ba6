"""Writes into a graph's inputs: a static KV cache updated at a decode step's position, a
position counter advanced, a BatchNorm's running statistics.

AOTAutograd hands an inference graph that mutates its inputs over with the mutations in it
(``keep_inference_input_mutations``), and capture's functionalisation leaves a mutation of
an input as ``copy_(input, new_value)`` at the graph's end. Two forms are compiled:

- ``copy_(x, value)``, an eager step after every step that reads ``x``'s old value
  (rewrite/extract.py orders them so);
- an update at a few positions, ``index_put(x, ...)`` / ``index_copy(x, ...)`` copied back
  into ``x`` where nothing else reads ``x``, made the in-place op itself (``reinplaced``):
  it writes those positions only, where the functional form reads and writes the whole
  tensor twice (a decode step's cache: once into a new tensor, once back).

Any other in-place op (one functionalisation could not remove) runs the graph in eager.
Everything that runs a plan on example or checking inputs gives it copies of the written
ones (``written_positions``), and a CUDA graph never copies a written input in.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

# functional update -> the same update in place, for ``reinplaced``
IN_PLACE = {
    aten.index_put.default: aten.index_put_.default,
    aten.index_copy.default: aten.index_copy_.default,
}


def in_place(node: fx.Node) -> bool:
    """Whether ``node`` calls an op that writes one of its arguments (a mutable schema)."""
    return node.op == "call_function" and getattr(getattr(node.target, "_schema", None), "is_mutable", False)


def writes_first_argument(target) -> bool:
    """Whether ``target`` is an op that writes its first argument and nothing else."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return False
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    return written == [0]


def written_input(node: fx.Node) -> fx.Node | None:
    """The placeholder ``node`` writes in place, where it is an op writing only its first
    argument and that is a placeholder; else None."""
    if node.op != "call_function" or not writes_first_argument(node.target):
        return None
    target = node.args[0] if node.args else None
    return target if isinstance(target, fx.Node) and target.op == "placeholder" else None


def written_positions(gm: fx.GraphModule) -> tuple:
    """The positions, among the graph's placeholders, of the inputs it writes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = {written_input(n) for n in gm.graph.nodes} - {None}
    return tuple(i for i, p in enumerate(placeholders) if p in written)


def mutation_problem(gm: fx.GraphModule) -> str | None:
    """Why the graph's in-place ops keep it from compiling, or None: one that writes
    anything but an input, or an input read after a write into it other than through the
    write's result (a graph functionalisation could not rewrite: the plan orders every
    read of an input before its writes)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if in_place(n):
            x = written_input(n)
            if x is None:
                return f"in-place op {n.target} on a value computed in the graph (mutation of inputs only)"
            late = next((u for u in x.users if u is not n and position[u] > position[n]), None)
            if late is not None:
                return f"{late.name} reads input {x.name} after the in-place op {n.name} writes it"
    return None


def reinplaced(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with each ``copy_(x, update(x, ...))`` whose ``update`` is in IN_PLACE, on a
    placeholder ``x`` that nothing else reads, made ``update_(x, ...)``: its readers read
    ``x`` as updated. Changes ``gm`` (the caller's own graph) and returns it."""
    graph, changed = gm.graph, False
    for copy in [n for n in graph.nodes if n.op == "call_function" and n.target is aten.copy_.default]:
        x, value = copy.args[0], copy.args[1]
        if (copy.users or written_input(copy) is None or not isinstance(value, fx.Node)
                or value.target not in IN_PLACE or value.args[0] is not x or set(x.users) != {copy, value}
                or len(copy.args) > 2 or copy.kwargs or not _same_layout(x, value)):
            continue
        with graph.inserting_before(value):
            update = graph.call_function(IN_PLACE[value.target], value.args, value.kwargs)
        update.meta = {**value.meta, "val": x.meta.get("val")}
        graph.erase_node(copy)
        value.replace_all_uses_with(update)
        graph.erase_node(value)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm


def _same_layout(x: fx.Node, value: fx.Node) -> bool:
    """Whether the update's result is laid out as ``x`` (its readers then read ``x`` alike)."""
    a, b = x.meta.get("val"), value.meta.get("val")
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.stride() == b.stride())


def cloned(tensors: list, positions: tuple) -> list:
    """``tensors`` with those at ``positions`` copied: a run that writes them leaves the
    caller's alone."""
    out = list(tensors)
    for i in positions:
        out[i] = strided_copy(out[i])
    return out


def strided_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its strides (kernels are specialised to them)."""
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
