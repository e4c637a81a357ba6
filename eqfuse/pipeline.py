"""The whole pipeline, one step after another: capture -> terms -> saturation ->
extraction -> Triton source -> loaded module. Each step's product is kept for the user
to look at (``CompiledGraph.plan``, ``.source``, ``.report``)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
import threading
import time
from contextlib import contextmanager

import torch

from .errors import EqfuseError, ExtractionError, Unsupported, one_line
from .frame_room import with_frame_room
from .frontend.writes import mutation_problem


def _dynamo_compile_lock():
    try:
        from torch._dynamo.convert_frame import compile_lock
    except ImportError:  # a torch without it: a lock of eqfuse's own
        return threading.RLock()
    return compile_lock


# One build at a time in a process: tracing (torch.fx's patcher, make_fx's modes), the
# real-tensor switch below and egglog keep process-wide state (compiling in 4 threads
# failed with "CURRENT_PATCHER is None"). It is dynamo's own compile lock, re-entrant, which
# a build under torch.compile already holds: with a lock of its own, a thread building
# under it and one tracing a user's torch.compile'd function in eqfuse.compile could each
# wait for the other's. Kernels of graphs already built keep running meanwhile.
BUILD_LOCK = _dynamo_compile_lock()


def build(fn, example_inputs, options) -> dict:
    """Capture, extract, generate and load ``fn`` at ``example_inputs``: the build's
    result (kernels, fallbacks, plan, source, report)."""
    return with_frame_room(_build, fn, example_inputs, options)


def _build(fn, example_inputs, options) -> dict:
    from .runtime import plan_cache

    if _parallel(options, example_inputs) and not plan_cache.enabled(options.plan_cache):
        _prestart()  # with the plan cache on, after a miss (see _build_captured)
    t0 = time.perf_counter()
    with BUILD_LOCK, deep_recursion():
        captured = _capture(fn, example_inputs)
        seconds = {"capture": time.perf_counter() - t0}
        with _real_tensors():
            return _build_captured(fn, captured, example_inputs, options, seconds)


# The code generator and the interpreters walk a kernel's expression recursively, one
# frame or two per op: a chain of 500 pointwise ops fused into one kernel ran past
# Python's default limit of 1000 (and the graph into eager). Python 3.11 keeps such calls
# off the C stack, so builds run under this limit (raised, never lowered, while any runs).
RECURSION_LIMIT = 20000
_recursion = {"builds": 0, "saved": 0}
_recursion_lock = threading.Lock()


@contextmanager
def deep_recursion():
    with _recursion_lock:
        if _recursion["builds"] == 0:
            _recursion["saved"] = sys.getrecursionlimit()
            sys.setrecursionlimit(max(_recursion["saved"], RECURSION_LIMIT))
        _recursion["builds"] += 1
    try:
        yield
    finally:
        with _recursion_lock:
            _recursion["builds"] -= 1
            if _recursion["builds"] == 0:
                sys.setrecursionlimit(_recursion["saved"])


@contextmanager
def _real_tensors():
    """AOTAutograd calls its compilers with its FakeTensorMode active and PyTorch's Python
    dispatcher on. Everything after capture computes on real tensors (compile-time mask
    analysis, validation, trial launches on the GPU), so both are set aside: under the
    dispatcher each eager op goes through its Python decomposition, 5x slower (validating
    a Llama layer's forward and backward took 2.7 s of an H100 host's cold compile)."""
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), no_python_dispatcher():
        yield


def _build_captured(fn, captured, example_inputs, options, seconds: dict) -> dict:
    from .runtime import plan_cache
    from .runtime.compiled import VERSION, FallbackInfo, make_fallback_runner

    device = example_inputs[0].device if example_inputs else torch.device("cpu")
    device_type = device.type
    parallel = _parallel(options, example_inputs)
    library = _cublas(device_type, options)
    title = getattr(fn, "__name__", type(fn).__name__)
    result = {"constants": captured.constants, "out_spec": captured.out_spec, "device": device,
              "whole_graph_eager": False, "kernels": [], "fallbacks": [], "source": "", "plan": None,
              "report": {"seconds": seconds}}

    def eager(reason: str) -> dict:
        result["whole_graph_eager"] = True
        result["fallbacks"] = [FallbackInfo("<graph>", reason)]
        result["report"]["note"] = f"whole graph runs in eager: {reason}"
        return result

    reason = mutation_problem(captured.gm)
    if reason:
        return eager(reason)
    if device_type != "cuda" and not _interpreter_ready():
        return eager("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing triton")
    key = None
    if plan_cache.enabled(options.plan_cache):
        t0 = time.perf_counter()
        key = plan_cache.plan_key(captured, example_inputs, options, device, title)
        hit = _from_plan_cache(key, captured, example_inputs, parallel, result)
        seconds["plan_cache"] = time.perf_counter() - t0 - seconds.get("load", 0.0) - seconds.get("compile", 0.0)
        if hit:
            return _rounded(result)
        if parallel:
            # Not before the lookup: a hit whose kernels Triton has cached needs no worker.
            # They still start before translation, saturation and extraction.
            _prestart()
    # Imported after the lookup: extraction's imports (egglog, networkx) take 0.2-0.4 s, the
    # most of a process's first compile when its plan comes from the cache.
    from .codegen.module import generate_module
    from .rewrite.validate import mismatch

    def extract_plan(again: bool):
        if again:  # built once more from scratch: not the shared plan that failed
            return _extract(captured, options, seconds, library)
        return _extracted(captured, example_inputs, options, device, title, seconds, library)

    # A plan that fails validation, or an e-graph the parser finds inconsistent (egglog
    # 13.2 once mixed up string arguments between terms: see terms.py), is built once
    # more from scratch; then the graph runs in eager with the reason.
    problem, started = None, None
    for _attempt in range(2):
        try:
            plan, sat, ext_report = extract_plan(again=_attempt > 0)
        except Unsupported as e:
            return eager(str(e))
        except ExtractionError as e:
            problem = f"no legal plan: {e}"
            if not e.retry:
                break
            continue
        if _deferred(options, parallel):
            started = _start_kernels(plan, title, example_inputs, captured.constants, seconds, library,
                                     options.pad_outputs)
        if not options.validate:
            problem = None
            break
        if _fake(captured.example_tensors):
            # Checked at the first call, on the inputs the user passes: values made up here
            # may break an op's precondition (a token index past an embedding's rows, which
            # on a GPU kills the process's CUDA context), and a check on them checks nothing
            # (a copy: code generation rewrites the plan in place, cuBLAS calls for products)
            result["check"] = functools.partial(_first_call_check, copy.deepcopy(plan), captured)
            problem = None
            break
        t0 = time.perf_counter()
        try:
            mismatch_ = mismatch(plan, captured, make_fallback_runner)
        except Exception as e:  # noqa: BLE001 - a checker that cannot run has not checked
            mismatch_ = one_line(e)
        seconds["validate"] = time.perf_counter() - t0
        problem = mismatch_ and f"internal check failed, the extracted plan differs from the graph: {mismatch_}"
        if not problem:
            break
        result["report"].setdefault("retries", []).append(problem)
    if problem:
        return eager(problem)
    result["report"].update(saturation=sat.as_dict(), extraction=ext_report)
    if ext_report.get("budget_spent"):
        key = None  # a plan cut short is not kept: the next compile searches again
    result["report"]["saturation"]["eclasses"] = sat.eclasses
    if started is not None:
        plan, source, infos, module, pending, configs = started
        result.update(_runnable(plan, source, infos, module),
                      complete=lambda: _complete(result, pending, configs, title, example_inputs,
                                                 captured.constants, key))
        return _rounded(result)

    t0 = time.perf_counter()
    source, infos = generate_module(plan, title, VERSION, library=library, pad_outputs=options.pad_outputs)
    tuning: dict = {}  # seconds spent compiling and first launching kernels, and the pool's outcome
    if device_type == "cuda" and infos:
        from .runtime.autotune import NoRunnableConfig, choose_configs
        try:
            configs = choose_configs(plan, infos, title, VERSION, example_inputs, captured.constants,
                                     measure=options.autotune and not ext_report.get("budget_spent"),
                                     parallel=parallel, stats=tuning)
        except NoRunnableConfig as e:
            return eager(str(e))
        source, infos = generate_module(plan, title, VERSION, configs)
    seconds["codegen"] = time.perf_counter() - t0 - tuning.get("seconds", 0.0)
    _finish(result, plan, source, infos, captured, example_inputs, parallel, tuning)
    if key is not None and "check" in result:  # stored once checked
        result["check"] = functools.partial(_stored_if_checked, result["check"], key, result)
    elif key is not None:
        _store_plan(key, result)
    return _rounded(result)


def _stored_if_checked(check, key: str, result: dict, inputs) -> str | None:
    """``check(inputs)``, and the plan stored under ``key`` where it passes."""
    problem = check(inputs)
    if not problem:
        _store_plan(key, result)
    return problem


_shared = threading.local()  # .plans, .captures: what shared_plans() keeps, by plan_cache key and by graph


@contextmanager
def shared_plans():
    """Within it, a graph whose plan was extracted before in it, for the same inputs'
    metadata and options, takes a copy of that plan instead of extracting its own: the
    identical layers of a graph compiled in parts (runtime/layered.py). The key is the
    plan cache's (everything a plan depends on), the copies held in memory only."""
    outer = getattr(_shared, "plans", None), getattr(_shared, "captures", None)
    _shared.plans, _shared.captures = ({}, {}) if outer[0] is None else outer
    try:
        yield
    finally:
        _shared.plans, _shared.captures = outer


