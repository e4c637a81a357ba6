"""``torch.compile(model, backend="eqfuse")``: a TorchDynamo backend.

Registered through the ``torch_dynamo_backends`` entry point, so installing eqfuse is
enough. AOTAutograd splits each captured graph into a forward and, when gradients are
needed, a backward graph of ATen ops, decomposed with eqfuse's table; eqfuse compiles
both. A graph eqfuse cannot compile runs as AOTAutograd traced it, with a one-line
warning: the user's program never fails because of the compiler.

Sizes are compile-time constants in eqfuse's kernels. A graph dynamo hands over with
symbolic sizes (``dynamic=True``, ``mark_dynamic``, or its second shape under automatic
dynamic shapes) is compiled for the first set of sizes it is called with; at the second,
a sized module (codegen/sized.py), whose kernels take the dynamic size at launch, is
built to run every size after. Where there is none, each set of sizes compiles on its
own, up to MAX_SHAPES of them; past that it runs as traced. Sizes among a graph's outputs
(a decoder's cache length, a training forward saving a shape for its backward) are
computed from each call's sizes (``_SizesOut``); where one is not a formula over them,
the graph runs as traced.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from typing import Any

import torch
from torch._logging import trace_structured

log = logging.getLogger("eqfuse")

# The graphs this backend compiled most recently (forward and backward), newest last:
# ``eqfuse.backend.history[-1].explain()`` tells what became of the last one.
history: deque = deque(maxlen=32)

MAX_SHAPES = 8  # sets of sizes a graph with symbolic sizes is compiled for; later ones run as traced


def _log_compiled(compiled, kind: str) -> None:
    """What became of a graph, for ``TORCH_LOGS="eqfuse"`` (a line, and each eager step)
    and ``TORCH_LOGS="+eqfuse"`` (the plan in words and the generated source)."""
    seconds = compiled.report.get("seconds", {}).get("total", 0.0)
    log.info("eqfuse: %s graph: %d kernel(s), %d eager step(s), built in %.2f s", kind, len(compiled.kernels),
             len(compiled.fallbacks), seconds)
    for fb in compiled.fallbacks:
        log.info("eqfuse: eager: %s", fb)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("eqfuse: %s\n%s", compiled.explain(), compiled.source)
    # TORCH_TRACE's structured log, which tlparse renders beside dynamo's and AOTAutograd's
    # artifacts (the payloads are computed only where the trace is on)
    for name, payload in (("eqfuse_plan", compiled.explain), ("eqfuse_output_code", lambda: compiled.source)):
        trace_structured("artifact", metadata_fn=lambda name=name: {"name": name, "encoding": "string"},
                         payload_fn=payload)


def _compiler(options: dict, kind: str):
    """AOTAutograd's compiler of ``kind`` graphs ("forward", "backward", "inference"):
    each graph is titled so (its plan, ``explain()``, ``backend.history``)."""
    from . import compile as eqfuse_compile
    from .errors import EqfuseError
    from .frontend.writes import reinplaced

    def compile_fn(fn, example_inputs):
        """eqfuse's compiled graph, or None (with the reason logged) where it cannot be."""
        try:
            compiled = eqfuse_compile(fn, example_inputs, **options)
        except EqfuseError as e:
            log.warning("eqfuse: graph runs uncompiled: %s", e)
            return None
        history.append(compiled)
        _log_compiled(compiled, kind)
        return compiled

    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        gm.__name__ = kind  # AOTAutograd's graph, made for this compile: every one was "GraphModule"
        gm = reinplaced(gm)  # an inference graph's writes into its inputs, updates in place where they can be
        if _symbolic(example_inputs):
            sizes_out = _SizesOut.of(gm, example_inputs)
            if sizes_out is False:
                log.warning("eqfuse: graph with symbolic sizes among its outputs runs uncompiled")
                return gm
            if sizes_out is not None:
                gm = sizes_out.tensors_gm
            runner = _PerShape(gm, example_inputs, compile_fn, options)
            if sizes_out is not None:
                runner = sizes_out.around(runner)
        else:
            compiled = compile_fn(gm, example_inputs)
            if compiled is None:
                return gm
            runner = compiled.call_boxed

        # Boxed (AOTAutograd's convention): the argument list is ours to empty, so that a
        # backward lets go of each saved activation after its last use
        def run(args: list):
            out = runner(args)
            return out if isinstance(out, (tuple, list)) else (out,)
        run._boxed_call = True
        return run
    return compile_graph


