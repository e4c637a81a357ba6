"""``eqfuse.compile`` and the ``CompiledGraph`` it returns."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import EqfuseError, kind_of, one_line
from ..schema.plan import BufArg, FallbackStep

VERSION = "0.1.0"
# CUDA graphs: copying in inputs that move between calls (runtime/graphs.py) is worth it
COPY_IN_SHARE = 0.1  # where it takes at most this share of the graph's modelled time
LAUNCHES_PER_COPY = 4  # and each copy saves this many launches or more
# A graph modelled past ``cuda_graphs_under_us`` is recorded all the same where its steps'
# host time (this much each, under what the zoo's training steps show on an H200, all host
# work counted: GPT-2's 6.96 ms of wall time for 4.16 of kernels in 118 launches, T5's
# 17.0 for 7.3 in 266) is this share of its GPU time or more: the host then sets the pace
# (T5's backward, modelled at 2019 us in 55 launches; at 8 us a step it was not recorded).
HOST_US_PER_STEP = 16.0
HOST_SHARE = 0.25
log = logging.getLogger("eqfuse")


def too_long_to_record(cost: float, launches: int, limit: float) -> str | None:
    """Why a graph modelled at ``cost`` us in ``launches`` launches is not worth a CUDA
    graph (past ``limit``, cuda_graphs_under_us, with the host far from setting the pace), or None."""
    if cost >= limit and launches * HOST_US_PER_STEP < HOST_SHARE * cost:
        return f"modelled at {cost:.0f} us, past cuda_graphs_under_us ({limit:.0f}), in {launches} launches"
    return None


@dataclass
class FallbackInfo:
    node: str
    reason: str
    op: str = ""  # the op it runs ("embedding", "cumsum"; "empty" for a tensor with no elements)

    def __str__(self):
        return f"{self.node}: {self.reason}"


@dataclass
class Options:
    max_enodes: int = 50_000
    # the plan search's budget, from capture to extraction: saturation stops at it, and
    # extraction past it keeps the best plan it has (and autotuning is skipped)
    max_seconds: float = 60.0
    rules: tuple = ("algebra", "views", "fusion")
    autotune: bool = True
    validate: bool = True  # check the extracted plan against the graph on the example inputs
    cuda_graphs: bool = True  # replay launches from CUDA graphs when inputs come back at the same addresses
    # ... for plans modelled to run under this many microseconds only, or whose launches
    # the host takes long over (HOST_SHARE): a long graph gains little from one launch,
    # while its recordings keep their memory (the backend sets it for training graphs)
    cuda_graphs_under_us: float = float("inf")
    # compile the kernels in a pool of worker processes before their first launch, not one
    # after the other as they are first launched (GPU only; EQFUSE_PARALLEL_COMPILE=0 turns it off)
    parallel_compile: bool = True
    # keep each compiled graph's plan on disk and reuse it when the same graph is compiled again
    # for the same inputs, options and device, skipping saturation to code generation
    # (runtime/plan_cache.py; EQFUSE_PLAN_CACHE=0 turns it off)
    plan_cache: bool = True
    # a product with nothing fused around it runs as a cuBLAS call, not a generated kernel
    # (GPU only; codegen/library.py; EQFUSE_CUBLAS=0 turns it off)
    cublas: bool = True
    # round every half-precision op's result to its dtype, as eager does, instead of keeping
    # it in float32 until a store or a cast (Inductor's option of the same name): rules that
    # skip a rounding (the softmax forms flash attention streams) are off under it
    emulate_precision_casts: bool = False
    # a product the graph returns, with long rows of an odd width (an LM head's logits over
    # a vocabulary of 50257), is returned with its rows padded to 128 bytes, as
    # torch.compile returns them, so that cuBLAS takes it (codegen/padding.py): the values
    # are eager's, the strides are not. The backend's training graphs keep eager's
    # strides (a saved activation must come back to the backward as it was traced)
    pad_outputs: bool = True
    # a GraphModule of repeated blocks (a model's layers) is compiled as its parts, the
    # blocks' plan extracted once and its kernels shared (runtime/layered.py)
    share_layers: bool = True

    def __post_init__(self):
        """Options of the wrong kind are named here, not met deep inside a compile."""
        from ..rewrite import rules, soundness

        for name in ("max_enodes", "max_seconds", "cuda_graphs_under_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise EqfuseError(f"option {name}={value!r}: expected a positive number")
        for name in ("autotune", "validate", "cuda_graphs", "parallel_compile", "plan_cache", "cublas",
                     "emulate_precision_casts", "pad_outputs", "share_layers"):
            if not isinstance(getattr(self, name), bool):
                raise EqfuseError(f"option {name}={getattr(self, name)!r}: expected True or False")
        try:
            choice = rules.chosen(self.rules)
        except (TypeError, ValueError) as e:
            raise EqfuseError(f"option rules={self.rules!r}: {e}") from None
        for rule in choice.extra:  # a user's rule is checked before any e-graph takes it
            problem = soundness.unsound(rule)
            if problem:
                raise EqfuseError(f"option rules: the rule {rule.name!r} ({rules.rule_text(rule)}) is unsound: "
                                  f"{problem}")
        self.rules = rules.rule_entries(self.rules)

    @classmethod
    def make(cls, **kw):
        unknown = set(kw) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown eqfuse option(s): {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(cls.__dataclass_fields__)}")
        return cls(**kw)


def _signature(tensors) -> tuple:
    """What a compiled variant is specialised to; computed on every call, so kept cheap
    (a plain loop: a comprehension costs a frame). With the inputs, whether float32
    products may use TF32 (``torch.backends.cuda.matmul.allow_tf32``, read through its
    80 ns getter): a graph compiled with it on computes in TF32, so turning it off
    compiles again rather than keeping the rounding the user turned off."""
    sig = [torch._C._get_cublas_allow_tf32()]
    strided = torch.strided
    for t in tensors:  # (a sparse tensor has no strides: its layout stands for them)
        sig.append((t.shape, t.dtype, t.stride() if t.layout is strided else t.layout, t.device))
    return tuple(sig)


def _tensors_of(fn) -> list:
    return [*fn.parameters(), *fn.buffers()] if isinstance(fn, torch.nn.Module) else []


def _holdings(fn) -> list:
    """(the dict that holds it, its name, the value) for every parameter, buffer and
    submodule of a module, checked on each call (``_unchanged``): a graph compiled from a
    module reads its tensors as they were at compile time, so a replaced one
    (``m.weight = nn.Parameter(...)``, or a new submodule) compiles again. A flat list of
    lookups: walking the module tree on every call took 155 us for 12 small blocks on this
    project's CPU, the lookups 14."""
    if not isinstance(fn, torch.nn.Module):
        return []
    return [(held, name, value) for m in fn.modules() for held in (m._parameters, m._buffers, m._modules)
            for name, value in held.items()]


