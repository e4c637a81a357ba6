"""The whole pipeline, one step after another: capture -> terms -> saturation ->
extraction -> Triton source -> loaded module. Each step's product is kept for the user
to look at (``CompiledGraph.plan``, ``.source``, ``.report``)."""

from __future__ import annotations

import time

import torch

from .errors import EqfuseError, ExtractionError, Unsupported


def build(fn, example_inputs, options) -> dict:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from .frontend.capture import capture

    if _parallel(options, example_inputs):
        from .runtime.parallel_compile import prestart
        prestart()  # its workers start up while the graph is captured, saturated and extracted
    t0 = time.perf_counter()
    captured = capture(fn, example_inputs)
    seconds = {"capture": time.perf_counter() - t0}
    # AOTAutograd calls its compilers with its FakeTensorMode active. Everything after
    # capture computes on real tensors (compile-time mask analysis, validation, trial
    # launches on the GPU), so the mode is set aside.
    with unset_fake_temporarily():
        return _build_captured(fn, captured, example_inputs, options, seconds)


def _build_captured(fn, captured, example_inputs, options, seconds: dict) -> dict:
    from .codegen.module import generate_module
    from .rewrite.egraph_json import serialize
    from .rewrite.extract import Extractor
    from .rewrite.saturate import Limits, saturate
    from .rewrite.validate import mismatch
    from .runtime.cache import cache_key, load_module
    from .runtime.compiled import VERSION, FallbackInfo, make_fallback_runner
    from .schema.from_fx import translate

    device = example_inputs[0].device if example_inputs else torch.device("cpu")
    device_type = device.type
    parallel = _parallel(options, example_inputs)
    title = getattr(fn, "__name__", type(fn).__name__)
    result = {"constants": captured.constants, "out_spec": captured.out_spec, "device": device,
              "whole_graph_eager": False, "kernels": [], "fallbacks": [], "source": "", "plan": None,
              "report": {"seconds": seconds}}

    def eager(reason: str) -> dict:
        result["whole_graph_eager"] = True
        result["fallbacks"] = [FallbackInfo("<graph>", reason)]
        result["report"]["note"] = f"whole graph runs in eager: {reason}"
        return result

    mutating = [n for n in captured.gm.graph.nodes if n.op == "call_function"
                and getattr(getattr(n.target, "_schema", None), "is_mutable", False)]
    if mutating:
        return eager(f"in-place op {mutating[0].target} (mutation is not supported yet)")
    def extract_plan():
        t0 = time.perf_counter()
        tr = translate(captured)
        seconds["translate"] = time.perf_counter() - t0
        limits = Limits(max_enodes=options.max_enodes, max_seconds=options.max_seconds)
        sat = saturate(tr.egraph, limits, enabled=options.rules)
        seconds["saturate"] = sat.seconds
        t0 = time.perf_counter()
        try:
            view = serialize(tr.egraph)
            sat.enodes, sat.eclasses = view.size()
            plan, ext_report = Extractor(view, tr).extract()
        finally:
            # Dropped here, on the thread that made it: egglog's e-graph may only be freed on
            # its own thread, and the translation sits in reference cycles that the garbage
            # collector would break on whichever thread it runs (the autograd engine's compiles
            # a backward graph; the main thread collects it).
            _drop_egraph(tr)
        seconds["extract"] = time.perf_counter() - t0
        return plan, sat, ext_report

    # A plan that fails validation, or an e-graph the parser finds inconsistent (egglog
    # 13.2 once mixed up string arguments between terms: see terms.py), is built once
    # more from scratch; then the graph runs in eager with the reason.
    problem = None
    for _attempt in range(2):
        try:
            plan, sat, ext_report = extract_plan()
        except Unsupported as e:
            return eager(str(e))
        except ExtractionError as e:
            problem = f"no legal plan: {e}"
            if not e.retry:
                break
            continue
        if not options.validate:
            problem = None
            break
        t0 = time.perf_counter()
        try:
            mismatch_ = mismatch(plan, captured, make_fallback_runner)
        except Exception as e:  # noqa: BLE001 - a checker that cannot run has not checked
            mismatch_ = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        seconds["validate"] = time.perf_counter() - t0
        problem = mismatch_ and f"internal check failed, the extracted plan differs from the graph: {mismatch_}"
        if not problem:
            break
        result["report"].setdefault("retries", []).append(problem)
    if problem:
        return eager(problem)

    if device_type != "cuda" and not _interpreter_ready():
        return eager("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing triton")
    t0 = time.perf_counter()
    source, infos = generate_module(plan, title, VERSION)
    tuning: dict = {}  # seconds spent compiling and first launching kernels, and the pool's outcome
    if device_type == "cuda" and infos:
        from .runtime.autotune import NoRunnableConfig, choose_configs
        try:
            configs = choose_configs(plan, infos, title, VERSION, example_inputs, captured.constants,
                                     measure=options.autotune, parallel=parallel, stats=tuning)
        except NoRunnableConfig as e:
            return eager(str(e))
        source, infos = generate_module(plan, title, VERSION, configs)
    seconds["codegen"] = time.perf_counter() - t0 - tuning.get("seconds", 0.0)
    key = cache_key(source, device_type, VERSION, _triton_version())
    t0 = time.perf_counter()
    module = load_module(key, source, interpret=device_type != "cuda")
    seconds["load"] = time.perf_counter() - t0
    if device_type == "cuda" and infos:
        _compile_kernels(module, infos, plan, list(example_inputs) + list(captured.constants),
                         parallel, tuning, result["report"])
    result.update(
        kernels=infos, source=source, plan=plan, module=module, launch=module.call,
        fallback_runners=[make_fallback_runner(s) for s in plan.fallbacks],
        fallbacks=[FallbackInfo(s.node, s.reason) for s in plan.fallbacks],
    )
    result["report"].update(saturation=sat.as_dict(), extraction=ext_report)
    result["report"]["saturation"]["eclasses"] = sat.eclasses
    for k in seconds:
        seconds[k] = round(seconds[k], 4)
    return result


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
