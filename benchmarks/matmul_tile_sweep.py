"""The matmul tile model (eqfuse/codegen/tiles.py) against the GPU: every candidate timed.

    python benchmarks/matmul_tile_sweep.py [--out results.json] [--only NAME,...] [--top N]
                                           [--probe-tiles] [--no-inductor] [--budget-s S]
    python benchmarks/matmul_tile_sweep.py --rerank results.json   # on the CPU

For the products of GPT-2 and BERT training (8192 and 4096 tokens, hidden 768, MLP 3072,
fp16) with the epilogues the models give them, and a few Llama-sized products, eqfuse
compiles each workload with every tile configuration of ``tiles.candidates()`` timed by
the autotuner (its machinery: through the kernel's launcher, L2 flushed, candidates
interleaved over rounds after the clocks settle; eqfuse/runtime/autotune.py), and records
each candidate's measured and modelled time, the rank correlation of the two, and how far
the model's first choice is from the fastest. Beside them, in the same run: torch.mm
(cuBLAS, the product alone), the eager function, torch.compile, and the compiled graph.

``--top N`` times only the model's N best candidates (a confirmation run). ``--probe-tiles``
adds PROBE_TILES to the tile table for this run, to measure shapes the table lacks. Each
schedule's fields are saved, so a changed model can be re-ranked against the same
measurements offline (``--rerank``: per kernel, the current model's first choice among the
measured candidates against the fastest, and the rank correlation). Split-K (codegen/splitk.py) is off unless a workload
says otherwise: the single kernel is the tile model's question. Results are written after
each workload; ``--budget-s`` stops starting new workloads after that many seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

os.environ.setdefault("EQFUSE_PLAN_CACHE", "0")  # every workload is compiled and tuned here

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import bench_interleaved, inductor_compiled, save_results, spearman  # noqa: E402

import eqfuse  # noqa: E402
from eqfuse.codegen import configs, schedules, splitk, tiles  # noqa: E402
from eqfuse.examples import contraction_tolerance  # noqa: E402
from eqfuse.runtime import autotune  # noqa: E402

# Tile shapes the table may lack, measured with --probe-tiles: two programs per SM at
# 128 x 128 (fewer stages), thin tiles (64 x 256, 256 x 64), deeper pipelines, BLOCK_K 128.
PROBE_TILES = [
    (128, 256, 64, 8, 4),
    (256, 128, 64, 8, 4),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 3),
    (128, 128, 64, 8, 5),
    (128, 128, 128, 8, 3),
    (64, 256, 64, 4, 4),
    (64, 256, 64, 8, 3),
    (256, 64, 64, 4, 4),
    (128, 64, 128, 4, 3),
    (64, 128, 128, 4, 3),
]


# The workloads' functions: plain torch, as the models' graphs compute them. Weights are
# nn.Linear's [out, in]: the forward reads them transposed, the input gradient as stored.
def gelu_linear(x, w, b):
    return F.gelu(x @ w.t() + b, approximate="tanh")


def linear_residual(x, w, b, r):
    return x @ w.t() + b + r


def linear_bias(x, w, b):
    return x @ w.t() + b


def gelu_backward(dy, w, h):
    """The MLP's gradient through tanh-gelu: (dy @ w) * gelu'(h), h the saved pre-activation."""
    c = math.sqrt(2 / math.pi)
    hf = h.float()
    t = torch.tanh(c * (hf + 0.044715 * hf * hf * hf))
    slope = 0.5 * (1 + t) + 0.5 * hf * (1 - t * t) * c * (1 + 3 * 0.044715 * hf * hf)
    return ((dy @ w).float() * slope).to(h.dtype)


def mm(a, b):
    return a @ b


def weight_grad(a, b):
    return a.t() @ b


def swiglu(x, w1, w3):
    return F.silu(x @ w1.t()) * (x @ w3.t())


def workloads():
    """(name, fn, input shapes, the product alone (cuBLAS), split-K on)."""
    out = []
    for tokens, model in ((8192, "GPT-2"), (4096, "BERT")):
        t, h, f = tokens, 768, 3072
        out += [
            (f"{model} fc gelu(x@W^T+b) [{t}x{h}]@[{h}x{f}]", gelu_linear, [(t, h), (f, h), (f,)],
             lambda x, w, b: x @ w.t(), False),
            (f"{model} out x@W^T+b+r [{t}x{f}]@[{f}x{h}]", linear_residual, [(t, f), (h, f), (h,), (t, h)],
             lambda x, w, b, r: x @ w.t(), False),
            (f"{model} bwd (dY@W)*gelu'(h) [{t}x{h}]@[{h}x{f}]", gelu_backward, [(t, h), (h, f), (t, f)],
             lambda dy, w, h: dy @ w, False),
            (f"{model} bwd dH@W [{t}x{f}]@[{f}x{h}]", mm, [(t, f), (f, h)], None, False),
            (f"{model} wgrad a^T@b [{f}x{t}]@[{t}x{h}]", weight_grad, [(t, f), (t, h)], None, False),
            (f"{model} wgrad a^T@b [{h}x{t}]@[{t}x{f}]", weight_grad, [(t, h), (t, f)], None, False),
        ]
        if model == "GPT-2":
            out += [
                (f"{model} proj x@W^T+b+r [{t}x{h}]@[{h}x{h}]", linear_residual, [(t, h), (h, h), (h,), (t, h)],
                 lambda x, w, b, r: x @ w.t(), False),
                (f"{model} qkv x@W^T+b [{t}x{h}]@[{h}x{3 * h}]", linear_bias, [(t, h), (3 * h, h), (3 * h,)],
                 lambda x, w, b: x @ w.t(), False),
                (f"{model} wgrad a^T@b [{h}x{t}]@[{t}x{h}]", weight_grad, [(t, h), (t, h)], None, False),
                (f"{model} wgrad a^T@b [{3 * h}x{t}]@[{t}x{h}]", weight_grad, [(t, 3 * h), (t, h)], None, False),
                (f"{model} wgrad a^T@b [{h}x{t}]@[{t}x{h}] split-K on", weight_grad, [(t, h), (t, h)], None,
                 True),
            ]
        if model == "GPT-2":  # Llama-sized products next, so a short run still checks them
            out += [
                ("Llama mm [16384x4096]@[4096x4096]", mm, [(16384, 4096), (4096, 4096)], None, False),
                ("Llama silu(x@W1^T)*(x@W3^T) [8192x4096]@[4096x11008]", swiglu,
                 [(8192, 4096), (11008, 4096), (11008, 4096)], None, False),
            ]
    return out


def make_inputs(shapes):
    """fp16 inputs scaled so that products of K terms stay near 1."""
    return [torch.randn(*s, device="cuda", dtype=torch.float16) / s[-1] ** 0.25 for s in shapes]


def timing_every_candidate(top: int):
    """configs.tuning_candidates, patched to hand the autotuner every matmul candidate in the
    model's order (or its ``top`` best)."""
    real = configs.tuning_candidates

    def every(sched):
        if sched.kind != "matmul":
            return real(sched)
        ranked = tiles.ranked(sched)
        return ranked[:top] if top else ranked
    configs.tuning_candidates = every


