"""Identical layers found in a graph, so that they are compiled once.

A transformer's layers are one subgraph repeated with other weights: the same ops on the
same shapes, each layer reading the one before it and values made once before the first
(the rotary tables, the mask). Compiled whole, the e-graph, the extraction and the code
grow with the depth: a tiny Llama compiled in 1.2 s with 2 layers and 6.1 s with 8 (its
extraction 0.35 and 4.6 s; docs/compile-time.md). Split into its layers, the graph is a
prefix, k blocks of one structure and a suffix: each block is compiled on its own, and
the blocks after the first take the first one's plan (pipeline.shared_plans).

``layers(gm)`` finds the longest run of equal blocks (``MIN_BLOCKS`` of them at least):
the period of the sequence of the graph's nodes (each an op, its literal arguments, and
the shape, dtype and strides of its value) that covers the most nodes, at least
``MIN_BLOCK`` nodes a block, each block holding a matrix product (a repeat without one
is a pattern inside a layer, a chain of pointwise ops best fused whole), and then the
same in what comes before and after that run (an encoder's layers and a decoder's: two
runs). Among the rotations of the period, blocks start where the fewest values cross
from one block into the next (a residual stream, not the middle of an attention). Every
block must then be wired as the first one is: the same edges inside it, and the values
it reads from outside in the same order with the same metadata. Each part becomes a
GraphModule of its own, its inputs and nodes named by position, so that equal blocks are
equal graphs.

A value made before the blocks from no input at all (a causal mask from ``arange``s, a
position bias) is computed again inside each block rather than passed to it: passed, it
is a tensor the attention must load; computed in the block, the rules see the ``iota``
comparison it is, and the attention skips the tiles it masks out (GPT-2's layers ran 10%
slower on an H200 with the mask passed in).

What a cut costs at run time: the values crossing a block's boundary are stored and read
once more, and no kernel fuses across it (a residual add with the next layer's norm).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx

MIN_BLOCK = 24  # nodes
# Blocks, at least: two layers compile whole. The cuts cost little where they fall (a
# layer's residual is stored either way: on an H200, models of 4 layers ran in parts
# within 1% of whole, docs/compile-time.md), but each part records a CUDA graph of its
# own; from three layers on, compile time is what depth costs.
MIN_BLOCKS = 3
RECOMPUTED_NODES = 64  # at most, in the cone of a value that each block computes again
PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "convolution", "_grouped_mm"}


@dataclass
class Part:
    gm: fx.GraphModule
    inputs: list  # the original graph's nodes it reads, in the order of its placeholders
    outputs: list  # the original graph's nodes it returns, in order
    block: int | None  # which of its run's repeated blocks it is; None for the parts around the runs
    run: int | None = None  # which run of repeated blocks (an encoder's layers, a decoder's) it belongs to


def layers(gm: fx.GraphModule) -> list[Part] | None:
    """The graph as its runs of repeated blocks and the parts before, between and after
    them, or None where it repeats no block as the module docstring says."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]  # the others read these
    if len(nodes) < 2 * MIN_BLOCK or any(n.op != "call_function" for n in nodes):
        return None
    position = {n: i for i, n in enumerate(nodes)}
    runs = []
    for period, first, last in _periods(nodes, 0, len(nodes)):  # positions [first, last) repeat with period
        count = (last - first) // period
        start = _quietest_start(nodes, position, first, last - count * period)
        spans = [(start + i * period, start + (i + 1) * period) for i in range(count)]
        if _wired_alike(nodes, position, spans):
            runs.append(spans)
    return _parts(gm, nodes, position, runs) if runs else None


def _periods(nodes: list, lo: int, hi: int) -> list:
    """The runs of ``_period`` in nodes[lo:hi], in order: the one covering the most nodes,
    then those before it and after it (an encoder's layers and a decoder's)."""
    found = _period(nodes[lo:hi])
    if found is None:
        return []
    period, first, last = found
    return _periods(nodes, lo, lo + first) + [(period, lo + first, lo + last)] + _periods(nodes, lo + last, hi)