def _unchanged(holdings: list) -> bool:
    for held, name, value in holdings:
        if held.get(name) is not value:
            return False
    return True


def _checked_signature(inputs) -> tuple:
    """``_signature(inputs)``, or an error that names the input that is not a tensor."""
    try:
        return _signature(inputs)
    except AttributeError:
        i, x = next((i, x) for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor))
        raise EqfuseError(f"input {i} is {kind_of(x)}: a compiled graph takes tensors, as its "
                          "example inputs were (bind other arguments with functools.partial)") from None


MAX_VARIANTS = 8  # input signatures a compiled graph compiles for; later new ones run in eager


class CompiledGraph:
    """A function compiled for the shapes, dtypes and strides of its example inputs.

    Calling it with inputs of another signature compiles again for those (and keeps both),
    up to MAX_VARIANTS signatures; ``explain()`` says how many it holds.
    """

    def __init__(self, fn: Callable, example_inputs, options: Options):
        self.fn = fn
        self.options = options
        self._variants: dict[tuple, _Variant] = {}
        if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
            raise EqfuseError(f"example_inputs is a {type(example_inputs).__name__}; pass a tuple or list "
                              "of the function's inputs, e.g. (x,)")
        example_inputs = tuple(example_inputs)
        self._holdings = _holdings(fn)
        # (dynamo's backend hands over AOTAutograd's graphs, whose gradients are its business)
        if torch.is_grad_enabled() and not isinstance(fn, torch.fx.GraphModule) and any(
                t.requires_grad for t in (*example_inputs, *_tensors_of(fn)) if isinstance(t, torch.Tensor)):
            warnings.warn("eqfuse.compile computes no gradients: its outputs do not require grad. Run it under "
                          "torch.no_grad(), or train through torch.compile(model, backend=\"eqfuse\")",
                          stacklevel=3)
        self._main = self._variant(example_inputs)

    # --- public face ---------------------------------------------------------------------------
    @property
    def kernels(self):
        return self._main.kernels

    @property
    def fallbacks(self) -> list[FallbackInfo]:
        return self._main.fallbacks

    @property
    def library_calls(self) -> list:
        """The plan's steps that call a library routine (plain products: cuBLAS on a GPU)."""
        return self._main.library_calls

    @property
    def empty_tensors(self) -> list:
        """The FX nodes whose values have no elements (nothing to compute: each is an
        empty allocation, no kernel), such as transformers' empty KV cache."""
        return self._main.empty_tensors

    @property
    def input_writes(self) -> list[FallbackInfo]:
        """The steps that write into the graph's inputs in place, in eager (a static cache's
        update at a decode step's position, a counter advanced): frontend/writes.py."""
        return self._main.input_writes

    @property
    def source(self) -> str:
        return self._main.source

    @property
    def report(self) -> dict:
        return self._main.report

    @property
    def plan(self):
        return self._main.plan

    def explain(self) -> str:
        text = self._main.explain()
        others = len(self._variants) - 1
        if others > 0:
            eager = sum(isinstance(v, _EagerVariant) for v in self._variants.values())
            text += (f"\n  other input signatures: {others} (the plan above is the example inputs'; "
                     f"{others - eager} compiled, {eager} in eager, {MAX_VARIANTS} compiled at most)")
        return text

    def inspect(self, directory=None, arch=None):
        """Every kernel's Triton source and compiler stages (TTIR ... PTX, SASS) written to
        ``directory``, with a summary (registers, spills, shared memory, source lines); see
        eqfuse/stages.py. ``arch`` (e.g. "sm_90"): compile for that GPU instead of this one."""
        from ..stages import inspect_graph
        return inspect_graph(self, directory, arch)

    def __call__(self, *inputs):
        if self._holdings and not _unchanged(self._holdings):
            self._compile_again("a parameter or buffer of the module was replaced")
        variant = self._variants.get(_checked_signature(inputs)) or self._new_variant(inputs)
        return variant.run(*inputs)

    def _compile_again(self, why: str) -> None:
        """Drops every variant (they hold the module's tensors as they were) and compiles
        the main one again."""
        log.info("eqfuse: %s: compiling again", why)
        self._variants.clear()
        self._holdings = _holdings(self.fn)
        self._main = self._variant(self._main.example_inputs)

    def call_boxed(self, args: list):
        """``self(*args)`` for a list, which it empties: each input is let go of after its
        last use, where the caller holds no other reference to it (AOTAutograd hands a
        backward its saved activations so). Dynamo's backend calls graphs this way."""
        variant = self._variants.get(_checked_signature(args)) or self._new_variant(tuple(args))
        return variant.run_boxed(args)

    def _new_variant(self, inputs: tuple):
        """Compiled for inputs of a signature not seen yet, or eager where they cannot be,
        or past MAX_VARIANTS compiled ones (each holds its kernels, buffers and recordings:
        a caller feeding ever new shapes would grow them without end)."""
        compiled = sum(isinstance(v, _Variant) for v in self._variants.values())
        if compiled >= MAX_VARIANTS:
            log.warning("eqfuse: %d input signatures compiled for this graph already (MAX_VARIANTS); these "
                        "inputs run in eager (mark the changing sizes dynamic, or compile a graph per size)",
                        compiled)
            self._variants[_signature(inputs)] = variant = _EagerVariant(self.fn)
            return variant
        try:
            return self._variant(inputs)
        except EqfuseError as e:  # inputs this graph cannot take: run them in eager
            log.warning("eqfuse: these inputs run in eager: %s", e)
            self._variants[_signature(inputs)] = variant = _EagerVariant(self.fn)
            return variant

    def _variant(self, inputs) -> _Variant:
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise EqfuseError(f"input {i} is {kind_of(x)}; pass tensors "
                                  "(bind other arguments with functools.partial)")
        devices = {x.device for x in inputs}
        if len(devices) > 1:
            raise EqfuseError(f"inputs are on several devices ({', '.join(sorted(map(str, devices)))}); "
                              "compile for one device")
        v = _Variant(self.fn, inputs, self.options)
        self._variants[_signature(inputs)] = v
        return v