def _capture(fn, example_inputs):
    """``capture``, or within ``shared_plans``, for a GraphModule of no attributes whose
    code and inputs' metadata equal a graph's captured before in it, that capture with
    this graph's function and inputs (a block's trace took 0.1 s of a warm start's 0.12
    on the development machine, each block again)."""
    from .frontend.capture import capture

    shared = getattr(_shared, "captures", None)
    if shared is None or not isinstance(fn, torch.fx.GraphModule) or any(
            n.op == "get_attr" for n in fn.graph.nodes) or not all(isinstance(x, torch.Tensor) for x in example_inputs):
        return capture(fn, example_inputs)
    key = (fn.code, tuple((tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.requires_grad)
                          for x in example_inputs))
    if key not in shared:
        shared[key] = capture(fn, example_inputs)
        return shared[key]
    return dataclasses.replace(shared[key], fn=fn, example_tensors=list(example_inputs))


def _extracted(captured, example_inputs, options, device, title: str, seconds: dict, library: bool):
    """``_extract``, or within ``shared_plans`` the copy of a plan extracted for an equal graph."""
    from .runtime import plan_cache

    shared = getattr(_shared, "plans", None)
    if shared is None:
        return _extract(captured, options, seconds, library)
    key = plan_cache.plan_key(captured, example_inputs, options, device, title)
    if key not in shared:
        shared[key] = copy.deepcopy(_extract(captured, options, seconds, library))
        return copy.deepcopy(shared[key])
    plan, sat, ext_report = copy.deepcopy(shared[key])
    return plan, sat, {**ext_report, "shared": True}


