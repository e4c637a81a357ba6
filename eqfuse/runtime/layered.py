"""A graph of repeated layers compiled as its parts, the layers' plan made once.

``layered(fn, example_inputs, options)`` splits a GraphModule into its runs of repeated
blocks (an encoder's layers, a decoder's) and the parts before, between and after them
(frontend/repeats.py) and compiles each part as a graph of its own; the blocks after the
first take the first one's extracted plan instead of translating, saturating and
extracting again (pipeline.shared_plans), and their kernels' sources are the first
one's, which Triton compiles once. Each part keeps what a compiled graph has on its own:
its variants, its first-call check; once every part has made its first call, all of them
are recorded as one CUDA graph (each part's inputs, the activations between parts, come
from the allocator at new addresses on each call: recorded apart, no part replayed).

A ``LayeredGraph`` is called as a compiled graph is (``call_boxed`` lets go of each value
after the last part that reads it) and reports the parts' kernels, library calls and
eager steps together; ``explain()`` shows the parts around the runs of blocks and the
first block of each run.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..errors import EqfuseError
from .compiled import _signature, too_long_to_record

log = logging.getLogger("eqfuse")

_UNSETTLED = object()  # LayeredGraph.graphs before its parts have all made their first call


def layered(fn, example_inputs, options) -> LayeredGraph | None:
    """``fn`` compiled in parts where it is a GraphModule of repeated blocks whose values'
    metadata it carries (AOTAutograd's and dynamo's graphs do); else None."""
    from ..frontend.repeats import layers

    if not options.share_layers or not isinstance(fn, fx.GraphModule):
        return None
    placeholders = [n for n in fn.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return None
    try:
        parts = layers(fn)
    except Exception as e:  # noqa: BLE001 - finding layers is an optimisation: the graph compiles whole
        log.info("eqfuse: no layers found: %s: %s", type(e).__name__, e)
        return None
    if parts is None:
        return None
    examples = part_inputs(fn, parts, example_inputs)
    if examples is None:
        return None  # a part would read a value whose example it cannot make
    try:
        return LayeredGraph(fn, placeholders, _attributes(fn), parts, examples, options)
    except EqfuseError as e:  # a part its build refuses: the graph compiles whole, as it would have
        log.info("eqfuse: compiled whole, not in parts: %s", e)
        return None


def traced(fn, tensors: list) -> fx.GraphModule | None:
    """``fn`` traced on ``tensors`` (fake tensors made from them) as a GraphModule whose
    values carry their metadata, as ``layered`` takes it; None where tracing fails."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors)
    except Exception as e:  # noqa: BLE001 - compiled from the function instead, whole
        log.info("eqfuse: graph at these sizes compiles whole: %s: %s", type(e).__name__, e)
        return None
    gm.__name__ = getattr(fn, "__name__", type(fn).__name__)
    return gm


def part_inputs(gm: fx.GraphModule, parts: list, example_inputs: list) -> dict:
    """Each value a part reads -> its example (a fake tensor of one mode): the graph's
    inputs and attributes as given, the others from their nodes' metadata; None where a
    part reads a value that is not a tensor."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    given = {**dict(zip(placeholders, example_inputs)), **_attributes(gm)}
    values = {**{n: n.meta.get("val") for p in parts for n in p.inputs}, **given}
    if any(not isinstance(values[n], torch.Tensor) for p in parts for n in p.inputs):
        return None
    return _fakes(values)


def _fakes(values: dict) -> dict:
    """Each example value as a fake tensor of one mode (the graph's metadata holds fakes
    of its tracer's mode, the caller may pass real tensors): each part is then built as a
    graph handed fake inputs is, and checked on the real ones at its first call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        return {n: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device,
                                       requires_grad=v.requires_grad and v.is_leaf) for n, v in values.items()}


def _attributes(gm: fx.GraphModule) -> dict:
    """get_attr node -> the module's tensor it reads (a constant the graph holds)."""
    found = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            value = gm
            for name in n.target.split("."):
                value = getattr(value, name)
            found[n] = value
    return found