class _EagerVariant:
    def __init__(self, fn: Callable):
        self.run = fn
        self.run_boxed = _boxed(fn)


def _boxed(fn: Callable) -> Callable:
    """``fn(*args)`` for a list ``args``, emptied before the call as a boxed caller expects."""
    def run_boxed(args: list):
        inputs = tuple(args)
        args.clear()
        return fn(*inputs)
    return run_boxed


@dataclass
class _Variant:
    fn: Callable
    example_inputs: tuple
    options: Options
    kernels: list = field(default_factory=list)
    fallbacks: list = field(default_factory=list)
    source: str = ""
    report: dict = field(default_factory=dict)
    plan: Any = None
    empty_tensors: list = field(default_factory=list)  # FX nodes whose values have no elements
    input_writes: list = field(default_factory=list)  # the eager steps writing into inputs (frontend/writes.py)

    @property
    def library_calls(self) -> list:
        return self.plan.library_calls if self.plan is not None else []

    def __post_init__(self):
        self._adopt(self.example_inputs)

    def _adopt(self, inputs) -> None:
        """The build for ``inputs``, ready to run (or to finish at the first call)."""
        from ..pipeline import build

        start = time.perf_counter()
        try:
            result = build(self.fn, inputs, self.options)
        except EqfuseError:
            raise
        except Exception as e:  # a bug in eqfuse must not stop the user's program
            result = _internal_error(e)
        self._complete = result.pop("complete", None)
        self._check = result.pop("check", None)
        self.__dict__.update(result)
        self.report["seconds"]["total"] = round(time.perf_counter() - start, 4)
        self.graphs = None
        if self.whole_graph_eager:
            self._run_eager()
        elif self._complete is not None or self._check is not None:
            # kernels still compiling (pipeline._start_kernels), or the plan to check on real inputs
            self.run, self.run_boxed = self._first_run, self._first_run_boxed
        else:
            self._ready()

    def _ready(self):
        self.graphs = self._graph_replayer()
        run = self._runner()
        run_boxed = self.run_boxed

        # The first call is watched: a kernel that fails to compile or launch (the
        # interpreter refusing a construct, a Triton error) runs the graph in eager for
        # good, with the reason, instead of failing the user's program
        def first_run(*inputs):
            self.run, self.run_boxed = run, run_boxed
            return self._watched(run, inputs, inputs, boxed=False)

        def first_run_boxed(args: list):
            self.run, self.run_boxed = run, run_boxed
            return self._watched(run_boxed, tuple(args), args, boxed=True)
        self.run, self.run_boxed = first_run, first_run_boxed

    def _watched(self, run: Callable, inputs: tuple, args, boxed: bool):
        """``run`` called with ``args``; where it raises, the graph in eager from then on,
        called with ``inputs``."""
        try:
            return run(args) if boxed else run(*args)
        except Exception as e:  # noqa: BLE001 - a kernel eqfuse made must not stop the user's program
            reason = f"its first launch failed: {one_line(e)}"
            log.warning("eqfuse: graph runs in eager: %s", reason)
        eager = _eager_result(reason)
        self.__dict__.update(whole_graph_eager=True, fallbacks=eager["fallbacks"])
        self.report["note"] = eager["report"]["note"]
        self._run_eager()
        return self.fn(*inputs)

    def _run_eager(self):
        self.run = self.fn
        self.run_boxed = _boxed(self.fn)

    def _first(self, inputs):
        """The build's last steps, at the first call: the plan checked against the graph
        on the call's real ``inputs`` where the build had only fake ones (then, where it
        differs, built again with them, which checks it at once), and the kernels the
        pool compiled in the meantime, each launched once (pipeline._complete)."""
        from .autotune import NoRunnableConfig

        check, self._check = self._check, None
        if check is not None:
            t0 = time.perf_counter()
            problem = check(inputs)
            self.report["seconds"]["validate"] = round(time.perf_counter() - t0, 4)
            if problem:
                log.warning("eqfuse: %s; building the graph again", problem)
                self._adopt(tuple(inputs))
                self.report.setdefault("retries", []).insert(0, problem)
                if self._complete is None:
                    return
        complete, self._complete = self._complete, None
        if complete is None:
            return self._ready()
        try:
            self.__dict__.update(complete())
            return self._ready()
        except NoRunnableConfig as e:
            log.warning("eqfuse: graph runs in eager: %s", e)
            eager = _eager_result(str(e))
        except Exception as e:  # a bug in eqfuse must not stop the user's program
            eager = _internal_error(e)
        self.__dict__.update(whole_graph_eager=True, fallbacks=eager["fallbacks"])
        self.report["note"] = eager["report"]["note"]
        self._run_eager()

    def _first_run(self, *inputs):
        self._first_once(inputs)
        return self.run(*inputs)

    def _first_run_boxed(self, args: list):
        self._first_once(args)
        return self.run_boxed(args)

    def _first_once(self, inputs):
        """``_first``, by the first of the threads calling the graph at once; the others
        wait for it and run what it made ready (one that went ahead found the kernels
        half-completed). Under the build lock: ``_first`` may build the graph again."""
        from ..pipeline import BUILD_LOCK

        with BUILD_LOCK:
            if self._check is not None or self._complete is not None:
                self._first(inputs)

    def _runner(self) -> Callable:
        """The per-call path, closed over what it needs: it runs on every call, so it does
        without attribute lookups and layers where it can. Sets ``run_boxed`` too."""
        call, device, fallbacks, constants = self.launch, self.device, self.fallback_runners, list(self.constants)
        graphs, leaf = self.graphs, self.out_spec.is_leaf()
        finish = (lambda flat: flat[0]) if leaf else _unflattener(self.out_spec)
        if graphs is not None:  # a replay needs the inputs' addresses: nothing to let go of early
            run = (lambda *inputs: graphs(inputs)[0]) if leaf else (lambda *inputs: finish(graphs(inputs)))
            self.run_boxed = _boxed(run)
            return run

        def run_boxed(args: list):
            args += constants
            return finish(call(device, fallbacks, args))
        self.run_boxed = run_boxed
        if leaf:
            return lambda *inputs: call(device, fallbacks, [*inputs, *constants])[0]
        return lambda *inputs: finish(call(device, fallbacks, [*inputs, *constants]))

    def run_kernels(self, *inputs) -> list:
        """Launch the kernels (and eager steps) one by one; the flat outputs."""
        return self.launch(self.device, self.fallback_runners, [*inputs, *self.constants])

    def _graph_replayer(self):
        from ..rewrite.cost import device_model
        from .graphs import GraphReplayer, unrecordable
        from .launch import deferred_launchers

        if not (self.options.cuda_graphs and self.device.type == "cuda" and self.kernels):
            return None
        why = unrecordable(self.plan.fallbacks, {b.name: b.dtype for b in self.plan.buffers.values()})
        why = why or too_long_to_record(self.plan.cost, len(self.plan.steps), self.options.cuda_graphs_under_us)
        if why:
            self.report["no_cuda_graphs"] = why
            return None
        # Inputs that move between calls are copied in where that costs little against the
        # graph's modelled time (a copy reads and writes each byte) and its launches
        copy_bytes = int(COPY_IN_SHARE * self.plan.cost * device_model().bandwidth_bytes_per_us / 2)
        copy_count = len(self.plan.steps) // LAUNCHES_PER_COPY
        module = getattr(self, "module", None)
        deferred = list(deferred_launchers(module).values()) if module is not None else []
        name = f"{getattr(self.fn, '__name__', type(self.fn).__name__)} of {len(self.kernels)} kernels"
        return GraphReplayer(self.run_kernels, tuple(self.constants), copy_bytes, copy_count, deferred, name,
                             self.plan.written_inputs)

    def explain(self) -> str:
        calls = f"{len(self.library_calls)} cuBLAS call(s), " if self.library_calls else ""
        lines = [f"eqfuse plan for {getattr(self.fn, '__name__', type(self.fn).__name__)}: "
                 f"{len(self.kernels)} kernel(s), {calls}{len(self.fallbacks)} eager fallback(s)"]
        rep = self.report
        if rep.get("seconds"):
            lines.append(compile_time_line(rep["seconds"]))
        if rep.get("plan_cache", {}).get("hit"):
            lines.append(f"  plan: from the plan cache (entry {rep['plan_cache']['key']}); the figures below "
                         "are those of the build that stored it")
        if "saturation" in rep:
            s = rep["saturation"]
            lines.append(f"  saturation: {s['iterations']} iterations, {s['enodes']} e-nodes, "
                         f"{s['eclasses']} e-classes, stopped: {s['stop_reason']}")
            fired = ", ".join(f"{k}×{v}" for k, v in sorted(s["rules_fired"].items()))
            lines.append(f"  rules fired: {fired or 'none'}")
        if rep.get("extraction", {}).get("shared"):
            lines.append("  plan: that of an identical block compiled before it (the figures below are its build's)")
        if "extraction" in rep:
            e = rep["extraction"]
            lines.append(f"  modelled time: {e['plan_cost_us']} us fused vs {e['unfused_cost_us']} us "
                         "one kernel per op")
            if e.get("budget_spent"):
                lines.append(f"  search: the time budget (max_seconds) ran out at {e['budget_spent']}; "
                             "the best plan found by then, untuned")
            if e.get("mended_shapes"):
                lines.append(f"  e-graph: {e['mended_shapes']} term(s) that egglog handed back with another "
                             "shape vector, read at their classes' analysed shapes")
        for k in self.kernels:
            runs = f"; runs as {k.template}" if k.template else ""
            lines.append(f"  kernel {k.name}: {k.schedule.describe()}{runs}; grid {k.grid}, {k.constexprs}")
            lines.append(f"      computes FX nodes: {', '.join(k.fx_nodes) or '-'}")
        for c in self.library_calls:
            lines.append(f"  cuBLAS {c}")
            lines.append(f"      computes FX nodes: {', '.join(c.fx_nodes) or '-'}")
        for f in self.fallbacks:
            lines.append(f"  eager: {f}")
        for w in self.input_writes:
            lines.append(f"  write into an input: {w}")
        if self.empty_tensors:
            lines.append(f"  no elements, nothing to compute: {', '.join(self.empty_tensors)}")
        if rep.get("no_cuda_graphs"):
            lines.append(f"  no CUDA graphs: {rep['no_cuda_graphs']}")
        if rep.get("note"):
            lines.append(f"  note: {rep['note']}")
        return "\n".join(lines)


