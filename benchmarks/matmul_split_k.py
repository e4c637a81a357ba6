"""Split-K (eqfuse/codegen/splitk.py) on GPT-2's weight-gradient products, in one run.

    python benchmarks/matmul_split_k.py [--out results.json] [--chunks 2 4 8]

``lambda a, b: a.t() @ b`` with fp16 a [8192, M] and b [8192, N] (the tokens of batch 8 x
sequence 1024 as K): eqfuse compiled with split-K off (``EQFUSE_SPLIT_K=0``, the single
kernel), on (the model's choice of S), and, with ``--chunks``, forced to each given S;
against torch.mm (cuBLAS) and torch.compile. Autotune off: the tile model's first choice
for every kernel. Times are medians of interleaved rounds (benchmarks/common.py); each
eqfuse variant's kernels are listed with their grids and configurations, and their device
times per call from torch.profiler.
"""

from __future__ import annotations

import argparse
import os

os.environ["EQFUSE_PLAN_CACHE"] = "0"  # forced chunk counts are not in the plan cache's key

import torch  # noqa: E402
from common import bench_interleaved, inductor_compiled, save_results  # noqa: E402

import eqfuse  # noqa: E402
from eqfuse.codegen import splitk  # noqa: E402
from eqfuse.examples import contraction_tolerance  # noqa: E402

TOKENS = 8192
SHAPES = [(768, 768), (3072, 768), (768, 3072)]  # (M, N): a [TOKENS, M], b [TOKENS, N]


def weight_grad(a, b):
    return a.t() @ b


def compile_variant(inputs, switch: str, chunks: int = 0):
    """eqfuse's compile with split-K ``switch`` ("0"/"1") and ``chunks`` forced (0: the model's)."""
    os.environ[splitk.ENV] = switch
    splitk.FORCE_CHUNKS = chunks
    try:
        return eqfuse.compile(weight_grad, inputs, autotune=False)
    finally:
        splitk.FORCE_CHUNKS = 0
        os.environ.pop(splitk.ENV, None)


def kernel_device_us(fn, calls: int = 20) -> dict:
    """Kernel name -> device microseconds per call (torch.profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.key] = round(e.device_time_total / calls, 2)
    return out


def measure(m: int, n: int, chunk_counts: list) -> dict:
    torch.manual_seed(0)
    a = torch.randn(TOKENS, m, device="cuda", dtype=torch.float16) / 8
    b = torch.randn(TOKENS, n, device="cuda", dtype=torch.float16) / 8
    ref = weight_grad(a, b)
    rtol, atol = contraction_tolerance(torch.float16, ref)
    variants = {"eqfuse split-K off": ("0", 0), "eqfuse split-K on": ("1", 0)}
    variants.update({f"eqfuse S={s}": ("1", s) for s in chunk_counts})
    compiled, kernels = {}, {}
    for name, (switch, chunks) in variants.items():
        c = compile_variant([a, b], switch, chunks)
        torch.testing.assert_close(c(a, b), ref, rtol=rtol, atol=atol)
        compiled[name] = c
        kernels[name] = [{"name": k.name, "grid": list(k.grid), "config": {**k.constexprs, **k.launch},
                          "schedule": k.schedule.describe()} for k in c.kernels]
    inductor, inductor_s = inductor_compiled(weight_grad, [a, b])
    fns = {"torch.mm": lambda: weight_grad(a, b), "torch.compile": lambda: inductor(a, b)}
    fns.update({name: (lambda c=c: c(a, b)) for name, c in compiled.items()})
    times = bench_interleaved(fns)
    flops = 2 * m * n * TOKENS
    row = {"shape": f"[{m} x {TOKENS}] @ [{TOKENS} x {n}] fp16", "m": m, "n": n, "k": TOKENS,
           "us": {k: round(v, 2) for k, v in times.items()},
           "tflops": {k: round(flops / v / 1e6, 1) for k, v in times.items()},
           "kernels": kernels,
           "kernel_device_us": {name: kernel_device_us(fns[name]) for name in compiled},
           "torch_compile_seconds": round(inductor_s, 2)}
    print(row["shape"], {k: round(v, 1) for k, v in times.items()}, flush=True)
    for name in compiled:
        print("   ", name, [(k["name"], k["grid"], k["config"]) for k in kernels[name]],
              row["kernel_device_us"][name], flush=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--chunks", nargs="*", type=int, default=[], help="also compile with S forced to each")
    args = p.parse_args()
    rows = []
    for m, n in SHAPES:
        rows.append(measure(m, n, args.chunks))
        save_results(args.out, rows, workload="a.t() @ b, a [8192, M], b [8192, N], fp16", autotune=False)


if __name__ == "__main__":
    main()
