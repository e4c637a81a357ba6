"""Probe (one GPU run): a warp-specialised ping-pong matmul in Gluon, with a plugged-in
epilogue, against cuBLAS, torch.compile and eqfuse's generated kernel.

    python benchmarks/matmul_pingpong_probe.py [--out probe.json] [--only NAME] [--clocks]

Why: eqfuse's generated matmul kernels are plain Triton; after each tile's K loop the
whole program runs the epilogue while the tensor cores idle, which leaves gelu(x@W+b) at
8192 x 4096 x 4096 fp16 about 1.1x cuBLAS's time for the product alone (issue 3 asks
for 1.05). Triton 3.6's ``warp_specialize`` loops do not lower on Hopper (tried: the
persistent TMA kernel compiles without partitions; a plain K loop fails in the pass
manager). This kernel runs CUTLASS's ping-pong schedule: a loader warp streams A and B
tiles through a TMA ring; two consumer warpgroups take alternate output tiles, handing
the tensor cores to each other through a pair of mbarriers (the order barrier), so that
one's K loop runs while the other runs its epilogue. The turns are also what keeps a
consumer from waiting on a ring slot two fills ahead, where an mbarrier's phase parity
cannot tell the fill it wants from the one before: without them, wrong values and launch
failures once a program had two tiles and the K loop outran the ring.

Measured (NVIDIA H200, results/matmul-pingpong-probe*_NVIDIA-H200_2026-11-26.json,
microseconds, interleaved rounds): gelu(x@W+b) cuBLAS product alone 401.6, torch.compile
445.9, eqfuse's generated kernel 445.6 (1.11x); this kernel, 128 x 128 tiles a consumer,
4 stages: 463.0 with the erf epilogue computed in two halves, 491.3 in one piece (ptxas
spills 376 bytes under the 168 registers a thread that 12 warps allow at launch), 429.0
with no epilogue at all (its K loop alone is 1.07x cuBLAS), 438.8 with gelu's tanh form
on tanh.approx. Handing the turn over after the last product completes instead of once
issued: 476.8. 64 x 256 tiles a consumer: 488.4. Plain products: 1.03-1.06x cuBLAS at
4096^3 (eqfuse's kernel 0.99). So the overlap works for a cheap epilogue, but the erf
costs 34 us even when overlapped (it is 44 us in the generated kernel, not overlapped),
and the 128 x 128 K loop is slower than the generated kernel's 128 x 256: no net win, and
the template is not offered by code generation.

Why the overlap buys nothing here (``--clocks``, same card, results
matmul-pingpong-probe-clocks_*): every contender, cuBLAS included, runs at the card's
power cap (687-693 W of 700) with the SM clock pulled down to 1380-1545 MHz of 1980. A
product this size is limited by energy, not by issue slots: the erf's instructions cost
their joules whether or not they overlap the tensor cores, and only fewer of them (or a
K loop that moves fewer bytes through shared memory: the 128 x 128 tiles ran at the
lowest clock, 1380-1410 MHz) make it faster. libdevice's erff is already short (about
20 instructions, one ex2, branch-free: its PTX for sm_90).

At GPT-2's MLP shape (8192 x 3072 x 768, a K loop of 12 steps; NVIDIA H100,
results/matmul-pingpong-probe-gpt2-mlp_*): cuBLAS's product alone 62.8 us, eqfuse's
generated kernel 96.5, torch.compile 106.2; this kernel 66.3 with no epilogue and 69.8
with gelu's tanh form on tanh.approx (the overlap hides most of it), but 145.5 with the
erf computed (at 1980 MHz and 600-620 W, so not held back by power). Not from spills:
compiled for sm_90 without a GPU (``triton.compile`` of ``_kernel`` through
eqfuse.runtime.compile_worker.ast_source, then nv_tools.resource_usage on the cubin),
the erf form split in two uses 168 registers and no local memory (in one piece, or in
4 or 8 parts, a 272-byte stack); its SASS is 19.7k lines against the tanh form's 7.3k
(libdevice's erff, its branches if-converted: about 48 instructions an element, some 3.5
us a 128 x 128 tile for one warpgroup, about the other consumer's K loop). Why the erf
costs this much here was open until the next probe.

Why (same H100, results/matmul-pingpong-probe-chunked_*): the instruction cache. Each
consumer warpgroup runs its own copy of the epilogue's code, unrolled over its whole
tile: two copies of the erf's, about 300 KB, do not fit, and the epilogue waits for its
instructions. A chunked epilogue (then SPLIT 0: the float32 accumulator through shared memory,
then the epilogue in a loop over 16-row chunks, one chunk's code) shrank the kernel's SASS
from 19.7k to 4.6k lines and ran the erf form in 85.7 us (the bias added first and the
tile stored in fp16, 4 stages) or 98.6 (the accumulator in fp32, which leaves room for 3
stages only), against the generated kernel's 96.4. Generated Triton kernels do not suffer
it: all warps run one copy in step (a runtime loop over the epilogue's column parts in
place of the unrolled halves ran 103-107 us against 97). gelu's tanh form as eqfuse writes
tanh (2 sigmoid(2u) - 1) ran 74.4 in halves and 86.8 chunked, against 86.1 generated.
eqfuse now runs this kernel as codegen/matmul_hopper.py, an autotuning candidate: in
halves for a light epilogue, chunked (the product rounded to fp16 first, 4 stages) for one
with a special function.

The figures above came from this probe's own copy of the kernel, with variants eqfuse
does not run (the epilogue in one piece, SPLIT 1; the chunks staged in fp32). It now runs
eqfuse's template itself, in halves or chunked (``template(..., chunk=)``), with the
epilogues below (``EPILOGUE(x, mindex, nindex, M, N, *epi_args)``, as in
codegen/matmul_hopper.py); the earlier variants are in git history and their results
files.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch
import torch.nn.functional as F
import triton
from common import bench_interleaved, inductor_compiled, relative, save_results
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

import eqfuse
from eqfuse.codegen.matmul_hopper import MAXNREG, matmul_pingpong
from eqfuse.codegen.tma import sm_count

# (BLOCK_M, BLOCK_N, STAGES): a consumer's tile (128 accumulator registers a thread) and ring depth
CONFIGS = [(128, 128, 4), (128, 128, 5), (64, 256, 4)]


@gluon.jit
def _gelu(acc, mindex, nindex, M: gl.constexpr, N: gl.constexpr, bias):
    x = acc + gl.load(bias + nindex).to(gl.float32)
    return x * 0.5 * (1.0 + gl.erf(x * 0.7071067811865476))


@gluon.jit
def _gelu_tanh_sigmoid(acc, mindex, nindex, M: gl.constexpr, N: gl.constexpr, bias):
    """gelu's tanh form as eqfuse writes tanh (2 sigmoid(2u) - 1, exact to float32 rounding)."""
    x = acc + gl.load(bias + nindex).to(gl.float32)
    u = x * 0.7978845608028654 * (1.0 + 0.044715 * x * x)
    t = 2.0 / (1.0 + gl.exp(-2.0 * u)) - 1.0
    return x * 0.5 * (1.0 + t)