# A build's phases, in the order they run (pipeline.py records them in report["seconds"])
PHASES = ("capture", "plan_cache", "translate", "saturate", "extract", "validate", "codegen", "load")


def compile_time_line(seconds: dict) -> str:
    """Where a build's time went, for explain(): the phases and, apart, the worker pool's
    Triton compiles (beside the build) and what the first call waited for them."""
    shown = {k: seconds[k] for k in PHASES if seconds.get(k, 0.0) >= 0.005}
    other = seconds.get("total", 0.0) - sum(seconds.get(k, 0.0) for k in PHASES)  # imports, checks, bookkeeping
    if other >= 0.005:
        shown["other"] = other
    phases = ", ".join(f"{k} {v:.2f}" for k, v in shown.items())
    aside = ", ".join(f"{what} {seconds[k]:.2f}" for k, what in (("compile", "Triton compiles in the pool"),
                                                                 ("first_call_wait", "first call waited"))
                      if seconds.get(k))
    return f"  compile time: {seconds.get('total', 0.0):.2f} s ({phases or '-'}){'; ' + aside if aside else ''}"


def _internal_error(e: Exception) -> dict:
    """A build's result where eqfuse failed: the whole graph in eager, with the reason."""
    log.warning("eqfuse: internal error, the graph runs in eager: %s: %s", type(e).__name__, e)
    return _eager_result(f"internal error in eqfuse: {one_line(e)}")


