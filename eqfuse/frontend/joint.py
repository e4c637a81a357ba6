"""Rewrites of AOTAutograd's joint graph (forward and backward together) before it is
partitioned into the two graphs eqfuse compiles.

What the backward reads of the forward is saved between them: written by the forward,
held in memory until the backward, read again. AOTAutograd's default partitioner saves
each forward value the backward reads, as it is. For a log-softmax that is its output:
the input's size, in float32 where the model upcasts (cross-entropy over a vocabulary:
transformers computes it on ``logits.float()``; Llama-3.2's 4096 tokens x 128256 make it
2.1 GB written and read again, twice the bf16 logits). Its backward needs no more than
the input and two numbers per row, the max and the log of the sum of exponentials, from
which the output is recomputed exactly as the forward computed it. So:

    out = _log_softmax(x, dim)
        ->  m = amax(x, dim);  shifted = x - m;  lse = log(sum(exp(shifted), dim));  out = shifted - lse

in the forward, and the backward's ``out`` becomes ``(x' - m) - lse``, where ``x'`` is
``x`` recomputed from the narrowest tensor it is a view or a widening cast of (the bf16
logits, which the model returns anyway). What is saved is then that tensor and two
columns. The values are the same: both sides round as the forward did.
"""

from __future__ import annotations

import torch
from torch.fx.passes.shape_prop import _extract_tensor_metadata

aten = torch.ops.aten

# Ops that re-derive a tensor from a narrower or equal one without computing: a backward
# recomputes them rather than reading a saved copy.
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
          aten.slice.Tensor, aten.select.int, aten.t.default, aten.transpose.int, aten.permute.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.clone.default}
_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def recompute_log_softmax(joint: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``joint`` with each log-softmax that its backward reads rewritten as the module
    docstring says; changed in place and returned."""
    graph = joint.graph
    backward = _backward_nodes(graph)
    changed = False
    for out in [n for n in graph.nodes if n.target is aten._log_softmax.default and not n.args[2]]:
        # (half_to_float: an output wider than its input, left as traced)
        aliases = _detached(out)
        readers = [u for a in aliases for u in a.users if u in backward and u not in aliases]
        if not readers:
            continue
        x, dim = out.args[0], out.args[1]
        with graph.inserting_after(out):
            m = _call(graph, aten.amax.default, x, [dim], True)
        with graph.inserting_after(m):
            shifted = _call(graph, aten.sub.Tensor, x, m)
        with graph.inserting_after(shifted):
            exps = _call(graph, aten.exp.default, shifted)
        with graph.inserting_after(exps):
            total = _call(graph, aten.sum.dim_IntList, exps, [dim], True)
        with graph.inserting_after(total):
            lse = _call(graph, aten.log.default, total)
        with graph.inserting_after(lse):
            forward_out = _call(graph, aten.sub.Tensor, shifted, lse)
        first = min(readers, key=_position(graph))
        with graph.inserting_before(first):
            again = _rederived(graph, x)
            backward_out = _call(graph, aten.sub.Tensor, _call(graph, aten.sub.Tensor, again, m), lse)
        for reader in readers:
            for a in aliases:
                reader.replace_input_with(a, backward_out)
        out.replace_all_uses_with(forward_out)
        graph.erase_node(out)
        changed = True
    if changed:
        graph.eliminate_dead_code()
        graph.lint()
        joint.recompile()
    return joint


def _backward_nodes(graph: torch.fx.Graph) -> set:
    """The nodes that depend on a tangent (the backward's)."""
    found: set = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and "tangents" in str(n.target)) or any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def _detached(node: torch.fx.Node) -> list:
    """``node`` and the detaches of it (AOTAutograd passes saved values through them)."""
    out = [node]
    for n in out:
        out += [u for u in n.users if u.target is aten.detach.default and u not in out]
    return out


def _position(graph: torch.fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _rederived(graph: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
    """``x`` computed anew (before the insertion point) from the first tensor down its
    chain of views and widening casts that is neither: that one is what gets saved."""
    if x.target in _VIEWS or (x.target in _CASTS and _widens(x)):
        source = _rederived(graph, x.args[0])
        args = (source, *x.args[1:])
        return _call(graph, x.target, *args, **x.kwargs)
    return x


def _widens(cast: torch.fx.Node) -> bool:
    src, out = cast.args[0].meta.get("val"), cast.meta.get("val")
    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    return (src.dtype.is_floating_point and out.dtype.is_floating_point and src.device == out.device
            and torch.finfo(src.dtype).bits <= torch.finfo(out.dtype).bits)


def _call(graph: torch.fx.Graph, target, *args, **kwargs) -> torch.fx.Node:
    """A new node with the value metadata the partitioner reads, computed on the fake
    values of its arguments."""
    node = graph.call_function(target, args, kwargs)
    fake = [a.meta["val"] for a in node.all_input_nodes]
    mode = torch._guards.detect_fake_mode(fake)

    def value(a):
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a
    with mode:
        val = target(*torch.fx.node.map_aggregate(args, value), **torch.fx.node.map_aggregate(kwargs, value))
    node.meta["val"] = val
    node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    return node