def _extract(captured, options, seconds: dict, library: bool = False):
    """Terms -> saturation -> extraction: (plan, saturation report, extraction report).
    ``library``: the plan's plain products will be cuBLAS calls, as its costs weigh them."""
    from .rewrite.egraph_json import serialize
    from .rewrite.extract import Extractor
    from .rewrite.saturate import Limits, saturate
    from .schema.from_fx import translate

    t0 = time.perf_counter()
    deadline = t0 + options.max_seconds - sum(seconds.values())  # the budget counts capture too
    tr = translate(captured, emulate_precision_casts=options.emulate_precision_casts)
    seconds["translate"] = time.perf_counter() - t0
    limits = Limits(max_enodes=options.max_enodes, max_seconds=max(0.0, deadline - time.perf_counter()))
    sat = saturate(tr.egraph, limits, enabled=options.rules, rounding_kept=options.emulate_precision_casts)
    seconds["saturate"] = sat.seconds
    t0 = time.perf_counter()
    try:
        view = serialize(tr.egraph)
        sat.enodes, sat.eclasses = view.size()
        plan, ext_report = Extractor(view, tr, library=library).extract(deadline)
        if view.mended:  # egglog's mixed-up vectors, read at their classes' analysed shapes
            ext_report = {**ext_report, "mended_shapes": len(view.mended)}
    finally:
        # Dropped here, on the thread that made it: egglog's e-graph may only be freed on
        # its own thread, and the translation sits in reference cycles that the garbage
        # collector would break on whichever thread it runs (the autograd engine's compiles
        # a backward graph; the main thread collects it).
        _drop_egraph(tr)
    seconds["extract"] = time.perf_counter() - t0
    return plan, sat, ext_report