def _eager_result(reason: str) -> dict:
    """A build's result that runs the whole graph in eager, for ``reason``."""
    return {"whole_graph_eager": True, "fallbacks": [FallbackInfo("<graph>", reason)],
            "report": {"seconds": {}, "note": f"whole graph runs in eager: {reason}"}}


def _unflattener(spec) -> Callable:
    """flat outputs -> the function's output structure; a tuple without pytree's walk."""
    if spec.type is tuple and spec.num_leaves == spec.num_children:
        return tuple
    if _holds_size(spec):
        return lambda flat: _with_sizes(pytree.tree_unflatten(flat, spec), spec)
    return lambda flat: pytree.tree_unflatten(flat, spec)


def _children(spec) -> list:
    """A TreeSpec's child specs (``children()`` from torch 2.12; ``children_specs`` before)."""
    return list(spec.children()) if hasattr(spec, "children") else spec.children_specs


def _holds_size(spec) -> bool:
    return spec.type is torch.Size or any(_holds_size(c) for c in _children(spec))


def _with_sizes(value, spec):
    """``value`` with its torch.Size back: torch's pytree unflattens one as a tuple."""
    if spec.type is torch.Size:
        return torch.Size(value)
    if spec.type in (tuple, list):
        return spec.type(_with_sizes(v, c) for v, c in zip(value, _children(spec)))
    if spec.type is dict:
        return {k: _with_sizes(value[k], c) for k, c in zip(spec.context, _children(spec))}
    return value


def make_fallback_runner(step: FallbackStep) -> Callable:
    """A callable that rebuilds an eager op's arguments from the buffers and runs it."""
    from ..schema.values import BufRef

    def resolve(obj, bufs):
        if isinstance(obj, BufArg):
            return bufs[obj.name]
        if isinstance(obj, BufRef):
            base = bufs[obj.buf]
            return torch.as_strided(base, obj.shape, obj.strides, base.storage_offset() + obj.offset)
        if isinstance(obj, (list, tuple)):
            return type(obj)(resolve(x, bufs) for x in obj)
        if isinstance(obj, dict):
            return {k: resolve(v, bufs) for k, v in obj.items()}
        return obj

    def run(bufs):
        out = step.target(*resolve(step.args, bufs), **resolve(step.kwargs, bufs))
        outs = list(out) if step.multi else [out]
        return [o.contiguous() if isinstance(o, torch.Tensor) and o.layout == torch.strided else o for o in outs]
    return run