def _token(n: fx.Node) -> tuple:
    """What two nodes at the same place of two equal blocks have in common."""
    literals = []
    fx.node.map_aggregate((n.args, n.kwargs), lambda a: literals.append(None if isinstance(a, fx.Node) else repr(a)))
    return (str(n.target), tuple(literals), tuple(sorted(n.kwargs)), _meta(n))


def _op_name(n: fx.Node) -> str:
    """An ATen op's name without its overload (``mm`` for ``aten.mm.default``)."""
    return getattr(n.target, "_opname", None) or getattr(n.target, "__name__", "")


def _meta(n: fx.Node) -> tuple:
    return _meta_of(n.meta.get("val"))


def _meta_of(val) -> tuple:
    """A value's shape, dtype, strides and device (each of a list's, or its type's name)."""
    if isinstance(val, torch.Tensor):
        strides = tuple(val.stride()) if val.layout == torch.strided else str(val.layout)
        return tuple(val.shape), str(val.dtype), strides, val.device.type
    if isinstance(val, (list, tuple)):
        return tuple(_meta_of(v) for v in val)
    return (type(val).__name__,)


def _period(nodes: list) -> tuple | None:
    """(period, first, last): the run of positions [first, last), MIN_BLOCKS periods long
    at least, where each token equals the one a period later, covering the most nodes
    (the shortest period among equals); periods of at least MIN_BLOCK nodes whose blocks
    hold a product. None where there is none."""
    ids: dict = {}
    seq = np.array([ids.setdefault(_token(n), len(ids)) for n in nodes])
    products = np.array([_op_name(n) in PRODUCTS for n in nodes])
    best = None
    n = len(nodes)
    for period in range(MIN_BLOCK, n // 2 + 1):
        same = np.concatenate([[False], seq[:-period] == seq[period:], [False]])
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        for begin, end in zip(edges[::2], edges[1::2]):  # positions i in [begin, end) equal i + period
            count = (end - begin) // period + 1
            if count < MIN_BLOCKS:
                continue
            covered = count * period
            if best is None or covered > best[0]:
                if products[begin:begin + period].any():
                    best = (covered, period, int(begin), int(end) + period)
    return None if best is None else best[1:]


def _quietest_start(nodes: list, position: dict, lo: int, hi: int) -> int:
    """The start in [lo, hi] of the first block where the fewest values computed before it
    are read at or after it (the others follow a period apart)."""
    live = np.zeros(len(nodes) + 2, dtype=np.int64)
    for i, n in enumerate(nodes):
        uses = [position.get(u, len(nodes)) for u in n.users]
        if uses:
            live[i + 1] += 1
            live[max(uses) + 1] -= 1
    crossing = np.cumsum(live)  # crossing[c]: values made before c and read at c or later
    return min(range(lo, hi + 1), key=lambda c: (crossing[c], c))


def _reads(n: fx.Node) -> list:
    found = []
    fx.node.map_arg((n.args, n.kwargs), found.append)
    return found


def _wired_alike(nodes: list, position: dict, spans: list) -> bool:
    """Whether every block has the first one's edges inside it, and reads values from
    outside it in the same order, of the same metadata."""
    def wiring(lo, hi):
        outside: dict = {}
        edges = []
        for n in nodes[lo:hi]:
            for a in _reads(n):
                p = position.get(a)
                if p is not None and lo <= p < hi:
                    edges.append(("in", p - lo))
                else:
                    edges.append(("out", outside.setdefault(a, len(outside))))
        return edges, [_meta(a) for a in outside]
    first = wiring(*spans[0])
    return all(wiring(lo, hi) == first for lo, hi in spans[1:])


def _parts(gm: fx.GraphModule, nodes: list, position: dict, runs: list) -> list[Part]:
    """The parts around the runs and the runs' blocks as GraphModules, each returning what
    the parts after it (or the graph's output) read of it; the blocks of a run return the
    same places of themselves, so that their graphs are equal."""
    segments, at = [], 0  # (lo, hi, run, block)
    for r, spans in enumerate(runs):
        segments += [(at, spans[0][0], None, None)] + [(lo, hi, r, i) for i, (lo, hi) in enumerate(spans)]
        at = spans[-1][1]
    segments.append((at, len(nodes), None, None))
    leaving: list = [set() for _ in runs]  # per run, the places in a block of the values read after it
    for lo, hi, r, _ in segments:
        if r is not None:
            leaving[r].update(position[n] - lo for n in nodes[lo:hi]
                              if any(position.get(u, len(nodes)) >= hi for u in n.users))
    in_blocks = {n for lo, hi, r, _ in segments if r is not None for n in nodes[lo:hi]}
    recomputed = _made_from_nothing([n for n in nodes if n not in in_blocks])
    parts = []
    for lo, hi, r, block in segments:
        members = nodes[lo:hi]
        if r is not None:
            outputs = [n for i, n in enumerate(members) if i in leaving[r]]
            members = _cones(members, recomputed, position) + members
        else:
            outputs = [n for n in members if any(position.get(u, len(nodes)) >= hi
                                                 and not (n in recomputed and u in in_blocks) for u in n.users)]
            members = _needed(members, outputs)
        if not members:
            continue
        inside = set(members)
        inputs = {a: None for n in members for a in _reads(n) if a not in inside}
        part = _module(gm, members, list(inputs), outputs)
        where = "a block" if r is not None else "before its blocks" if lo == 0 else \
            "after its blocks" if hi == len(nodes) else "between its blocks"
        part.__name__ = f"{getattr(gm, '__name__', 'graph')}, {where}"  # equal for equal blocks: a plan key holds it
        parts.append(Part(part, list(inputs), outputs, block, r))
    return parts


def _made_from_nothing(prefix: list) -> set:
    """The prefix's nodes computed from no input (no placeholder, no attribute, no random
    draw), their cones at most RECOMPUTED_NODES nodes and free of products."""
    cone: dict = {}  # node -> its ancestors in the prefix (itself included), or None
    for n in prefix:
        reads = _reads(n)
        pure = (n.op == "call_function" and _op_name(n) not in PRODUCTS
                and not getattr(n.target, "_nondeterministic_seeded", False)
                and all(cone.get(a) is not None for a in reads))
        ancestors = {n}.union(*(cone[a] for a in reads)) if pure else None
        cone[n] = ancestors if ancestors is not None and len(ancestors) <= RECOMPUTED_NODES else None
    return {n for n, c in cone.items() if c is not None}


def _cones(members: list, recomputed: set, position: dict) -> list:
    """The recomputed nodes that ``members`` read, with what they read, in graph order."""
    found: set = set()
    todo = [a for n in members for a in _reads(n) if a in recomputed]
    while todo:
        a = todo.pop()
        if a not in found:
            found.add(a)
            todo.extend(_reads(a))
    return sorted(found, key=position.__getitem__)


def _needed(members: list, outputs: list) -> list:
    """The members that ``outputs`` depend on (or that have effects), in order."""
    kept = set(outputs)
    for n in reversed(members):
        if n in kept or n.is_impure():
            kept.add(n)
            kept.update(_reads(n))
    return [n for n in members if n in kept]


def _module(gm: fx.GraphModule, members: list, inputs: list, outputs: list) -> fx.GraphModule:
    """``members`` as a graph of their own, reading ``inputs`` as its placeholders and
    returning ``outputs``; every name by position (equal blocks, equal code)."""
    graph = fx.Graph()
    env = {}
    for i, a in enumerate(inputs):
        env[a] = graph.placeholder(f"x{i}")
        env[a].meta = dict(a.meta)
    for i, n in enumerate(members):
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
        env[n] = graph.create_node(n.op, n.target, args, kwargs, name=f"v{i}")
        env[n].meta = dict(n.meta)
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, graph)