@gluon.jit
def _identity(acc, mindex, nindex, M: gl.constexpr, N: gl.constexpr):
    return acc


@gluon.jit
def _gelu_tanh(acc, mindex, nindex, M: gl.constexpr, N: gl.constexpr, bias):
    """gelu's tanh form with tanh.approx: a much cheaper epilogue, to see what the erf costs."""
    x = acc + gl.load(bias + nindex).to(gl.float32)
    u = x * 0.7978845608028654 * (1.0 + 0.044715 * x * x)
    t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=gl.float32, is_pure=True, pack=1)
    return x * 0.5 * (1.0 + t)


def template(a, b, epilogue, epi_args, bm, bn, stages, programs=None, chunk=0):
    """eqfuse's template (codegen/matmul_hopper.py) on row-major ``a @ b``, with ``epilogue``
    in halves (``chunk`` 0) or in chunks of ``chunk`` rows."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = min(programs or sm_count(), tiles)

    def run():
        matmul_pingpong[(programs,)](a, b, c, epilogue, tuple(epi_args), m, n, k, k, n, n, False, bm, bn, 64, 8,
                                     stages, programs, chunk, num_warps=4, maxnreg=MAXNREG)
        return c
    return run


def gelu_linear(x, w, b):
    return F.gelu(x @ w + b)


def mm(a, b):
    return a @ b


def workloads():
    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float16, device="cuda") / shape[-1] ** 0.25

    x, w, bias = rand(8192, 4096), rand(4096, 4096), rand(4096)
    extra = {"identity epilogue": (_identity, (), 0, False),
             "gelu tanh.approx epilogue": (_gelu_tanh, (bias,), 0, False),
             "gelu, chunked epilogue": (_gelu, (bias,), 16, True)}
    yield ("gelu(x@W+b) 8192x4096x4096 fp16", gelu_linear, (x, w, bias), _gelu, (bias,), 2 * 8192 * 4096 * 4096,
           extra)
    for s in (4096, 8192):
        a, b = rand(s, s), rand(s, s)
        yield f"matmul {s}^3 fp16", mm, (a, b), _identity, (), 2 * s ** 3, {}
    # GPT-2's MLP (8 x 1024 tokens, 768 -> 3072): a short K loop, so the epilogue is a
    # larger share of each tile's time than above
    x, w, bias = rand(8192, 768), rand(768, 3072), rand(3072)
    yield ("gelu(x@W+b) 8192x3072x768 fp16", gelu_linear, (x, w, bias), _gelu, (bias,), 2 * 8192 * 3072 * 768,
           {"identity epilogue": (_identity, (), 0, False),
            "gelu tanh.approx epilogue": (_gelu_tanh, (bias,), 0, False),
            "gelu, chunked epilogue": (_gelu, (bias,), 16, True),
            "gelu tanh (sigmoid), chunked epilogue": (_gelu_tanh_sigmoid, (bias,), 16, False),
            "gelu tanh (sigmoid) epilogue": (_gelu_tanh_sigmoid, (bias,), 0, False)})


def clocks(fn, seconds: float = 2.0) -> dict:
    """The SM clock (MHz) and board power (W) nvidia-smi reads while ``fn`` runs back to
    back for ``seconds``: medians of its samples, the first quarter (ramping) left out.
    Read-only: the card's settings are left as they are."""
    import subprocess
    import time
    fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 1]
    rows = rows[len(rows) // 4:]
    if not rows:
        return {}
    mhz = sorted(float(r[0]) for r in rows)
    watts = sorted(float(r[1]) for r in rows)
    return {"sm_mhz": mhz[len(mhz) // 2], "watts": watts[len(watts) // 2], "samples": len(rows)}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--clocks", action="store_true", help="also the SM clock and power while each contender runs")
    p.add_argument("--only", default=None, help="a substring of the workloads' names to run")
    args = p.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.uint8, device="cuda"))
    log: list = []
    bad = 0
    for name, fn, inputs, epilogue, epi_args, flops, extra in workloads():
        if args.only and args.only not in name:
            continue
        row = {"workload": name}
        try:
            want = fn(*inputs)
            fns = {"cublas_matmul_alone": lambda a=inputs[0], b=inputs[1]: a @ b, "eager": lambda: fn(*inputs)}
            tc, row["torch_compile_s"] = inductor_compiled(fn, inputs)
            fns["torch.compile"] = lambda: tc(*inputs)
            compiled = eqfuse.compile(fn, inputs)
            fns["eqfuse"] = lambda: compiled(*inputs)
            row["eqfuse_kernels"] = [k.config for k in compiled.kernels]
            for bm, bn, stages in CONFIGS:
                run = template(inputs[0], inputs[1], epilogue, epi_args, bm, bn, stages)
                err = (run().float() - want.float()).abs().max().item()
                key = f"template {bm}x{bn} stages {stages}"
                row[f"{key} max_abs_err"] = round(err, 5)
                if err > 0.05:
                    bad += 1
                    print(f"{name} {key}: max abs error {err}", flush=True)
                fns[key] = run
            for key, (epi, e_args, chunk, check) in extra.items():
                run = template(inputs[0], inputs[1], epi, e_args, 128, 128, 4, chunk=chunk)
                if check:
                    row[f"{key} max_abs_err"] = round((run().float() - want.float()).abs().max().item(), 5)
                fns[f"template 128x128 stages 4, {key}"] = run
            us = bench_interleaved(fns)
            row["us"] = {k: round(v, 1) for k, v in us.items()}
            row["tflops"] = {k: round(flops / v / 1e6, 1) for k, v in us.items()}
            row["over_cublas_matmul_alone"] = relative(us, "cublas_matmul_alone")
            if args.clocks:
                row["clocks"] = {k: clocks(f) for k, f in fns.items()}
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()[-2000:]
            traceback.print_exc()
        print(row, flush=True)
        log.append(row)
        save_results(args.out, log, configs=CONFIGS)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
