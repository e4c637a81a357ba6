"""The model zoo on a GPU: Hugging Face transformers families at published sizes (a few
layers each), eager vs torch.compile vs eqfuse in one process.

    python benchmarks/zoo.py [--families llama gpt2 ...] [--modes infer train generate] [--layers 2]
                             [--warm] [--out results.json]

Each family (eqfuse/zoo.py: random weights, bf16) runs as its users run it: default
arguments (SDPA attention, the KV cache on) for inference (the prompt: decoders at batch
4 x 1024 tokens, encoders and encoder-decoders at 8 x 512, ViT at 32 images), and a
training step (``labels=``, ``loss.backward()``, train mode) at the same sizes, with
dropout off: a GPU's fused attention draws its dropout masks by its own generator
offsets, so that no two backends' steps are comparable with it on; and for decoders,
``generate`` mode: ``model.generate`` (greedy, KV cache on) of GENERATE_TOKENS tokens
after a prompt of GENERATE_PROMPT at batch 1 (``--prompt``, ``--batch``), the forward compiled as transformers'
docs compile it, and ``static`` mode: the same with transformers' static cache, its decode
step compiled by transformers itself (``compile_config``, mode "reduce-overhead": CUDA
graphs) as its docs advise for speed (a generation's pass: every token as eager's up to
the first that differs, and that one a near-tie in eager's logits: within TIE of the largest). Reported per family,
mode and contender, as Inductor's dashboard reports them: whether the compiled output is
as close to a float32 evaluation of the model as eager's (the pass rate), the median
time of a call (triton.testing.do_bench in interleaved rounds, L2 flushed), the speedups
over eager and over torch.compile, compile seconds cold (the first call; each
contender's caches start empty) and, with ``--warm``, warm (compiled again after
torch._dynamo.reset), the memory peak of a call, and for eqfuse the kernels and eager
steps of its graphs; with ``--profile``, each contender's GPU kernels per call
(torch.profiler), most time first, its host's side of a call (``host_table``) and
where the GPU waits inside one (``idle_table``).
eqfuse compiles with autotune off (the tile model's first choice) unless
``--autotune``. ``benchmarks/zoo_wheels.sh`` gathers the wheels a GPU machine needs
(egglog, and transformers at the dev extra's pin). The last lines printed are the summary table and the geomeans.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import tempfile
import time
import traceback

for var in ("EQFUSE_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):  # cold means cold
    os.environ.setdefault(var, tempfile.mkdtemp(prefix=var.lower() + "-"))

import torch  # noqa: E402
from common import bench_rounds, save_results  # noqa: E402

import eqfuse.backend  # noqa: E402
from eqfuse import zoo  # noqa: E402

# (batch, tokens) by the kind of model; ViT: (images, -)
SIZES = {zoo.DECODER: (4, 1024), zoo.ENCODER: (8, 512), zoo.SEQ2SEQ: (8, 512), zoo.VISION: (32, 0)}
# A compiled call passes where its output is no further from a float32 evaluation of the
# model than twice eager's distance plus one bf16 rounding (relative L2 norms), as
# Inductor's accuracy check judges against float64: a mixture of experts routes a few
# tokens that tie within bf16's rounding to another expert in any backend that rounds
# differently (Mixtral: Inductor's and eqfuse's logits 0.46-0.96 off eager's at the
# largest element), and eager's own routing differs from float32's as much.
PASS_SLACK = 2.0 ** -8
# Greedy decoding in bf16 on random weights meets near-ties: two tokens whose logits lie
# within a few bf16 roundings of each other, which any backend that rounds differently
# may flip (GPT-2: Inductor and eqfuse both take the other token at the same step). A
# generation passes where the first token that differs from eager's is within TIE of
# eager's choice (relative to the step's largest logit); after it the sequences differ
# and nothing further is comparable.
TIE = 2.0 ** -6


def contenders(autotune: bool, recompute: bool = False, whole: bool = False) -> dict:
    """eager, torch.compile, eqfuse; with ``whole``, eqfuse compiling each graph whole too
    (``share_layers=False``: its identical layers compiled once each)."""
    options = {"autotune": autotune, "recompute": recompute}
    found = {"eager": None, "torch.compile": {}, "eqfuse": {"backend": "eqfuse", "options": options}}
    if whole:
        found["eqfuse (whole)"] = {"backend": "eqfuse", "options": {**options, "share_layers": False}}
    return found


GENERATE_PROMPT, GENERATE_TOKENS = 128, 32
GENERATING = ("generate", "static")  # the modes that call model.generate: its dynamic cache, its static cache


def generation(prompt: torch.Tensor, static: bool) -> dict:
    """``model.generate``'s arguments: greedy, GENERATE_TOKENS new tokens; ``static``: with
    transformers' static cache (fixed shapes, the position a tensor)."""
    found = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=GENERATE_TOKENS,
                 min_new_tokens=GENERATE_TOKENS, do_sample=False)
    return {**found, "cache_implementation": "static"} if static else found


