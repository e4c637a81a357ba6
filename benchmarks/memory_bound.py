"""Memory-bound workloads: eqfuse vs eager vs torch.compile, side by side in one run.

    python benchmarks/memory_bound.py [--out results.json] [--quick]

Two timings of each, both medians:

* per call: ``triton.testing.do_bench``, which flushes L2 before every call and times each
  call alone with events, so the ~4 us a launch costs on the GPU is included;
* back to back: ``triton.testing.do_bench_cudagraph``, calls replayed from a CUDA graph,
  the steady-state time of the kernels themselves.

The fraction of copy bandwidth is ideal bytes (each input read once, each output
written once) / time / measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import triton
import triton.testing
from common import inductor_compiled, save_results

import eqfuse
from eqfuse.examples import residual_layernorm, rmsnorm, softmax, swiglu, tolerance
from eqfuse.runtime.calibrate import copy_bytes_per_us


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    return copy_bytes_per_us() * 1e6


def workloads(quick: bool):
    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    scale = 4 if quick else 1

    def rms(rows, cols):
        return (lambda: (torch.randn(rows, cols, dtype=f16, device="cuda"),
                         torch.rand(cols, dtype=f16, device="cuda") + 0.5),
                (2 * rows * cols + cols) * 2)

    def sm(rows, cols):
        return (lambda: (torch.randn(rows, cols, dtype=f32, device="cuda"),), 2 * rows * cols * 4)

    def ln(rows, cols):
        return (lambda: (torch.randn(rows, cols, dtype=f16, device="cuda"),
                         torch.randn(rows, cols, dtype=f16, device="cuda"),
                         torch.rand(cols, dtype=f16, device="cuda") + 0.5,
                         torch.randn(cols, dtype=f16, device="cuda")),
                (4 * rows * cols + 2 * cols) * 2)

    def sw(rows, cols):
        return (lambda: (torch.randn(rows, cols, dtype=bf16, device="cuda"),
                         torch.randn(rows, cols, dtype=bf16, device="cuda")), 3 * rows * cols * 2)

    return [
        ("RMSNorm 4096x4096 fp16", rmsnorm, *rms(4096 // scale, 4096)),
        ("RMSNorm 8192x1536 fp16", rmsnorm, *rms(8192 // scale, 1536)),
        ("softmax 4096x4096 fp32", softmax, *sm(4096 // scale, 4096)),
        ("residual+LayerNorm 8192x4096 fp16", residual_layernorm, *ln(8192 // scale, 4096)),
        ("SwiGLU silu(a)*b 8192x11008 bf16", swiglu, *sw(8192 // scale, 11008)),
    ]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # us


def bench_graph(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3  # us


def check(got, ref, dtype):
    got = got if isinstance(got, tuple) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    rtol, atol = tolerance(dtype)
    return all(torch.allclose(g.float(), r.float(), rtol=rtol, atol=atol) for g, r in zip(got, ref))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    torch.manual_seed(0)
    bw = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for name, fn, make, ideal_bytes in workloads(args.quick):
        inputs = make()
        dtype = inputs[0].dtype
        ref = fn(*inputs)
        t0 = time.perf_counter()
        compiled = eqfuse.compile(fn, inputs)
        eq_compile_s = time.perf_counter() - t0
        ok = check(compiled(*inputs), ref, dtype)
        inductor, ind_compile_s = inductor_compiled(fn, inputs)
        t_eager, t_ind, t_eq = bench(lambda: fn(*inputs)), bench(lambda: inductor(*inputs)), \
            bench(lambda: compiled(*inputs))
        g_eager, g_ind, g_eq = bench_graph(lambda: fn(*inputs)), bench_graph(lambda: inductor(*inputs)), \
            bench_graph(lambda: compiled(*inputs))
        ideal_us = ideal_bytes / bw * 1e6
        row = {"workload": name, "eager_us": round(t_eager, 2), "torch_compile_us": round(t_ind, 2),
               "eqfuse_us": round(t_eq, 2), "ideal_us": round(ideal_us, 2),
               "eqfuse_fraction_of_copy_bw": round(ideal_us / t_eq, 3),
               "torch_compile_fraction_of_copy_bw": round(ideal_us / t_ind, 3),
               "back_to_back": {"eager_us": round(g_eager, 2), "torch_compile_us": round(g_ind, 2),
                                "eqfuse_us": round(g_eq, 2),
                                "eqfuse_fraction_of_copy_bw": round(ideal_us / g_eq, 3),
                                "torch_compile_fraction_of_copy_bw": round(ideal_us / g_ind, 3)},
               "speedup_vs_eager": round(t_eager / t_eq, 2), "speedup_vs_torch_compile": round(t_ind / t_eq, 3),
               "kernels": len(compiled.kernels), "configs": [k.constexprs | k.launch for k in compiled.kernels],
               "matches_eager": ok, "eqfuse_compile_s": round(eq_compile_s, 2),
               "torch_compile_compile_s": round(ind_compile_s, 2)}
        rows.append(row)
        print(f"{name:36s} per call: eager {t_eager:7.1f} inductor {t_ind:7.1f} eqfuse {t_eq:7.1f} "
              f"({100 * ideal_us / t_eq:5.1f}% bw) | back to back: eager {g_eager:7.1f} inductor {g_ind:7.1f} "
              f"eqfuse {g_eq:7.1f} ({100 * ideal_us / g_eq:5.1f}% bw) | ideal {ideal_us:6.1f} ok={ok}",
              flush=True)
    save_results(args.out, rows, copy_bandwidth_GBps=round(bw / 1e9, 1), quick=args.quick)
    return 0 if all(r["matches_eager"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
