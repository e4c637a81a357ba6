"""Matrix products: eqfuse vs eager (cuBLAS) vs torch.compile, side by side in one run.

    python benchmarks/matmul.py [--out results.json] [--quick] [--only NAME,...] [--merge earlier.json]

Times are medians of ``triton.testing.do_bench`` (L2 flushed before each call), taken in
rounds that interleave the contenders (a GPU's clock drifts with its temperature over a
run; timing one contender after another would favour the first), then the median over
rounds. TFLOP/s counts 2*M*N*K per product. For the fused cases the time of cuBLAS's matmul alone is
reported too: the target is the fused kernel within 5% of it. Those three (eqfuse,
torch.compile, cuBLAS's matmul alone) are timed again in windows of 200 ms
(``sustained_200ms``): at an H100's power cap a fused kernel loses more to cuBLAS the
longer the load lasts (1.036-1.060x in 50-ms windows, 1.086-1.111x in 200-ms ones in
earlier runs). The autotuner's trials
(tile configurations it timed) are saved with their modelled times, so that the tile
model's ranking can be checked against the GPU (Spearman rank correlation per kernel).
The autotuner times as this benchmark does (interleaved rounds, after the GPU's clocks
settle under load: an H100 at its power cap runs large matmuls well below its boost
clock), so ``autotuned_us`` (its figure for the chosen configuration) and ``eqfuse_us``
should agree for single-kernel workloads. A configuration with ``PROGRAMS`` is the
persistent TMA form (eqfuse/codegen/tma.py). Where eqfuse runs a product as a cuBLAS call
(a plain product: eqfuse/codegen/library.py), the same graph compiled with ``cublas=False``
is timed beside it (``eqfuse_generated_us``): the product as eqfuse generates it.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from common import bench_interleaved, inductor_compiled, save_results, spearman

import eqfuse
from eqfuse.codegen import tiles
from eqfuse.examples import MATMUL_EXAMPLES, tolerance
from eqfuse.runtime import autotune

SUSTAINED_MS = 200.0  # the fused cases' second timing window


def gelu_linear(x, w, b):
    return F.gelu(x @ w + b)


def swiglu_mlp(x, w1, w3, w2):
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def mm(a, b):
    return a @ b


def workloads(quick: bool):
    s = 4 if quick else 1

    def rand(*shape, dtype):
        return lambda: torch.randn(*shape, dtype=dtype, device="cuda") / shape[-1] ** 0.25

    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    m, n, k = 8192 // s, 4096, 4096
    out = [("gelu(x@W+b) 8192x4096x4096 fp16", gelu_linear,
            [rand(m, k, dtype=f16), rand(k, n, dtype=f16), rand(n, dtype=f16)], 2 * m * n * k,
            lambda x, w, b: x @ w, False)]
    for dtype, name in ((f16, "fp16"), (bf16, "bf16")):
        for size in (1024, 4096, 8192):
            size //= s if size > 1024 else 1
            out.append((f"matmul {size}^3 {name}", mm, [rand(size, size, dtype=dtype), rand(size, size, dtype=dtype)],
                        2 * size ** 3, None, False))
    out.append(("matmul 2048^3 fp32 (TF32)", mm, [rand(2048, 2048, dtype=f32), rand(2048, 2048, dtype=f32)],
                2 * 2048 ** 3, None, True))
    t, h, i = 4096 // s, 4096, 11008
    out.append(("SwiGLU MLP Llama-7B (4096 tok) fp16", swiglu_mlp,
                [rand(t, h, dtype=f16), rand(h, i, dtype=f16), rand(h, i, dtype=f16), rand(i, h, dtype=f16)],
                3 * 2 * t * h * i, None, False))
    # int4 weights at three token counts: decoding (16), a short prompt (128), a long prompt
    # (4096), where the weights' dequantisation is amortised over the most rows.
    int4 = MATMUL_EXAMPLES["int4_matmul"]
    n = k = 4096
    for m in (16, 128, 4096 // s):
        packed = int4.make_inputs(m, n, k, f16, "cuda")
        name = "int4-dequantised matmul 4096^3 fp16" if m == 4096 else f"int4-dequantised matmul {m}x4096x4096 fp16"
        out.append((name, int4.fn, [lambda x=x: x for x in packed], 2 * m * n * k, None, False))
    return out


def autotuned_us(start: int, compiled) -> list:
    """Per kernel, what the autotuner measured for the configuration it chose (None if cached)."""
    chosen = {k.name: {key: v for key, v in (k.constexprs | k.launch).items() if key not in ("M", "N", "K")}
              for k in compiled.kernels}
    out = []
    for k in compiled.kernels:
        times = [round(us, 1) for name, _, cfg, us in autotune.trials[start:]
                 if name == k.name and cfg == chosen[k.name]]
        out.append(times[-1] if times else None)
    return out


def tile_model_check(start: int) -> list[dict]:
    """Per tuned matmul kernel: modelled vs measured time of each trial, and their rank correlation."""
    by_kernel: dict = {}
    for name, sched, cfg, us in autotune.trials[start:]:
        if sched.kind == "matmul":
            by_kernel.setdefault(name, []).append((cfg, us, tiles.modelled_time_us(sched, cfg)))
    return [{"kernel": name, "spearman": spearman([t[2] for t in rows], [t[1] for t in rows]),
             "trials": [{"config": c, "measured_us": round(us, 2), "modelled_us": round(mod, 2)}
                        for c, us, mod in rows]}
            for name, rows in by_kernel.items()]


def merged(path: str, rows: list, order: list) -> list:
    """``rows`` with the other workloads of an earlier results file, in the suite's order."""
    import json
    with open(path) as f:
        earlier = {r["workload"]: r for r in json.load(f)["results"]}
    earlier.update({r["workload"]: r for r in rows})
    return [earlier[name] for name in order if name in earlier]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default=None, help="comma-separated substrings of workload names to run")
    p.add_argument("--merge", default=None, help="a results file whose other workloads are kept, in order")
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    print(device, flush=True)
    rows = []
    for name, fn, makers, flops, core, tf32 in workloads(args.quick):
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        torch.backends.cuda.matmul.allow_tf32 = tf32
        inputs = [make() for make in makers]
        dtype = inputs[0].dtype
        ref = fn(*inputs)
        start = len(autotune.trials)
        t0 = time.perf_counter()
        compiled = eqfuse.compile(fn, inputs)
        eq_compile_s = time.perf_counter() - t0
        got = compiled(*inputs)
        rtol, _ = tolerance(dtype)
        if tf32:
            rtol = 1e-2  # TF32 keeps 10 mantissa bits; eager and eqfuse round differently
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        ok = err <= rtol * 4
        inductor, ind_compile_s = inductor_compiled(fn, inputs)
        contenders = {"eager": lambda: fn(*inputs), "inductor": lambda: inductor(*inputs),
                      "eqfuse": lambda: compiled(*inputs)}
        if core:
            contenders["core"] = lambda: core(*inputs)
        generated = None
        if compiled.library_calls:
            generated = eqfuse.compile(fn, inputs, cublas=False)
            contenders["generated"] = lambda: generated(*inputs)
        t = bench_interleaved(contenders)
        t_eager, t_ind, t_eq, t_core = t["eager"], t["inductor"], t["eqfuse"], t.get("core")
        s200 = None  # the 200-ms figures
        if core:
            long = bench_interleaved({k: contenders[k] for k in ("inductor", "eqfuse", "core")}, SUSTAINED_MS)
            s200 = {"torch_compile_us": round(long["inductor"], 1), "eqfuse_us": round(long["eqfuse"], 1),
                    "cublas_matmul_alone_us": round(long["core"], 1),
                    "eqfuse_over_cublas_matmul_alone": round(long["eqfuse"] / long["core"], 3)}
        tf = lambda us: round(flops / (us * 1e-6) / 1e12, 1)  # noqa: E731
        row = {"workload": name, "eager_us": round(t_eager, 1), "torch_compile_us": round(t_ind, 1),
               "eqfuse_us": round(t_eq, 1), "eager_tflops": tf(t_eager), "torch_compile_tflops": tf(t_ind),
               "eqfuse_tflops": tf(t_eq), "speedup_vs_eager": round(t_eager / t_eq, 3),
               "speedup_vs_torch_compile": round(t_ind / t_eq, 3),
               "cublas_matmul_alone_us": round(t_core, 1) if t_core else None,
               "eqfuse_over_cublas_matmul_alone": round(t_eq / t_core, 3) if t_core else None,
               "sustained_200ms": s200,
               "eqfuse_generated_us": round(t["generated"], 1) if generated else None,
               "kernels": len(compiled.kernels), "cublas_calls": len(compiled.library_calls),
               "fallbacks": len(compiled.fallbacks),
               "configs": [k.constexprs | k.launch for k in compiled.kernels],
               "autotuned_us": autotuned_us(start, compiled),
               "max_rel_err": err, "matches_eager": ok, "eqfuse_compile_s": round(eq_compile_s, 2),
               "torch_compile_compile_s": round(ind_compile_s, 2), "tile_model": tile_model_check(start)}
        rows.append(row)
        core_txt = f" cuBLAS mm alone {t_core:7.1f} ({t_eq / t_core:.3f}x)" if t_core else ""
        if s200:
            core_txt += (f" | 200-ms windows: eqfuse {s200['eqfuse_us']:.1f} inductor {s200['torch_compile_us']:.1f} "
                         f"cuBLAS mm alone {s200['cublas_matmul_alone_us']:.1f} "
                         f"({s200['eqfuse_over_cublas_matmul_alone']:.3f}x)")
        if generated:
            core_txt += f" generated {t['generated']:8.1f}"
        print(f"{name:38s} eager {t_eager:8.1f} ({tf(t_eager):5.1f} TF) inductor {t_ind:8.1f} ({tf(t_ind):5.1f}) "
              f"eqfuse {t_eq:8.1f} ({tf(t_eq):5.1f}){core_txt} kernels={len(compiled.kernels)}"
              f"+{len(compiled.library_calls)} cuBLAS ok={ok} "
              f"compile {eq_compile_s:.1f}s", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    extra = {}
    if args.merge:
        extra["merged"] = f"workloads {sorted(r['workload'] for r in rows)} from this run, the others from an " \
                          "earlier run (--merge)"
        rows = merged(args.merge, rows, [w[0] for w in workloads(args.quick)])
    save_results(args.out, rows, quick=args.quick, **extra)
    return 0 if all(r["matches_eager"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