def generate_fn(model, prompt: torch.Tensor, how: dict | None, static: bool = False):
    """``model.generate`` compiled by ``how`` (None: eager) as transformers' docs compile it:
    its forward (put back after each call, so that the contenders share one model); with
    the static cache, transformers' own compile of the decode step (``compile_config``:
    torch.compile's mode "reduce-overhead", CUDA graphs, unless autotuning)."""
    kwargs = {**generation(prompt, static), "pad_token_id": model.config.eos_token_id}
    compiled = None
    if static:
        from transformers import CompileConfig

        kwargs["disable_compile"] = how is None
        how = how or {}
        mode = "max-autotune" if how.get("options", {}).get("autotune") else "reduce-overhead"
        kwargs["compile_config"] = CompileConfig(backend=how.get("backend", "inductor"), mode=mode)
    elif how is not None:
        compiled = torch.compile(model.forward, **how)

    def generate():
        if compiled is not None:
            model.forward = compiled
        try:
            with torch.no_grad():
                return model.generate(prompt, **kwargs)
        finally:
            model.__dict__.pop("forward", None)  # the class's forward again
    return generate


def eager_scores(model, prompt: torch.Tensor, static: bool) -> tuple:
    """Eager's logits at each generated step (greedy; the tokens the reference chose)."""
    with torch.no_grad():
        return model.generate(prompt, **generation(prompt, static), pad_token_id=model.config.eos_token_id,
                              disable_compile=True, output_scores=True, return_dict_in_generate=True).scores


def judge_tokens(out: torch.Tensor, reference: torch.Tensor, scores: tuple | None) -> dict:
    """tokens_as_eager (the share of equal tokens), and the pass: equal throughout, or the
    first difference a near-tie in eager's logits at that step (``tie_margin``: eager's
    best logit less its logit of the token chosen instead, over the largest |logit|; ``scores``
    may be None where the tokens are equal)."""
    found = {"tokens_as_eager": round((out == reference).float().mean().item(), 3)}
    differ = (out != reference).any(0).nonzero()
    if len(differ) == 0:
        return {**found, "pass": True}
    column = differ[0].item()
    step = column - (reference.shape[1] - len(scores))
    logits = scores[step].float()
    row = (out[:, column] != reference[:, column]).nonzero()[0].item()
    finite = logits[row][logits[row].isfinite()]
    chosen, taken = int(reference[row, column]), int(out[row, column])
    margin = (logits[row, chosen] - logits[row, taken]).item() / finite.abs().max().item()
    return {**found, "first_difference": step, "tie_margin": float(f"{margin:.3g}"), "pass": bool(margin <= TIE)}


def call_fn(model, kwargs: dict, how: dict | None, mode: str):
    """The call a contender (``how``: torch.compile's arguments, None for eager) is timed on."""
    if mode in GENERATING:
        return generate_fn(model, kwargs["input_ids"], how, static=mode == "static")
    return step_fn(model if how is None else torch.compile(model, **how), kwargs, mode == "train")


