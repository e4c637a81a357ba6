"""Time every launch configuration of one example's kernel on the GPU, to see what the
autotuner chooses from and how far the best is from the copy-bandwidth floor.

    python benchmarks/sweep_configs.py rmsnorm 4096 4096 float16
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton
import triton.testing

import eqfuse
from eqfuse.codegen.module import generate_module
from eqfuse.examples import EXAMPLES, tolerance
from eqfuse.runtime.cache import cache_key, load_module


def main(name="rmsnorm", rows=4096, cols=4096, dtype="float16"):
    rows, cols, dtype = int(rows), int(cols), getattr(torch, dtype)
    ex = EXAMPLES[name]
    torch.manual_seed(0)
    inputs = ex.make_inputs(rows, cols, dtype, "cuda")
    compiled = eqfuse.compile(ex.fn, inputs, autotune=False)
    (k,) = compiled.kernels
    ref = ex.fn(*inputs)
    nbytes = sum(x.numel() * x.element_size() for x in inputs)
    outs = ref if isinstance(ref, tuple) else (ref,)
    nbytes += sum(o.numel() * o.element_size() for o in outs)
    src = torch.randn(1 << 26, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)
    floor_us = nbytes / bw * 1e6
    print(f"{name} {rows}x{cols} {dtype}: {nbytes / 1e6:.1f} MB, floor {floor_us:.1f} us at {bw / 1e9:.0f} GB/s")
    block_c = k.constexprs["BLOCK_C"]
    results = []
    for br, warps in itertools.product((1, 2, 4, 8), (2, 4, 8, 16, 32)):
        cfg = {"BLOCK_R": br, "BLOCK_C": block_c, "num_warps": warps}
        source, infos = generate_module(compiled.plan, name, "sweep", {k.name: cfg})
        try:
            mod = load_module(cache_key(source), source, interpret=False)
            def call(mod=mod):
                return mod.call(inputs[0].device, [], *inputs)
            got = call()
            rtol, atol = tolerance(dtype)
            ok = all(torch.allclose(g.float(), r.float(), rtol=rtol, atol=atol) for g, r in zip(got, outs))
            t = triton.testing.do_bench(call, return_mode="median") * 1e3
            tg = triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{cfg}: failed {type(e).__name__}: {str(e)[:100]}")
            continue
        results.append((t, tg, cfg, ok))
    results.sort(key=lambda r: r[0])
    print(f"{'us (flushed)':>12s} {'us (graph)':>10s} {'% floor':>8s}  config")
    for t, tg, cfg, ok in results[:12]:
        print(f"{t:12.1f} {tg:10.1f} {100 * floor_us / t:7.1f}%  {cfg}{'' if ok else '  WRONG'}")


if __name__ == "__main__":
    main(*sys.argv[1:])
