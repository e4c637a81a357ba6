"""K-major copies of TF32 right operands (eqfuse/codegen/kmajor.py), in one run.

    python benchmarks/matmul_tf32.py [--out results.json] [--size 2048]

``a @ b`` with a, b [size x size] float32 row-major and ``allow_tf32`` on: eqfuse with the
copy off (``EQFUSE_KMAJOR=0``, autotuned: what it ran before), on with autotune off (the
tile model's first choice) and on autotuned; against torch.matmul (cuBLAS) and
torch.compile. Times are medians of interleaved rounds (benchmarks/common.py); each
variant's kernels are listed with their configurations and their device times per call
from torch.profiler.
"""

from __future__ import annotations

import argparse
import os

import torch
from common import bench_interleaved, inductor_compiled, save_results
from matmul_split_k import kernel_device_us

import eqfuse
from eqfuse.codegen import kmajor


def mm(a, b):
    return a @ b


def compile_variant(inputs, switch: str, autotune: bool):
    os.environ[kmajor.ENV] = switch
    try:
        return eqfuse.compile(mm, inputs, autotune=autotune)
    finally:
        os.environ.pop(kmajor.ENV, None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--size", type=int, default=2048)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    size = args.size
    a = torch.randn(size, size, device="cuda") / size ** 0.25
    b = torch.randn(size, size, device="cuda") / size ** 0.25
    ref = a @ b
    variants = {"eqfuse k-major off (autotuned)": ("0", True), "eqfuse k-major, autotune off": ("1", False),
                "eqfuse k-major (autotuned)": ("1", True)}
    compiled, kernels, errors = {}, {}, {}
    for name, (switch, autotune) in variants.items():
        c = compile_variant([a, b], switch, autotune)
        got = c(a, b)
        errors[name] = ((got - ref).abs().max() / ref.abs().max()).item()
        compiled[name] = c
        kernels[name] = [{"name": k.name, "grid": list(k.grid), "config": {**k.constexprs, **k.launch},
                          "schedule": k.schedule.describe()} for k in c.kernels]
        print(name, kernels[name], f"rel err {errors[name]:.2e}", flush=True)
    inductor, inductor_s = inductor_compiled(mm, [a, b])
    fns = {"torch.matmul (cuBLAS)": lambda: mm(a, b), "torch.compile": lambda: inductor(a, b)}
    fns.update({name: (lambda c=c: c(a, b)) for name, c in compiled.items()})
    times = bench_interleaved(fns)
    flops = 2 * size ** 3
    row = {"workload": f"matmul {size}^3 fp32 (TF32), B row-major (N-major)",
           "us": {k: round(v, 1) for k, v in times.items()},
           "tflops": {k: round(flops / v / 1e6, 1) for k, v in times.items()},
           "max_rel_err": errors, "kernels": kernels,
           "kernel_device_us": {name: kernel_device_us(fns[name]) for name in compiled},
           "torch_compile_seconds": round(inductor_s, 2)}
    for k, v in times.items():
        print(f"{k:34s} {v:8.1f} us {flops / v / 1e6:6.1f} TFLOP/s", flush=True)
    print(row["kernel_device_us"], flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    save_results(args.out, [row], allow_tf32=True)
    return 0 if max(errors.values()) < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