def step_fn(model, kwargs: dict, training: bool):
    if training:
        def train():
            model.zero_grad(set_to_none=True)
            loss = model(**kwargs).loss
            loss.backward()
            return loss
        return train

    def infer():
        with torch.no_grad():
            return zoo.main_output(model(**kwargs))
    return infer


def float32_output(model, kwargs: dict, training: bool) -> torch.Tensor:
    """The model's output (the loss, for a training step) computed in float32 from the same
    weights and inputs: the reference of the pass rate."""
    import copy

    wide = copy.deepcopy(model).float()
    wide_kwargs = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
    torch.manual_seed(0)
    with torch.no_grad():
        out = wide(**wide_kwargs).loss if training else zoo.main_output(wide(**wide_kwargs))
    out = out.detach().float()
    del wide
    torch.cuda.empty_cache()
    return out


def relative_l2(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got - exact).norm() / exact.norm().clamp_min(1e-30)).item()


def timed_first(fn):
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out.detach().float()


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round(torch.cuda.max_memory_allocated() / 2**20, 1)


def eqfuse_graphs() -> dict:
    graphs = list(eqfuse.backend.history)
    steps = sorted({f.op for g in graphs for f in g.fallbacks})
    whole = [f.reason for g in graphs for f in g.fallbacks if f.node == "<graph>"]
    return {"graphs": len(graphs), "kernels": sum(len(g.kernels) for g in graphs),
            "cublas_calls": sum(len(g.library_calls) for g in graphs), "eager_ops": steps,
            "graphs_wholly_eager": whole, "compile_phases_s": compile_phases(graphs),
            "cuda_graph_replays": cuda_graph_replays(graphs), "explain": [g.explain() for g in graphs]}


def cuda_graph_replays(graphs) -> int:
    """Calls served by replaying a CUDA graph so far, over the graphs and their parts."""
    found, todo = 0, list(graphs)
    while todo:
        g = todo.pop()
        found += getattr(getattr(g, "graphs", None), "replays", 0)
        todo += getattr(g, "compiled", None) or []
    return found


def compile_phases(graphs) -> dict:
    """Seconds of each phase of eqfuse's builds (capture, plan_cache, saturate, extract,
    validate, codegen, compile, ...), summed over its graphs and their parts; the rest of
    a first call is dynamo's and AOTAutograd's, and the call itself."""
    total: collections.Counter = collections.Counter()
    for g in graphs:  # a graph in parts sums its parts' (LayeredGraph.report)
        total.update(g.report.get("seconds", {}))
    return {k: round(v, 2) for k, v in total.items()}


