"""What an epilogue costs the cooperative Hopper matmul template (one GPU run).

    python benchmarks/matmul_epilogue_cost.py [--out results.json] [--clocks]

eqfuse's ``matmul_cooperative`` (codegen/matmul_hopper.py), both ways of filling its ring
(L1: a loader warp beside two epilogue warps; L0: an MMA warpgroup fills it beside four),
at gelu(x@W+b)'s shape in issue 3 and at GPT-2's MLP shape, with epilogues of different
costs: the bias alone; gelu's erf form on libdevice's erf; on libdevice's polynomials each
with its own constants (``erf2``: no per-element coefficient selects, 20% fewer instructions
in the epilogue loop); on Numerical Recipes' erfc (relative error 1.2e-7); and gelu's tanh
form on tanh.approx (a different function: there only for its cost). Errors against eager
and against float64 (largest, and where |gelu| < 0.01) come with the timings.

Measured (NVIDIA H100, results/matmul-epilogue-cost*_2026-11-26.json, three runs;
interleaved rounds, microseconds; cuBLAS's product alone 405.3-407.8): with the bias alone
the template runs 399.9-408.1, at cuBLAS's time. gelu's erf form costs 37-60 us more
(441.0-463.6 with a loader warp, 1.09-1.14x; torch.compile's kernel ran 447-470 in other
runs), its tanh.approx form 14-18 (413.7-422.4). Fewer instructions do not buy the erf
back at this shape: erf2 ran 454.3-460.5 and the erfc form 444.8-456.9 beside libdevice's
441.0-463.6. At GPT-2's MLP shape (K = 768, where the epilogue is the larger share) they
do: 84.3-84.5 and 85.4-85.8 against 87.3-87.8 with four epilogue warps (104-117 with two).
eqfuse keeps libdevice's erf.

Not the power cap (``--clocks``, results/matmul-epilogue-cost-clocks_*): cuBLAS and the
template with the bias alone run at 1290-1320 MHz and 696-698 W (the cap is 700); with
gelu's erf form the template runs at 1440 MHz and 688-692 W, and is still 12% slower. So
the tensor cores stand idle part of the time: the epilogue's float32 instructions, on the
same SM, cost nearly their whole issue time (the erf form about 35 instructions an element:
some 48 us of the SMs' float32 issue at this shape and clock; tanh.approx's 13, some 18 us,
against costs of 37-60 and 14-18 measured), though they run on other warps than the MMAs'.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton
from common import bench_interleaved, relative, save_results
from matmul_pingpong_probe import _gelu, clocks
from matmul_pingpong_probe import _gelu_tanh as _gelu_tanh_approx
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from eqfuse.codegen.matmul_hopper import MAXNREG, matmul_cooperative
from eqfuse.codegen.tma import sm_count


@gluon.jit
def _bias(acc, mindex, nindex, M: gl.constexpr, N: gl.constexpr, bias):
    return acc + gl.load(bias + nindex).to(gl.float32)


@gluon.jit
def erf2(z):
    """libdevice's erff (its constants read off its SASS): two polynomials, in z * z below
    |z| = 1.00296 and in |z| above (then 1 - 2^p), each evaluated with its own constants and
    the result selected, where libdevice selects each coefficient per element (two moves a
    coefficient)."""
    a = gl.abs(z)
    u = z * z
    ps = u * 8.483494457323104e-05 - 0.0008213091641664505
    ps = ps * u + 0.005213488824665546
    ps = ps * u - 0.026868773624300957
    ps = ps * u + 0.11284004896879196
    ps = ps * u - 0.37612664699554443
    ps = ps * u + 0.12837915122509003
    small = ps * z + z
    pl = a * 1.6425845387857407e-05 - 0.0004680210549850017
    pl = pl * a + 0.0052647641859948635
    pl = pl * a - 0.034303076565265656
    pl = pl * a + 0.1532936990261078
    pl = pl * a + 0.9163130521774292
    pl = pl * a + 0.6282998323440552
    large = 1.0 - gl.exp2(pl * (-a) - a)
    large = gl.where(z < 0, -large, large)
    return gl.where(a >= 1.0029599666595458984, large, small)


@gluon.jit
def _gelu_erf2(acc, mindex, nindex, M: gl.constexpr, N: gl.constexpr, bias):
    x = acc + gl.load(bias + nindex).to(gl.float32)
    return x * 0.5 * (1.0 + erf2(x * 0.7071067811865476))


@gluon.jit
def _gelu_erfc(acc, mindex, nindex, M: gl.constexpr, N: gl.constexpr, bias):
    """1 + erf(z) as 2 - erfc(z), or erfc(-z) below 0, erfc from Numerical Recipes' erfcc."""
    x = acc + gl.load(bias + nindex).to(gl.float32)
    z = gl.abs(x) * 0.7071067811865476
    t = gl.fdiv(1.0, 1.0 + 0.5 * z)
    p = 0.17087277
    p = p * t - 0.82215223
    p = p * t + 1.48851587
    p = p * t - 1.13520398
    p = p * t + 0.27886807
    p = p * t - 0.18628806
    p = p * t + 0.09678418
    p = p * t + 0.37409196
    p = p * t + 1.00002368
    p = p * t - 1.26551223
    erfc = t * gl.exp2((p - z * z) * 1.4426950408889634)
    return x * 0.5 * gl.where(x >= 0, 2.0 - erfc, erfc)