def schedule_fields(sched) -> dict:
    return {f.name: getattr(sched, f.name) for f in dataclasses.fields(sched)
            if getattr(sched, f.name) not in ((), 0, False, "", None) or f.name in ("m", "n", "k")}


def tile_report(start: int) -> list[dict]:
    """Per tuned matmul kernel: every trial with its measured and modelled time and its place
    in the model's ranking, the rank correlation, and the model's first choice against the
    fastest."""
    by_kernel: dict = {}
    for name, sched, cfg, us in autotune.trials[start:]:
        if sched.kind == "matmul":
            by_kernel.setdefault(name, (sched, []))[1].append((cfg, us))
    out = []
    for name, (sched, runs) in by_kernel.items():
        ranked = tiles.ranked(sched)
        rows = [{"config": cfg, "measured_us": round(us, 2),
                 "modelled_us": round(tiles.modelled_time_us(sched, cfg), 2),
                 "model_rank": ranked.index(cfg) if cfg in ranked else None} for cfg, us in runs]
        best = min(rows, key=lambda r: r["measured_us"])
        first = next((r for r in rows if r["model_rank"] == 0), None)
        out.append({"kernel": name, "schedule": schedule_fields(sched), "describe": sched.describe(),
                    "spearman": spearman([r["modelled_us"] for r in rows], [r["measured_us"] for r in rows]),
                    "best": best, "model_first": first,
                    "first_over_best": round(first["measured_us"] / best["measured_us"], 3) if first else None,
                    "trials": rows})
    return out