def run_family(family: zoo.Family, mode: str, args) -> dict:
    training, generating = mode == "train", mode in GENERATING
    batch, seq = (args.batch, args.prompt) if generating else SIZES[family.kind]
    model = zoo.family_model(family, train=training, sizes=family.published, layers=args.layers, dtype=torch.bfloat16,
                             device="cuda", dropout=False)
    if training:
        model.train()
    kwargs = zoo.inputs(family, model, batch=batch, seq=seq, labels=training)
    row = {"family": family.name, "mode": mode, "model": family.train_model if training else family.model,
           "batch": batch, "seq": seq, "layers": args.layers,
           "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1), "contenders": {}}
    if generating:
        row["new_tokens"] = GENERATE_TOKENS
    exact = None if generating else float32_output(model, kwargs, training)
    fns, reference, scores = {}, None, None  # scores: eager's logits per step, made once where a generation differs
    for name, how in contenders(args.autotune, args.recompute, args.whole).items():
        entry = row["contenders"][name] = {}
        try:
            torch._dynamo.reset()
            eqfuse.backend.history.clear()
            fn = call_fn(model, kwargs, how, mode)
            torch.manual_seed(0)
            seconds, out = timed_first(fn)
            if not generating:
                entry["rel_err_vs_fp32"] = float(f"{relative_l2(out, exact):.3g}")
            if how is None:
                reference = out
            elif generating:
                entry["compile_s_cold"] = round(seconds, 2)
                if scores is None and not torch.equal(out, reference):
                    scores = eager_scores(model, kwargs["input_ids"], mode == "static")
                entry.update(judge_tokens(out, reference, scores))
            else:
                entry["compile_s_cold"] = round(seconds, 2)
                err = ((out - reference).abs().max() / reference.abs().max().clamp_min(1e-6)).item()
                entry["max_rel_err"] = float(f"{err:.3g}")
                eager_err = row["contenders"]["eager"]["rel_err_vs_fp32"]
                entry["pass"] = bool(entry["rel_err_vs_fp32"] <= 2 * eager_err + PASS_SLACK)
            if name.startswith("eqfuse"):
                entry.update(eqfuse_graphs())
            if args.warm and how is not None:
                torch._dynamo.reset()
                eqfuse.backend.history.clear()
                warm = call_fn(model, kwargs, how, mode)
                entry["compile_s_warm"] = round(timed_first(warm)[0], 2)
                if name.startswith("eqfuse"):
                    entry["compile_phases_s_warm"] = compile_phases(eqfuse.backend.history)
                fn = warm
            entry["peak_mib"] = peak_mib(fn)
            fns[name] = fn
        except Exception as e:  # noqa: BLE001 - a contender that fails is reported, not fatal
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            entry["pass"] = False
            traceback.print_exc()
    if args.profile:
        row["profile"] = {name: kernel_table(fn) for name, fn in fns.items()}
        row["host"] = {name: host_table(fn) for name, fn in fns.items()}
        row["idle"] = {name: idle_table(fn) for name, fn in fns.items()}
    if not args.no_timing and fns:
        rounds = bench_rounds(fns)
        us = {name: sorted(ts)[len(ts) // 2] for name, ts in rounds.items()}
        for name, t in us.items():
            row["contenders"][name]["us"] = round(t, 1)
            row["contenders"][name]["us_rounds"] = rounds[name]
        for name in us:
            c = row["contenders"][name]
            c["speedup_vs_eager"] = round(us["eager"] / us[name], 3) if "eager" in us else None
            if "torch.compile" in us:
                c["speedup_vs_torch_compile"] = round(us["torch.compile"] / us[name], 3)
    del model, fns
    torch.cuda.empty_cache()
    return row


def kernel_table(fn, calls: int = 3, top: int = 40) -> list:
    """The GPU kernels of ``calls`` calls (torch.profiler), most time first: [name, us per call, count per call]."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / calls
    rows = [[e.key[:90], round(e.device_time_total / calls, 1), e.count // calls] for e in events[:top]]
    return [["<all kernels>", round(total, 1), sum(e.count for e in events) // calls]] + rows


def idle_table(fn, calls: int = 3, top: int = 12) -> dict:
    """Where the GPU waits inside a call: the sum of the gaps between one kernel's end and
    the next one's start over ``calls`` calls back to back (per call), and the largest
    gaps with the kernels on either side: [us, kernel before, kernel after]. A call whose
    kernels sum well below its time spends the rest here (a synchronisation, a host that
    falls behind, a CUDA graph's launch)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps, end, before = [], None, None
    for start, stop, name in kernels:
        if end is not None and start > end:
            gaps.append([round(start - end, 1), before[:70], name[:70]])
        if end is None or stop > end:
            end, before = stop, name
    gaps.sort(key=lambda g: -g[0])
    span = (kernels[-1][1] - kernels[0][0]) / calls if kernels else 0.0
    return {"span_us": round(span, 1), "idle_us": round(sum(g[0] for g in gaps) / calls, 1),
            "largest": gaps[:top]}


def host_table(fn, calls: int = 5, top: int = 8) -> dict:
    """Where a call's time goes outside the GPU's kernels: the host's time to issue a call
    (``calls`` calls without a sync between them), the wall time of a synced call, and the
    CUDA runtime calls the host makes in one, most host time first: [name, us per call,
    count per call]. A call whose wall time is far above its kernels' sum and close to its
    host time is bound by the host; a runtime call that waits (a synchronisation, a
    ``cudaMalloc``) shows here."""
    import time

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    runtime = [e for e in prof.key_averages() if e.key.startswith("cuda")]
    runtime.sort(key=lambda e: -e.self_cpu_time_total)
    return {"host_us": round((issued - start) * 1e6 / calls, 1), "wall_us": round((done - start) * 1e6 / calls, 1),
            "runtime": [[e.key, round(e.self_cpu_time_total / calls, 1), e.count // calls] for e in runtime[:top]]}


def geomean(xs):
    xs = [x for x in xs if x]
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 3) if xs else None


def summary(rows: list) -> dict:
    out = {}
    for mode in sorted({r["mode"] for r in rows}):
        mine = [r["contenders"].get("eqfuse", {}) for r in rows if r["mode"] == mode]
        out[mode] = {"families": len(mine), "pass_rate": round(sum(bool(c.get("pass")) for c in mine) / len(mine), 3),
                     "geomean_vs_eager": geomean([c.get("speedup_vs_eager") for c in mine]),
                     "geomean_vs_torch_compile": geomean([c.get("speedup_vs_torch_compile") for c in mine])}
    return out


def table(rows: list) -> str:
    lines = [f"{'family':10} {'mode':5} {'eager us':>9} {'inductor':>9} {'eqfuse':>9} {'vs ind':>6} {'vs eag':>6} "
             f"{'cold s ind/eqf':>14} {'kern':>4} pass  eager ops"]
    for r in rows:
        c = r["contenders"]
        e, i, q = c.get("eager", {}), c.get("torch.compile", {}), c.get("eqfuse", {})
        lines.append(f"{r['family']:10} {r['mode']:5} {e.get('us', '-'):>9} {i.get('us', '-'):>9} "
                     f"{q.get('us', '-'):>9} "
                     f"{q.get('speedup_vs_torch_compile', '-'):>6} {q.get('speedup_vs_eager', '-'):>6} "
                     f"{str(i.get('compile_s_cold', '-')) + '/' + str(q.get('compile_s_cold', '-')):>14} "
                     f"{q.get('kernels', '-'):>4} {'yes ' if q.get('pass') else 'NO  '} "
                     f"{','.join(q.get('eager_ops', [])) or q.get('error', '')}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=[f.name for f in zoo.FAMILIES])
    ap.add_argument("--modes", nargs="+", default=["infer", "train"], choices=["infer", "train", *GENERATING])
    ap.add_argument("--layers", type=int, default=2, help="layers of each model (0: as published)")
    ap.add_argument("--warm", action="store_true", help="also time a second compile with warm caches")
    ap.add_argument("--autotune", action="store_true")
    ap.add_argument("--recompute", action="store_true", help="eqfuse's backend option: the min-cut partitioner")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--whole", action="store_true",
                    help="also eqfuse with each graph compiled whole (share_layers=False), from 3 layers on")
    ap.add_argument("--profile", action="store_true", help="the kernels of each contender's call (torch.profiler)")
    ap.add_argument("--prompt", type=int, default=GENERATE_PROMPT,
                    help="generate, static: the prompt's tokens (a static cache holds them and the new ones)")
    ap.add_argument("--batch", type=int, default=1, help="generate, static: the sequences generated at once")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for mode in args.modes:
        for name in args.families:
            if mode in GENERATING and zoo.BY_NAME[name].kind != zoo.DECODER:
                continue
            t0 = time.perf_counter()
            rows.append(run_family(zoo.BY_NAME[name], mode, args))
            print(f"{name} {mode}: {time.perf_counter() - t0:.0f} s", flush=True)
            save_results(args.out, rows, summary=summary(rows), layers=args.layers, autotune=args.autotune,
                         transformers=zoo._transformers().__version__)
    print(table(rows))
    print(summary(rows))


if __name__ == "__main__":
    main()
