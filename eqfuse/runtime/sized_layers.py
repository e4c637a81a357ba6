"""A graph with one dynamic size and repeated layers: a sized module per part, each
layer's made once.

A decoder's step at a new cache length (runtime/sized_graph.py) compiled whole makes a
plan of the whole graph at three sizes or four: its extraction grows with the depth (a
Llama of 4 layers at published widths on an H200: 27 s of a first ``generate()``'s 53).
Where the first size compiled in parts (runtime/layered.py), the sized graph is made in
the same parts: the graph is traced at each size the sized modules are made from and cut
where the first build cut it, and each part before, between and after the runs of
blocks, and the first block of each run, gets a sized module of its own (the other
blocks of the run take the first one's), or, where nothing it reads follows the size,
keeps the first build's compiled part. The parts run in turn as the first build's do.
"""

from __future__ import annotations

import re
import time

import torch

from .sized_graph import OneSize, SizedGraph, sized_graph


class SizedLayers:
    """``call_boxed(tensors)`` at any size ``accepts`` takes, the parts in turn (a
    LayeredGraph whose parts are sized graphs)."""

    def __init__(self, step: OneSize, runner, max_size: int, tf32: bool):
        self.runner = runner  # a LayeredGraph
        self.exact_layouts = step.layouts  # from the symbolic shapes (slow: sympy)
        self.layouts = _linear_layouts(step) or step.layouts
        self.size_input = step.size_input()  # checked before the build
        self.max_size = max_size
        self.tf32 = tf32
        self.seconds = 0.0  # to build it

    def accepts(self, tensors: list) -> bool:
        """As SizedGraph.accepts: the graph's inputs laid out as they are at their size,
        within the bound of every part, with TF32 as it was built."""
        if torch._C._get_cublas_allow_tf32() != self.tf32:
            return False
        i, d, offset = self.size_input
        if i >= len(tensors) or tensors[i].dim() <= d:
            return False
        size = tensors[i].shape[d] - offset
        if not 1 <= size <= self.max_size:
            return False
        return [(tuple(t.shape), t.stride()) for t in tensors] == self.layouts(size)

    def call_boxed(self, tensors: list):
        return self.runner.call_boxed(tensors)


def _linear_layouts(step: OneSize):
    """``step.layouts`` as a function whose every number is ``a + b * size`` (as a
    decoder's caches' shapes and strides are), where the layouts at three sizes show it;
    None otherwise. ``accepts`` runs at every new size, a decode step at every token:
    sympy's substitution into each symbolic shape and stride took 3-5 ms a call on the
    development machine (tiny Llama, 4 layers). A number that is not of that form at
    some size only makes a call there compile on its own: its inputs' layouts do not
    match the expected ones."""
    v, far = step.value, 2 * step.value + 3
    samples = [step.layouts(s) for s in (v, v + 1, far)]
    flat = [[n for shape, stride in layout for n in (*shape, *stride)] for layout in samples]
    coefficients = []
    for at_v, at_next, at_far in zip(*flat):
        b = at_next - at_v
        if at_v + b * (far - v) != at_far:
            return None
        coefficients.append((at_v - b * v, b))
    ranks = [len(shape) for shape, _ in samples[0]]

    def layouts(size: int) -> list:
        numbers = iter([a + b * size for a, b in coefficients])
        return [(tuple(next(numbers) for _ in range(r)), tuple(next(numbers) for _ in range(r))) for r in ranks]
    return layouts


