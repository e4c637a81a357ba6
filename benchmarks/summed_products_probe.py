"""Probe (one GPU run): a sum of three products as three K loops or as one.

    python benchmarks/summed_products_probe.py [--out probe.json]

GPT-2's backward multiplies the concatenated q/k/v gradients by the projection's weight,
``cat(dq, dk, dv) @ W^T`` = ``dq @ W[:768] + dk @ W[768:1536] + dv @ W[1536:]``, at
[8192 x 2304] @ [2304 x 768] fp16. Two hand-written forms of eqfuse's summed-products
kernel, at the tile shapes its model offers, with Triton's compile time (first call) and
the median time per call (L2 flushed), beside torch's cat + mm and its mm alone:

* ``three_loops``: a K loop per product into one accumulator;
* ``one_loop``: one loop over the three K ranges end to end, each step picking its
  product's buffers by address (what codegen/kernel.py's summed_loop writes).
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl
import triton.testing
from common import save_results


@triton.jit
def _tile(M: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    group = pid // (GROUP_M * tiles_n)
    group_rows = tl.minimum(tiles_m - group * GROUP_M, GROUP_M)
    pid_m = group * GROUP_M + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None], pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def three_loops(a0, a1, a2, w, out, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    mindex, nindex = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ka, kb = k0 + tl.arange(0, BLOCK_K)[None, :], k0 + tl.arange(0, BLOCK_K)[:, None]
        acc = tl.dot(tl.load(a0 + mindex * K + ka), tl.load(w + kb * N + nindex), acc)
    for k0 in range(0, K, BLOCK_K):
        ka, kb = k0 + tl.arange(0, BLOCK_K)[None, :], k0 + tl.arange(0, BLOCK_K)[:, None]
        acc = tl.dot(tl.load(a1 + mindex * K + ka), tl.load(w + kb * N + nindex + K * N), acc)
    for k0 in range(0, K, BLOCK_K):
        ka, kb = k0 + tl.arange(0, BLOCK_K)[None, :], k0 + tl.arange(0, BLOCK_K)[:, None]
        acc = tl.dot(tl.load(a2 + mindex * K + ka), tl.load(w + kb * N + nindex + 2 * K * N), acc)
    tl.store(out + mindex * N + nindex, acc.to(out.dtype.element_ty))


@triton.jit
def one_loop(a0, a1, a2, w, out, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    mindex, nindex = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, 3 * K, BLOCK_K):
        part = k0 // K
        base = tl.where(part == 0, a0, tl.where(part == 1, a1, a2))
        ka = (k0 - part * K) + tl.arange(0, BLOCK_K)[None, :]
        kb = k0 + tl.arange(0, BLOCK_K)[:, None]
        acc = tl.dot(tl.load(base + mindex * K + ka), tl.load(w + kb * N + nindex), acc)
    tl.store(out + mindex * N + nindex, acc.to(out.dtype.element_ty))


TILES = [(128, 128, 32, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 3)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    M, N, K = 8192, 768, 768
    a = [torch.randn(M, K, device="cuda", dtype=torch.float16) for _ in range(3)]
    w = torch.randn(3 * K, N, device="cuda", dtype=torch.float16)
    x = torch.cat(a, 1)
    ref = (x @ w).float()
    rows = []
    for kernel in (three_loops, one_loop):
        for bm, bn, bk, warps, stages in TILES:
            out = torch.empty(M, N, device="cuda", dtype=torch.float16)
            grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
            cfg = dict(M=M, N=N, K=K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
            t0 = time.perf_counter()
            kernel[grid](*a, w, out, **cfg)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            us = triton.testing.do_bench(lambda k=kernel, o=out, c=cfg, g=grid: k[g](*a, w, o, **c),
                                         return_mode="median") * 1e3
            rows.append({"kernel": kernel.__name__, "tile": [bm, bn, bk, warps, stages],
                         "compile_s": round(compile_s, 2), "us": round(us, 1), "rel_err": err})
            print(rows[-1], flush=True)
    rows.append({"kernel": "torch cat + mm",
                 "us": round(triton.testing.do_bench(lambda: torch.cat(a, 1) @ w, return_mode="median") * 1e3, 1)})
    rows.append({"kernel": "torch mm alone",
                 "us": round(triton.testing.do_bench(lambda: x @ w, return_mode="median") * 1e3, 1)})
    print(rows[-2:])
    save_results(args.out, rows, shape=[M, 3 * K, N], dtype="float16")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
