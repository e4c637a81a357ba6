"""What an epilogue instruction costs each Hopper matmul template, by the pipe it issues to
(one GPU run).

    python benchmarks/matmul_epilogue_pipes.py [--out results.json]

At gelu(x@W+b)'s shape in issue 3 (8192 x 4096 x 4096 fp16), eqfuse's cooperative template
(``matmul_cooperative``, a loader warp beside two epilogue warps) and its ping-pong one
(chunks of 8 rows) run the bias plus a synthetic chain of N dependent instructions an
element of one kind, written in inline PTX so that the compiler keeps them; the chain's
result is folded in as ``y * 0``, so every output is the product plus the bias (checked;
not for the ex2 chains, whose values overflow to inf within a few steps: inf * 0 is NaN).
Each template's bias alone, gelu's erf form and cuBLAS's product alone are timed in the
same interleaved rounds.

Measured (NVIDIA H100, results/matmul-epilogue-pipes_*_2026-11-26.json, this script; the
scratch probe it was made from gave the same ordering): extra microseconds over the
cooperative template's bias alone (434.2; cuBLAS 409.7): ffma x16 +37, x32 +78; fmul x32
+54; iadd x32 -2; ex2 x8 +6, x16 +119 (MUFU's own throughput: the two epilogue warps, on two
of the SM's four schedulers, then need about a tile's K-loop time); gelu's erf form +14,
its Phi form (``gelu_phi``) +31. Ping-pong: ffma x32 +50, erf +15, Phi +24. So float32
FMA-pipe instructions on other warps cost the tensor cores most, integer ones and MUFU
nothing below MUFU's own throughput. The Phi form, as many FMA-pipe instructions as the
erf form but more of them FFMA, was slower in both templates here and in a probe with 50-
and 200-ms windows (results/matmul-gelu-phi-probe_*, which has the SASS counts): libdevice's
erf is already about 6 FMA-pipe instructions an element, so eqfuse keeps it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

import torch
import triton
from common import bench_interleaved, relative, save_results
from matmul_epilogue_cost import _bias, cooperative
from matmul_pingpong_probe import _gelu, template
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# One instruction of each kind on a register ``t`` (float32) or ``u`` (32-bit integer):
# each depends on the last, so the chain cannot be shortened
STEPS = {"ffma": "fma.rn.f32 t, t, 0f3F800001, 0f3A800000;", "fmul": "mul.rn.f32 t, t, 0f3F800001;",
         "ex2": "ex2.approx.f32 t, t;", "iadd": "add.u32 u, u, 0x1234567;"}
CHAINS = [("ffma", 16), ("ffma", 32), ("fmul", 32), ("ex2", 8), ("ex2", 16), ("iadd", 32)]
EPILOGUE = '''from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ASM = gl.constexpr({asm!r})


@gluon.jit
def epilogue(acc, mindex, nindex, M: gl.constexpr, N: gl.constexpr, bias):
    x = acc + gl.load(bias + nindex).to(gl.float32)
    y = gl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)
    return x + y * 0.0
'''


@gluon.jit
def gelu_phi(acc, mindex, nindex, M: gl.constexpr, N: gl.constexpr, bias):
    """gelu(x) = x * Phi(x) with Phi(-|x|) = 2^p(|x|): p a degree-7 polynomial fitted (minimax,
    float64) to log2 Phi(-t) on [0, 6], Phi(-t) taken as 0 past 6 (gelu rounds to 0 in float16
    there). Max relative error 4.2e-6 in float32. In the cooperative template's SASS it has as
    many FMA-pipe instructions an element as the erf form (10 against 10.7), more of them FFMA
    (7 against 5), and none of erf's coefficient moves (7 MOV an element)."""
    x = acc + gl.load(bias + nindex).to(gl.float32)
    t = gl.abs(x)
    p = t * -1.8348141566093545e-06 + 6.159834447316825e-05
    p = p * t - 0.0009305252460762858
    p = p * t + 0.008507892489433289
    p = p * t - 0.05396007373929024
    p = p * t - 0.4584643840789795
    p = p * t - 1.1512510776519775
    p = p * t - 0.9999952912330627
    h = gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [p], dtype=gl.float32, is_pure=True, pack=1)
    h = gl.where(t < 6.0, h, 0.0)
    return x * gl.where(x >= 0, 1.0 - h, h)


def chained(op: str, n: int, directory: str):
    """The bias plus ``n`` instructions ``op`` an element: an epilogue in a module file of its
    own (Gluon reads a function's source), its PTX a global constexpr."""
    reg = "u32 u" if op == "iadd" else "f32 t"
    asm = f"{{ .reg .{reg}; mov.b32 {reg[-1]}, $1; {STEPS[op] * n} mov.b32 $0, {reg[-1]}; }}"
    name = f"epilogue_{op}_{n}"
    path = os.path.join(directory, f"{name}.py")
    with open(path, "w") as f:
        f.write(EPILOGUE.format(asm=asm))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.epilogue


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.uint8, device="cuda"))
    m, n, k = 8192, 4096, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g) / k ** 0.25
    w = torch.randn(k, n, device="cuda", dtype=torch.float16, generator=g) / k ** 0.25
    bias = torch.randn(n, device="cuda", dtype=torch.float16, generator=g)
    with tempfile.TemporaryDirectory() as directory:
        epilogues = {"bias": _bias, "gelu erf": _gelu, "gelu phi": gelu_phi}
        epilogues.update({f"{op} x{count}": chained(op, count, directory) for op, count in CHAINS})
        fns = {"cublas": lambda: x @ w}
        fns.update({f"cooperative {name}": cooperative(x, w, e, bias, 1) for name, e in epilogues.items()})
        fns.update({f"pingpong {name}": template(x, w, epilogues[name], [bias], 128, 128, 4, chunk=8)
                    for name in ("bias", "gelu erf", "gelu phi", "ffma x32")})
        want = x @ w + bias
        err = {name: (f().float() - want.float()).abs().max().item() for name, f in fns.items()
               if name != "cublas" and "gelu" not in name}
        gelu = torch.nn.functional.gelu(want.float())
        err.update({name: (f().float() - gelu).abs().max().item() for name, f in fns.items() if "gelu" in name})
        us = bench_interleaved(fns)
    row = {"shape": [m, n, k], "err_vs_product_plus_bias": err, "us": {key: round(v, 1) for key, v in us.items()},
           "over_cublas": relative(us, "cublas")}
    print(row, flush=True)
    save_results(args.out, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