def _fake(tensors) -> bool:
    """Whether any of ``tensors`` is a FakeTensor (AOTAutograd hands compilers those)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return any(isinstance(t, FakeTensor) for t in tensors)


def _first_call_check(plan, captured, inputs) -> str | None:
    """Why ``plan`` is not the graph's on the real ``inputs`` of its first call (a
    one-line reason), or None where it computes what the graph does."""
    from .rewrite.validate import mismatch
    from .runtime.compiled import make_fallback_runner

    try:
        problem = mismatch(plan, captured, make_fallback_runner, list(inputs) + list(captured.constants))
    except Exception as e:  # noqa: BLE001 - a checker that cannot run has not checked
        problem = one_line(e)
    return problem and f"internal check failed, the extracted plan differs from the graph: {problem}"


def plan_only(fn, example_inputs, options):
    """The plan extracted for ``fn`` at its example inputs, and its capture (constants,
    output structure): the build's CPU stages without validation, code or kernels.
    Raises EqfuseError where the build would run the graph in eager."""
    return with_frame_room(_plan_only, fn, example_inputs, options)


def _plan_only(fn, example_inputs, options):
    from .frontend.capture import capture

    with BUILD_LOCK:
        captured = capture(fn, example_inputs)
        with _real_tensors():
            plan, _, _ = _extract(captured, options, {})
    return plan, captured


def _deferred(options, parallel: bool) -> bool:
    """Whether the kernels are compiled while the build goes on and checked at the first
    call (``_start_kernels``, ``_complete``): in the pool (so on a GPU), untimed."""
    from .runtime.cache import switched_on
    return parallel and not switched_on("EQFUSE_AUTOTUNE", options.autotune)


def _start_kernels(plan, title: str, example_inputs, constants, seconds: dict, library: bool,
                   pad_outputs: bool):
    """The plan's module, each kernel in the tile model's first configuration (or the one
    timed for it before), loaded, its kernels compiling in the pool as the build goes on:
    validation, then (with the backend's ``backward_ahead``) a training step's backward
    graph overlap the compile, which was the longest stage of a cold build. (the plan as
    generated, source, kernels, module, parallel_compile.Pending, configs), or None for a
    plan without kernels."""
    from .codegen.module import generate_module
    from .runtime.autotune import first_choices
    from .runtime.compiled import VERSION
    from .runtime.parallel_compile import Pending, module_launches

    t0 = time.perf_counter()
    plan = copy.deepcopy(plan)  # code generation splits kernels in place; validation wants them whole
    source, infos = generate_module(plan, title, VERSION, library=library, pad_outputs=pad_outputs)
    if not infos:
        seconds["codegen"] = time.perf_counter() - t0
        return None
    configs = first_choices(plan, infos, VERSION)
    source, infos = generate_module(plan, title, VERSION, configs)
    seconds["codegen"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    module = _load(source, "cuda")
    seconds["load"] = time.perf_counter() - t0
    pending = Pending(module_launches(module, infos, plan, list(example_inputs) + list(constants)))
    return plan, source, infos, module, pending, configs


def _complete(result: dict, pending, first: dict, title: str, example_inputs, constants, key) -> dict:
    """At the first call of a module from ``_start_kernels``: waits for the pool, then
    launches each kernel once on scratch buffers (``choose_configs``, untimed), as a build
    without deferral does; a configuration that does not run on this device gives way
    to the next one, in a module generated anew: its fields of the result are returned
    (none where the first choices all ran). Then the plan cache gets the entry (under
    ``key``, if any): only configurations that ran are kept, so a template still compiling
    in the background (parallel_compile._deferrable) has it stored once it has run
    (``_store_once_run``). Raises NoRunnableConfig where none runs."""
    from .codegen.module import generate_module
    from .runtime.autotune import choose_configs
    from .runtime.compiled import VERSION
    from .runtime.launch import deferred_launchers

    report, plan = result["report"], result["plan"]
    t0 = time.perf_counter()
    outcome = pending.wait()
    waited = time.perf_counter() - t0
    tuning: dict = {}
    deferred = deferred_launchers(result["module"])
    compiling = frozenset(deferred)
    configs = choose_configs(plan, result["kernels"], title, VERSION, example_inputs, constants,
                             measure=False, parallel=False, stats=tuning, unchecked=compiling)
    changed = {}
    if configs != first:
        source, infos = generate_module(plan, title, VERSION, configs)
        module = _load(source, "cuda")
        changed = dict(source=source, kernels=infos, module=module, launch=module.call_boxed)
        result.update(changed)
    report["seconds"]["compile"] = round(outcome.seconds, 4)  # the pool's, mostly beside the build
    report["seconds"]["first_call_wait"] = round(waited + tuning.get("seconds", 0.0), 4)
    report["compile"] = {"module": outcome.as_dict()}
    if outcome.note:
        report["note"] = "; ".join(n for n in (report.get("note"), outcome.note) if n)
    if key is not None and compiling:
        # The entry keeps only configurations that ran: stored once the templates have
        report["plan_cache"] = {**report.get("plan_cache", {"hit": False, "key": key}), "stored": False,
                                "not_stored": f"{', '.join(sorted(compiling))} still compiling, not run yet"}
        if not changed:  # else the launchers waited for are not the module's
            _store_once_run(key, result, deferred)
    elif key is not None:
        _store_plan(key, result)
    return changed


def _store_once_run(key: str, result: dict, launchers: dict) -> None:
    """The plan stored under ``key`` once each of ``launchers`` (kernel name -> a template's
    launcher, compiling in the background) has run its own kernel: at a later call of this
    process, so that the next process finds the entry (without it, the second cold build
    of the Llama layer extracted its plan again)."""
    left = set(launchers)

    def ran(name: str) -> None:
        left.discard(name)
        if not left:
            result["report"].get("plan_cache", {}).pop("not_stored", None)
            _store_plan(key, result)
    for name, launcher in launchers.items():
        launcher.on_checked = functools.partial(ran, name)


def _finish(result: dict, plan, source: str, infos: list, captured, example_inputs, parallel: bool,
            tuning: dict) -> None:
    """The generated module loaded (and its kernels compiled, on a GPU): ``result`` made
    runnable. ``tuning``: what choosing the block sizes compiled (see _compile_kernels)."""
    device_type = result["device"].type
    seconds = result["report"]["seconds"]
    t0 = time.perf_counter()
    module = _load(source, device_type)
    seconds["load"] = time.perf_counter() - t0
    if device_type == "cuda" and infos:
        _compile_kernels(module, infos, plan, list(example_inputs) + list(captured.constants),
                         parallel, tuning, result["report"])
    result.update(_runnable(plan, source, infos, module))


def _load(source: str, device_type: str):
    """The generated module, loaded (from eqfuse's module cache where it was before)."""
    from .runtime.cache import cache_key, load_module
    from .runtime.compiled import VERSION

    return load_module(cache_key(source, device_type, VERSION, _triton_version()), source,
                       interpret=device_type != "cuda")


def _runnable(plan, source: str, infos: list, module) -> dict:
    """The result's fields that run the plan: its module and kernels, its eager steps."""
    from .runtime.compiled import FallbackInfo, make_fallback_runner
    from .schema.from_fx import step_op

    ops = [(s, step_op(s.target)) for s in plan.fallbacks]
    return dict(kernels=infos, source=source, plan=plan, module=module, launch=module.call_boxed,
                fallback_runners=[make_fallback_runner(s) for s in plan.fallbacks],
                fallbacks=[FallbackInfo(s.node, s.reason, op) for s, op in ops if op != "empty" and not s.writes],
                empty_tensors=[s.node for s, op in ops if op == "empty"],
                input_writes=[FallbackInfo(s.node, s.reason, op) for s, op in ops if s.writes])


# The report's parts a plan cache entry keeps: what explain() prints of the build that made it.
_PLAN_REPORT = ("saturation", "extraction", "retries")


def _from_plan_cache(key: str, captured, example_inputs, parallel: bool, result: dict) -> bool:
    """``result`` completed from the plan cache entry ``key``, if there is one that checks
    out and loads; else False, with the reason in the report where an entry was refused."""
    from .runtime import plan_cache

    report = result["report"]
    entry, problem = plan_cache.load(key)
    if entry is not None:
        problem = plan_cache.check(entry, captured, example_inputs)
    if entry is None or problem:
        report["plan_cache"] = {"hit": False, "key": key, **({"rebuilt": problem} if problem else {})}
        return False
    try:
        _finish(result, entry.plan, entry.source, entry.kernels, captured, example_inputs, parallel, {})
    except Exception as e:  # noqa: BLE001 - an entry that does not load is rebuilt, not trusted
        for k in ("load", "compile"):
            report["seconds"].pop(k, None)
        report.pop("compile", None)
        report["plan_cache"] = {"hit": False, "key": key,
                                "rebuilt": f"its module does not load: {type(e).__name__}: {e}"}
        return False
    report.update({k: entry.report[k] for k in _PLAN_REPORT if k in entry.report})
    report["plan_cache"] = {"hit": True, "key": key, "built_seconds": entry.seconds}
    return True


def _store_plan(key: str, result: dict) -> None:
    """The built plan stored under ``key``; the report says whether it was."""
    from .runtime import plan_cache

    report = result["report"]
    entry = plan_cache.Entry(result["plan"], result["kernels"], result["source"],
                             {k: report[k] for k in _PLAN_REPORT if k in report},
                             {k: round(v, 4) for k, v in report["seconds"].items()})
    problem = plan_cache.store(key, entry)
    report["plan_cache"] = {**report.get("plan_cache", {"hit": False, "key": key}),
                            "stored": problem is None, **({"not_stored": problem} if problem else {})}


def _rounded(result: dict) -> dict:
    seconds = result["report"]["seconds"]
    for k in seconds:
        seconds[k] = round(seconds[k], 4)
    return result


def _prestart() -> None:
    """parallel_compile's workers started now, to be ready when the kernels are."""
    from .runtime.parallel_compile import prestart
    prestart()


def _cublas(device_type: str, options) -> bool:
    """Plain products as cuBLAS calls (codegen/library.py): on a GPU, unless turned off."""
    from .codegen import library
    return library.wanted(device_type, options.cublas)


def _parallel(options, example_inputs) -> bool:
    """Kernels compiled in parallel_compile's pool: on a GPU, unless turned off."""
    from .runtime.parallel_compile import enabled
    on_gpu = bool(example_inputs) and example_inputs[0].device.type == "cuda"
    return on_gpu and enabled(options.parallel_compile)


def _compile_kernels(module, infos, plan, inputs, parallel: bool, tuning: dict, report: dict) -> None:
    """The final module's kernels compiled in the pool before their first launch (where
    they are not the candidates compiled while choosing configurations: timed ones), and
    the ``compile`` stage: those seconds and the candidates' (compiled, or only loaded, and
    launched once). ``report["compile"]`` says what the pool did for each."""
    seconds = tuning.get("seconds", 0.0)
    outcomes = {"candidates": tuning.get("pool")}
    if parallel:
        from .runtime.parallel_compile import module_launches, precompile
        outcomes["module"] = precompile(module_launches(module, infos, plan, inputs))
        seconds += outcomes["module"].seconds
    report["seconds"]["compile"] = seconds
    outcomes = {k: o for k, o in outcomes.items() if o is not None}
    if outcomes:
        report["compile"] = {k: o.as_dict() for k, o in outcomes.items()}
        notes = list(dict.fromkeys(o.note for o in outcomes.values() if o.note))
        if notes:
            report["note"] = "; ".join([report["note"]] + notes if report.get("note") else notes)


def _drop_egraph(tr) -> None:
    """Free the translation's e-graph now, on this thread. Letting go of the reference is
    not enough: egglog 13.2 keeps the state that owns the Rust e-graph in reference cycles
    of its own (a recursive closure per ``run``), broken by a later garbage collection, on
    whichever thread runs it. The state lets go of the Rust object here; with an egglog
    laid out otherwise, a full collection on this thread does it."""
    egraph, tr.egraph = tr.egraph, None
    if egraph is None:
        return
    state = getattr(egraph, "_state", None)
    if state is not None and hasattr(state, "egraph"):
        state.egraph = None
    else:
        import gc
        gc.collect()


def _interpreter_ready() -> bool:
    import triton.language as tl
    return type(tl.sum).__name__ == "InterpretedFunction"


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except Exception:  # pragma: no cover - triton is a dependency
        return "none"


__all__ = ["EqfuseError", "build"]