class LayeredGraph:
    """A GraphModule compiled as its parts, in order (module docstring)."""

    def __init__(self, fn: fx.GraphModule, placeholders: list, constants: dict, parts: list, examples: dict,
                 options, compiled: list | None = None):
        """``compiled``: each part's compiled graph, made elsewhere (runtime/sized_layers.py);
        by default each part is compiled here, on ``examples`` (node -> example value)."""
        from ..pipeline import shared_plans
        from .compiled import CompiledGraph

        self.fn, self.options, self.parts = fn, options, parts
        self._inputs = placeholders
        self._constants = constants  # get_attr node -> the module's tensor
        if compiled is None:
            with shared_plans():
                compiled = [CompiledGraph(p.gm, [examples[n] for n in p.inputs], options) for p in parts]
        self.compiled = compiled
        output = fn.graph.output_node().args[0]
        self._output = output
        last: dict = {}  # value -> the index of the last part reading it (len(parts): the output)
        for i, p in enumerate(parts):
            for n in p.inputs:
                last[n] = i
        fx.node.map_arg(output, lambda n: last.__setitem__(n, len(parts)))
        self._dying = [[n for n in p.inputs if last[n] == i] for i, p in enumerate(parts)]
        self.graphs = _UNSETTLED  # the replayer of all parts as one CUDA graph, or None (_whole_replayer)
        self._out_spec = None
        self._signature = None  # the inputs' shapes, strides and dtypes the replayer serves

    # --- public face, as CompiledGraph's ---------------------------------------------------------
    @property
    def kernels(self) -> list:
        return [k for c in self.compiled for k in c.kernels]

    @property
    def fallbacks(self) -> list:
        return [f for c in self.compiled for f in c.fallbacks]

    @property
    def library_calls(self) -> list:
        return [call for c in self.compiled for call in c.library_calls]

    @property
    def empty_tensors(self) -> list:
        return [n for c in self.compiled for n in c.empty_tensors]

    @property
    def input_writes(self) -> list:
        return [w for c in self.compiled for w in c.input_writes]

    @property
    def source(self) -> str:
        return "\n".join(c.source for c in self.compiled)

    @property
    def plan(self):
        return None  # one per part: self.compiled[i].plan

    @property
    def report(self) -> dict:
        runs = [[p for p in self.parts if p.run == r] for r in range(1 + max(p.run for p in self.parts
                                                                               if p.run is not None))]
        return {"layers": {"blocks": sum(len(blocks) for blocks in runs), "runs": [len(blocks) for blocks in runs],
                           "nodes_per_block": [len(blocks[0].gm.graph.nodes) - 1 - len(blocks[0].inputs)
                                               for blocks in runs], "parts": len(self.parts)},
                "seconds": self._seconds(),
                "parts": [c.report for c in self.compiled]}

    def _seconds(self) -> dict:
        """Each phase's seconds summed over the parts."""
        total: dict = {}
        for c in self.compiled:
            for k, v in c.report.get("seconds", {}).items():
                total[k] = round(total.get(k, 0.0) + v, 4)
        return total

    def explain(self) -> str:
        from .compiled import compile_time_line

        counts = self.report["layers"]["runs"]
        calls = f"{len(self.library_calls)} cuBLAS call(s), " if self.library_calls else ""
        runs = f"{counts[0]} identical blocks" if len(counts) == 1 else \
            f"{len(counts)} runs of identical blocks ({', '.join(map(str, counts))})"
        lines = [f"eqfuse plan for {getattr(self.fn, '__name__', type(self.fn).__name__)}: {len(self.kernels)} "
                 f"kernel(s), {calls}{len(self.fallbacks)} eager fallback(s), in {len(self.parts)} parts: "
                 f"{runs} compiled once, with what comes before, between and after them",
                 compile_time_line(self._seconds()) + " over the parts"]
        for part, compiled in zip(self.parts, self.compiled):
            if part.block is None:
                lines.append(f"part {part.gm.__name__.rsplit(', ', 1)[-1].replace('its ', 'the ')}:")
            elif part.block == 0:
                run = f"run {part.run}, " if len(counts) > 1 else ""
                lines.append(f"{run}block 0 (blocks 1 to {counts[part.run] - 1} alike):")
            else:
                continue
            lines += ["  " + line for line in compiled.explain().splitlines()]
        return "\n".join(lines)

    def inspect(self, directory=None, arch=None):
        raise EqfuseError("inspect() takes a graph compiled whole; this one was compiled in parts (its identical "
                          "layers once): compile it with share_layers=False to inspect it")

    # --- calls -----------------------------------------------------------------------------------
    def __call__(self, *inputs):
        return self.call_boxed(list(inputs))

    def call_boxed(self, args: list):
        """The parts run in turn on ``args``, which it empties; each value is let go of
        after the last part that reads it. Or, once every part is ready to, all of them
        replayed as one CUDA graph (``_whole_replayer``)."""
        if len(args) != len(self._inputs):
            raise EqfuseError(f"the graph takes {len(self._inputs)} inputs, got {len(args)}")
        replayer = self.graphs if self.graphs is not _UNSETTLED else self._whole_replayer(args)
        if replayer is None or _signature(args) != self._signature:  # other shapes: the parts' own variants
            return self._run_parts(args)
        flat = replayer(tuple(args))
        args.clear()
        return pytree.tree_unflatten(flat, self._out_spec)

    def _launch(self, *inputs) -> list:
        """The parts run in turn, their outputs flat (what a GraphReplayer records)."""
        flat, self._out_spec = pytree.tree_flatten(self._run_parts(list(inputs)))
        return flat

    def _whole_replayer(self, args: list):
        """One CUDA graph for all the parts, where each part would replay its own: a
        decode step's parts each found their inputs at new addresses on every call (the
        activations between them come from the allocator), so none replayed, and a step
        was its launches one by one (Llama-3.2 widths, 4 layers, static cache, H200:
        2.8 ms of host time a token). Settled once every part has made its first call
        (its check on real inputs, its kernels loaded); until then, None, undecided."""
        from ..frontend.writes import written_positions
        from .graphs import GraphReplayer

        variants = [getattr(c, "_main", c) for c in self.compiled]  # a part's variant for these inputs
        if any(getattr(v, "_check", None) is not None or getattr(v, "_complete", None) is not None for v in variants):
            return None
        replayers = [getattr(v, "graphs", None) for v in variants]
        # None for good: a part that does not record (an eager step that waits, no kernels,
        # sizes), or parts each short and all of them long (training)
        if (not replayers or any(r is None or r.disabled for r in replayers)
                or too_long_to_record(sum(v.plan.cost for v in variants), sum(len(v.plan.steps) for v in variants),
                                      self.options.cuda_graphs_under_us)):
            self.graphs = None
            return None
        count = sum(r.copy_limits[0] for r in replayers)
        budget = sum(r.copy_limits[1] for r in replayers)
        deferred = [launcher for r in replayers for launcher in r.deferred]
        name = f"{getattr(self.fn, '__name__', type(self.fn).__name__)} in {len(self.parts)} parts"
        self.graphs = GraphReplayer(self._launch, tuple(self._constants.values()), budget, count, deferred, name,
                                    written_positions(self.fn))
        self._signature = _signature(args)
        return self.graphs

    def _run_parts(self, args: list):
        env = {**self._constants, **dict(zip(self._inputs, args))}
        args.clear()
        for part, compiled, dying in zip(self.parts, self.compiled, self._dying):
            xs = [env[n] for n in part.inputs]
            for n in dying:
                del env[n]
            outs = compiled.call_boxed(xs)
            env.update(zip(part.outputs, outs))
        return fx.node.map_arg(self._output, env.__getitem__)