EPILOGUES = [("bias only", _bias), ("gelu erf", _gelu), ("gelu erf2", _gelu_erf2), ("gelu erfc-NR", _gelu_erfc),
             ("gelu tanh.approx", _gelu_tanh_approx)]


def cooperative(a, b, epilogue, bias, loader):
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    programs = min(sm_count(), triton.cdiv(m, 128) * triton.cdiv(n, 256))

    def run():
        matmul_cooperative[(programs,)](a, b, c, epilogue, (bias,), m, n, k, k, n, n, False, 64, 256, 64, 8, 3,
                                        programs, loader, num_warps=4, maxnreg=MAXNREG)
        return c
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--clocks", action="store_true", help="also the SM clock and power while each one runs")
    args = p.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    # the descriptors are made on the device: their scratch memory from torch
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.uint8, device="cuda"))
    rows = []
    for m, n, k in [(8192, 4096, 4096), (8192, 3072, 768)]:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g) / k ** 0.25
        w = torch.randn(k, n, device="cuda", dtype=torch.float16, generator=g) / k ** 0.25
        bias = torch.randn(n, device="cuda", dtype=torch.float16, generator=g)
        want = F.gelu(x @ w + bias)
        exact = F.gelu((x @ w).double() + bias.double())
        tail = exact.abs() < 1e-2

        def errors(out):
            diff = (out.double() - exact).abs()
            return diff[tail].max().item(), diff.max().item()
        fns = {"cublas": lambda: x @ w}
        row = {"shape": [m, n, k], "err_vs_eager": {}, "err_vs_fp64": {"eager": errors(want)}}
        for name, epilogue in EPILOGUES:
            for loader in (1, 0):
                f = cooperative(x, w, epilogue, bias, loader)
                if name.startswith("gelu"):
                    out = f()
                    row["err_vs_eager"][f"{name} L{loader}"] = (out.float() - want.float()).abs().max().item()
                    row["err_vs_fp64"][f"{name} L{loader}"] = errors(out)
                fns[f"{name} L{loader}"] = f
        us = bench_interleaved(fns)
        row["us"] = {key: round(v, 1) for key, v in us.items()}
        row["over_cublas"] = relative(us, "cublas")
        if args.clocks:
            row["clocks"] = {key: clocks(f) for key, f in fns.items()}
        print(row, flush=True)
        rows.append(row)
        save_results(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