def build(fn_at, example_inputs, first: dict, sizes, tensors: list, options, layered) -> SizedLayers:
    """As sized_graph.build, for a graph whose first size compiled as ``layered`` (a
    LayeredGraph); NotSized/EqfuseError where the parts are not found alike at every
    size or a part has no sized module."""
    from ..codegen.sized import NotSized
    from ..frontend.repeats import layers
    from ..pipeline import plan_only
    from .layered import LayeredGraph, _attributes, part_inputs, traced

    start = time.perf_counter()
    step = OneSize(example_inputs, first, sizes, tensors)
    step.size_input()  # before any work: NotSized where no input's dimension holds the size
    cut: dict = {}  # size -> (graph, its parts, their inputs' examples)

    def parts_at(size):
        # the parts alike at every size, in the first build's order of blocks and runs
        # (whose traces may differ in steps that compute nothing: a weight's detach)
        if size not in cut:
            sizes_x, tensors_x = step.inputs_at(size)
            gm = traced(fn_at(sizes_x), tensors_x)
            parts = None if gm is None else layers(gm)
            shape = None if parts is None else [(p.block, p.run) for p in parts]
            if shape != [(p.block, p.run) for p in layered.parts] or (cut and list(map(_ops, parts)) != list(
                    map(_ops, next(iter(cut.values()))[1]))):
                raise NotSized(f"the graph at size {size} is not cut into the parts it was at size {step.value}")
            examples = part_inputs(gm, parts, tensors_x)
            if examples is None:
                raise NotSized(f"a part of the graph at size {size} reads a value that is not a tensor")
            cut[size] = gm, parts, examples
        return cut[size]

    gm, parts, examples = parts_at(step.value)
    compiled, by_run = [], {}
    for i, part in enumerate(parts):
        if part.block is not None and part.run in by_run:
            compiled.append(by_run[part.run])  # the run's first block's
            continue
        made = _sized_part(i, parts_at, step.value, layered.compiled[i], options, plan_only)
        compiled.append(made)
        if part.block is not None:
            by_run[part.run] = made
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    runner = LayeredGraph(gm, placeholders, _attributes(gm), parts, None, options, compiled=compiled)
    bounds = [c.sized.max_size for c in compiled if isinstance(c, SizedGraph)]
    if not bounds:
        raise NotSized("no part's inputs follow the size")
    graph = SizedLayers(step, runner, min(bounds), torch._C._get_cublas_allow_tf32())
    try:  # once here, at this call's size, as sized_graph.build runs its module
        graph.call_boxed(list(tensors))
    except Exception as e:  # noqa: BLE001 - whatever stops it, the graph compiles otherwise
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise NotSized(f"the sized parts do not run at size {step.value}: {type(e).__name__}: {first_line}") from e
    graph.seconds = time.perf_counter() - start
    step.tensors = None  # the layouts read the symbolic inputs only: this call's tensors are let go of
    return graph


def _ops(part) -> str:
    """A part's code with its numbers left out (a view's shape holds the size): the same
    ops on the same values at every size; sized_module compares the plans."""
    return re.sub(r"(?<![\w.])\d+", "#", part.gm.code)


def _sized_part(i: int, parts_at, value: int, first_build, options, plan_only):
    """Part ``i``'s sized graph, or ``first_build`` (the part as the first size compiled
    it) where neither what the part reads nor its code follows the size (a mask made
    inside a part from the length alone is in its code)."""
    def inputs(size) -> list:
        _, parts, examples = parts_at(size)
        return [examples[n] for n in parts[i].inputs]

    def static(size) -> tuple:
        _, parts, _ = parts_at(size)
        return parts[i].gm.code, [(tuple(x.shape), x.stride(), x.dtype) for x in inputs(size)]

    here = inputs(value)
    if static(value) == static(value + 1):
        return first_build

    def real(xs) -> list:  # zeros (a valid index, a number) to launch the kernels on
        return [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).zero_() for x in xs]

    def plan_of(size):
        _, parts, _ = parts_at(size)
        return plan_only(parts[i].gm, inputs(size), options)[0]

    _, parts, _ = parts_at(value)
    plan_a, captured = plan_only(parts[i].gm, here, options)
    configs = {info.name: info.config for info in first_build.kernels}
    return sized_graph(plan_a, captured, plan_of, lambda size: real(inputs(size)), value,
                       getattr(parts[i].gm, "__name__", "graph"), real(here), options, configs)