def _symbolic(example_inputs) -> bool:
    """Whether dynamo traced the graph with symbolic sizes (SymInt inputs, or tensors shaped by them)."""
    return any(not isinstance(x, torch.Tensor) or any(isinstance(d, torch.SymInt) for d in x.shape)
               for x in example_inputs)


class _SizesOut:
    """A graph with symbolic sizes that returns sizes besides tensors (a decoder's cache
    length, a training forward saving a shape for its backward): its tensors are compiled
    as a graph of their own, and each size it returns is its formula over the symbols,
    read from each call's arguments."""

    def __init__(self, tensors_gm, positions: list, formulas: list, example_inputs):
        self.tensors_gm = tensors_gm  # the graph returning its tensors only
        self.positions = positions  # where the sizes go among the outputs
        self.formulas = formulas  # each size's sympy expression, or an int
        self.example_inputs = list(example_inputs)

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, example_inputs):
        """None where the graph returns tensors only; False where a size it returns is
        not a formula over sizes its inputs carry."""
        output = next(n for n in gm.graph.nodes if n.op == "output")
        outs = output.args[0]
        if not isinstance(outs, (tuple, list)):
            return None
        vals = [getattr(n, "meta", {}).get("val") if isinstance(n, torch.fx.Node) else n for n in outs]
        positions = [i for i, v in enumerate(vals) if v is not None and not isinstance(v, torch.Tensor)]
        if not positions:
            return None
        # the symbols each call's arguments give values to (runtime/sized_graph.symbol_values)
        sizes = [x for x in example_inputs if isinstance(x, torch.SymInt)]
        sizes += [d for x in example_inputs if isinstance(x, torch.Tensor) for d in x.shape]
        known = {d.node.expr for d in sizes if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol}
        formulas = []
        for i in positions:
            v = vals[i]
            if isinstance(v, int) and not isinstance(v, bool):
                formulas.append(v)
            elif isinstance(v, torch.SymInt) and v.node.expr.free_symbols <= known:
                formulas.append(v.node.expr)
            else:
                return False
        tensors_gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        out = next(n for n in tensors_gm.graph.nodes if n.op == "output")
        out.args = (type(outs)(a for i, a in enumerate(out.args[0]) if i not in positions),)
        tensors_gm.graph.eliminate_dead_code()
        tensors_gm.recompile()
        tensors_gm.__name__ = getattr(gm, "__name__", "GraphModule")
        return cls(tensors_gm, positions, formulas, example_inputs)

    def around(self, runner):
        """``runner`` (of the tensors' graph) with the sizes put back among its outputs."""
        from .runtime.sized_graph import symbol_values

        def run(args: list):
            sizes = [(i, a) for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            values = symbol_values(self.example_inputs, sizes, tensors)
            out = list(runner(args))
            for i, f in zip(self.positions, self.formulas):
                out.insert(i, f if isinstance(f, int) else int(f.subs(values)))
            return out
        return run


class _PerShape:
    """A graph with symbolic sizes. The first set of sizes it is called with is compiled
    for those sizes; at the second, a sized module (runtime/sized_graph.py) is built, whose
    kernels take the dynamic size at launch, and runs every size it accepts from then on.
    Where there is none, each set of sizes and tensor signature is compiled on its own,
    MAX_SHAPES at most; other calls run the graph as traced."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, compile_fn, options: dict):
        from .runtime.compiled import _boxed

        self.gm = gm
        self.example_inputs = list(example_inputs)
        self.run_traced = _boxed(gm)
        self.compile_fn = compile_fn
        self.options = options
        # (size arguments, tensor signature) -> compiled graph, the sized graph, or None
        self.compiled: dict = {}
        self.compiles = 0  # graphs compiled for one set of sizes (MAX_SHAPES at most)
        self.sized = None  # the SizedGraph, once built; False where it could not be
        self.first: dict | None = None  # the symbols' values at the first call
        self.warned = False

    def __call__(self, args: list):
        from .runtime.compiled import _signature

        sizes = tuple((i, a) for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        key = (sizes, _signature(tensors))
        compiled = self.compiled.get(key, False)
        if compiled is False:
            if self.first is None:
                from .runtime.sized_graph import symbol_values
                self.first = symbol_values(self.example_inputs, sizes, tensors)
            elif self.sized is None:
                self.sized = self._sized(sizes, tensors)
            if self.sized and self.sized.accepts(tensors):
                compiled = self.compiled[key] = self.sized  # the key holds all accepts reads
            else:
                compiled = self._compile(key, sizes, tensors)
        if compiled is None:
            return self.run_traced(args)
        args.clear()
        return compiled.call_boxed(tensors)

    def _bound(self, sizes):
        """The graph with its size arguments ``sizes`` bound: a function of its tensors."""
        gm = self.gm

        def with_sizes(*tensors):
            args = list(tensors)
            for i, a in sizes:  # in increasing position: each lands where it was
                args.insert(i, a)
            return gm(*args)
        with_sizes.__name__ = getattr(gm, "__name__", type(gm).__name__)
        return with_sizes

    def _sized(self, sizes, tensors):
        """The sized graph, built at this call's sizes with the block sizes the first
        compile chose; False (with the reason logged) where there is none."""
        from .codegen.sized import NotSized
        from .errors import EqfuseError
        from .runtime import sized_graph, sized_layers
        from .runtime.compiled import CompiledGraph, Options
        from .runtime.layered import LayeredGraph

        first = next((c for c in self.compiled.values() if c is not None), None)
        options = Options.make(**self.options)
        if isinstance(first, LayeredGraph):  # in the parts the first size was compiled in
            try:
                sized = sized_layers.build(self._bound, self.example_inputs, self.first, sizes, tensors, options,
                                           first)
                log.info("eqfuse: graph with symbolic sizes runs a sized module per part for every size "
                         "(built in %.1f s)", sized.seconds)
                return sized
            except (NotSized, EqfuseError) as e:
                log.info("eqfuse: graph with symbolic sizes: no sized module per part (%s); one for the whole graph", e)
            except Exception as e:  # noqa: BLE001 - a bug in eqfuse: the whole graph's, as before
                log.warning("eqfuse: sized parts failed (%s: %s); a sized module for the whole graph",
                            type(e).__name__, e)
        # by kernel name: a graph compiled in parts names its kernels per part, not as the sized plans do
        whole = isinstance(first, CompiledGraph)
        configs = {info.name: info.config for info in (first.kernels if whole else ())}
        try:
            sized = sized_graph.build(self._bound, self.example_inputs, self.first, sizes, tensors, options, configs)
        except (NotSized, EqfuseError) as e:
            log.info("eqfuse: graph with symbolic sizes compiles per size: %s", e)
            return False
        except Exception as e:  # noqa: BLE001 - a bug in eqfuse: compile per size, as before
            log.warning("eqfuse: sized module failed (%s: %s); compiling per size", type(e).__name__, e)
            return False
        log.info("eqfuse: graph with symbolic sizes runs one sized module for every size (built in %.1f s)",
                 sized.seconds)
        return sized

    def _compile(self, key, sizes, tensors):
        if self.compiles >= MAX_SHAPES:
            if not self.warned:
                log.warning("eqfuse: graph with symbolic sizes met more than %d shapes: new ones run uncompiled",
                            MAX_SHAPES)
                self.warned = True
            return None
        self.compiles += 1
        self.compiled[key] = compiled = self.compile_fn(self._traced(sizes, tensors), tensors)
        return compiled

    def _traced(self, sizes, tensors):
        """The graph at these sizes as a GraphModule of its tensors, traced with their
        metadata, so that its identical layers compile once (runtime/layered.py), as the
        graph's at static sizes do; the bound function where tracing fails."""
        from .runtime.layered import traced

        bound = self._bound(sizes)
        gm = traced(bound, tensors)
        return bound if gm is None else gm


# Training graphs modelled to run longer than this launch kernel by kernel (see below)
TRAINING_GRAPHS_UNDER_US = 2000.0


# torch.compile's modes, as eqfuse options (the options a user gives win over them). The
# default mode times no configurations, as Inductor's does not: the tile model's first
# choice that launches (a Llama-3.2 decode step, 4 layers, on an H200: 9 s to build with
# timing, of which 6 s timing candidates; eqfuse.compile keeps autotune on by default)
MODES = {
    "default": {"autotune": False},
    "max-autotune": {"autotune": True},
    "max-autotune-no-cudagraphs": {"autotune": True, "cuda_graphs": False},
    "reduce-overhead": {"autotune": False, "cuda_graphs": True},  # training graphs recorded too, however long
}


def eqfuse_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None,
                   **_: Any):
    """The dynamo backend. ``mode``: torch.compile's (``MODES``). ``options`` are
    ``eqfuse.compile`` options, and two of its own:
    ``recompute`` (default False): True has the backward recompute cheap forward values
    instead of the forward saving them (AOTAutograd's min-cut partitioner, as Inductor
    uses); False saves every value the backward reads. ``backward_ahead`` (default True):
    a training graph's backward is built with its forward, while the forward's kernels
    compile, instead of at the first backward (AOTAutograd's default); False saves that
    build where no backward ever runs."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config

    if (mode or "default") not in MODES:
        from .errors import EqfuseError
        raise EqfuseError(f"mode={mode!r}: eqfuse takes torch.compile's modes {', '.join(MODES)}")
    options = {**MODES[mode or "default"], **(options or {})}
    _ready_triton_ahead(example_inputs, options)
    ahead = options.pop("backward_ahead", True) and hasattr(functorch_config, "force_non_lazy_backward_lowering")
    # Recomputing is not the default: on an H100 (benchmarks/models.py, fp16, training
    # step) it took the Llama layer from 44.1 to 49.5 ms for 0.7 GB less at the peak
    # (of 16.5), while BERT's step went from 1539 to 1306 us; GPT-2's graphs came out alike.
    partition = partitioner(options.pop("recompute", False))
    # Training graphs replay CUDA graphs only where they are short, unless asked for:
    # there the host's launches set the step's time (GPT-2 block B8 S1024 on an H100:
    # 1.98 -> 1.24 ms a step with the forward replayed), while a long graph gains nothing
    # and its recordings hold their memory apart from the caching allocator's (Llama
    # layer B8 S2048: 44.5 against 45.9 ms, 16.1 GB at the peak against 12.6).
    # Their outputs keep eager's strides: a forward's outputs include what its backward
    # saved, which comes back to the backward graph as it was traced (Options.pad_outputs).
    kept = {"pad_outputs": False, **options}
    trained = {"cuda_graphs_under_us": TRAINING_GRAPHS_UNDER_US, **kept} if "cuda_graphs" not in options else kept
    forward, backward = _compiler(trained, "forward"), _compiler(trained, "backward")
    compiler = _compiler(options, "inference")
    # No decompositions at this level: eqfuse decomposes when it captures each graph, where
    # validation checks the result against the graph as AOTAutograd gave it. (With torch
    # 2.13's core decompositions here, AOTAutograd's own backward of a GPT-2 block on the
    # CPU was wrong, compilers aside.)
    # An inference graph keeps its writes into its inputs (a static cache's update, made an
    # update in place: frontend/writes.py) instead of returning new values copied back after
    backend = aot_autograd(fw_compiler=forward, bw_compiler=backward, inference_compiler=compiler,
                           partition_fn=partition, keep_inference_input_mutations=True)
    from .frontend.masks import without_constant_masks
    gm = without_constant_masks(gm)  # a mask that keeps every key: the fused attention, as in eager
    if not torch.is_grad_enabled() or not any(getattr(t, "requires_grad", False) for t in example_inputs):
        from .frontend.capture import plain_bool_masked_attention
        gm = plain_bool_masked_attention(gm)
    if not ahead:
        return backend(gm, example_inputs)
    # The forward's kernels compile in the pool as its build returns (pipeline._start_kernels),
    # so building the backward now overlaps them; the first backward only waits for its own
    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        return backend(gm, example_inputs)


def partitioner(recompute: bool = False):
    """AOTAutograd's partition function for the backend: the min-cut partitioner with
    ``recompute``, else the default one (the backward reads what the forward saved), each
    after the joint graph's rewrites (frontend/joint.py)."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    from .frontend.joint import recompute_log_softmax

    split = min_cut_rematerialization_partition if recompute else default_partition

    def partition(joint, inputs, **kwargs):
        return split(recompute_log_softmax(joint), inputs, **kwargs)
    return partition


def _ready_triton_ahead(example_inputs, options: dict) -> None:
    """Where kernels will compile in the pool, what Triton does once a process (its key,
    its driver's C module: parallel_compile.ready_triton_ahead) starts now, while
    AOTAutograd traces: started at the build, a BERT layer's first kernels waited 0.3-0.6 s
    for the key on an H200 host."""
    from .runtime import parallel_compile

    on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    if on_gpu and parallel_compile.enabled(options.get("parallel_compile", True)):
        parallel_compile.ready_triton_ahead()


backend = eqfuse_backend