def measure(name, fn, shapes, core, split, inductor_on: bool) -> dict:
    torch.manual_seed(0)
    inputs = make_inputs(shapes)
    ref = fn(*inputs)
    os.environ[splitk.ENV] = "1" if split else "0"
    start = len(autotune.trials)
    t0 = time.perf_counter()
    try:
        compiled = eqfuse.compile(fn, inputs)
    finally:
        os.environ.pop(splitk.ENV, None)
    compile_s = time.perf_counter() - t0
    rtol, atol = contraction_tolerance(torch.float16, ref)
    got = compiled(*inputs)
    ok = bool(torch.allclose(got.float(), ref.float(), rtol=rtol, atol=atol))
    contenders = {"eager": lambda: fn(*inputs), "eqfuse (fastest candidate)": lambda: compiled(*inputs)}
    if core:
        contenders["torch.mm (product alone)"] = lambda: core(*inputs)
    inductor_s = None
    if inductor_on:
        inductor, inductor_s = inductor_compiled(fn, inputs)
        contenders["torch.compile"] = lambda: inductor(*inputs)
    us = bench_interleaved(contenders)
    report = tile_report(start)
    row = {"workload": name, "shapes": shapes, "split_k": split, "matches_eager": ok,
           "us": {k: round(v, 2) for k, v in us.items()}, "kernels": [k.name for k in compiled.kernels],
           "eqfuse_compile_s": round(compile_s, 1),
           "torch_compile_compile_s": round(inductor_s, 1) if inductor_s else None, "tile_model": report}
    for k in report:
        first = k["model_first"]["measured_us"] if k["model_first"] else float("nan")
        print(f"{name}: {k['kernel']} {k['describe']}: {len(k['trials'])} trials, spearman {k['spearman']:.2f}, "
              f"model's first {first:.1f} us, best {k['best']['measured_us']:.1f} ({k['best']['config']})",
              flush=True)
    print(f"    {row['us']} ok={ok} compile {compile_s:.1f}s", flush=True)
    return row


def rerank(path: str) -> list[dict]:
    """The current tile model on an earlier run's measurements: per kernel, its first choice
    among the candidates measured there, that choice's time over the fastest's, and the
    rank correlation of modelled and measured times. The device as recorded (SMs, the
    TMA form, the model's figures)."""
    import json

    from eqfuse.codegen import tma
    from eqfuse.rewrite.cost import Device

    with open(path) as f:
        run = json.load(f)
    run = run.get("run1", run)  # the committed file holds the full sweep as run1
    tma.device_supports, tma.sm_count = (lambda: True), (lambda: run["sms"])
    device = Device(**run["device_model"])
    key = lambda cfg: tuple(sorted(cfg.items()))  # noqa: E731
    out = []
    for row in run["results"]:
        for k in row["tile_model"]:
            sched = schedules.Schedule(**{**k["schedule"], "batch": tuple(k["schedule"].get("batch", ()))})
            measured = {key(t["config"]): t["measured_us"] for t in k["trials"]}
            ranked = [c for c in tiles.ranked(sched, device) if key(c) in measured]
            times = [measured[key(c)] for c in ranked]
            modelled = [tiles.modelled_time_us(sched, c, device) for c in ranked]
            out.append({"workload": row["workload"], "kernel": k["kernel"], "first": ranked[0],
                        "first_us": times[0], "best_us": min(times), "first_over_best": round(times[0] / min(times), 3),
                        "spearman": spearman(modelled, times), "candidates": len(ranked)})
            print(f"{row['workload'][:58]:58s} first {times[0]:7.1f} best {min(times):7.1f} "
                  f"x{times[0] / min(times):.3f} spearman {out[-1]['spearman']:.2f} ({len(ranked)} measured)")
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--only", default=None, help="comma-separated substrings of workload names to run")
    p.add_argument("--top", type=int, default=0, help="time only the model's N best candidates")
    p.add_argument("--probe-tiles", action="store_true", help="add PROBE_TILES to the tile table")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--budget-s", type=float, default=0, help="start no workload after this many seconds")
    p.add_argument("--rerank", default=None, help="an earlier results file: its measurements, the current model")
    args = p.parse_args(argv)
    if args.rerank:
        rerank(args.rerank)
        return 0
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    began = time.perf_counter()
    autotune.REP_MS = 10  # each candidate's do_bench window (of 3 rounds): products of 20-2000 us
    if args.probe_tiles:
        tiles.TILES = tiles.TILES + [t for t in PROBE_TILES if t not in tiles.TILES]
    timing_every_candidate(args.top)
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for name, fn, shapes, core, split in workloads():
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        if args.budget_s and time.perf_counter() - began > args.budget_s:
            print(f"budget spent: {name} and later not run", flush=True)
            break
        rows.append(measure(name, fn, shapes, core, split, not args.no_inductor))
        save_results(args.out, rows, autotune=True, top=args.top, probe_tiles=args.probe_tiles,
                     tiles=tiles.TILES, device_model=dataclasses.asdict(tiles.device_model()),
                     sms=tiles.tma.sm_count())
    return 0 if all(r["matches_eager"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
