"""Probe (one GPU run): does a TMA / persistent form of eqfuse's matmul kernel pay on Hopper,
why is fp32 (TF32) slow, and why does the autotuner time a kernel faster than the benchmark?

    python benchmarks/matmul_tma_probe.py [--out probe.json] [--smi smi.csv]

Hand-written kernels, one family with constexpr switches, so that each switch is measured
alone: operand loads through pointers or tensor descriptors (TMA), one program per tile or
persistent, the output stored through pointers or a descriptor (optionally in two halves),
fp32 products with the operands swapped (C^T = B^T A^T) so that an N-major B is fed from
registers. All timed with triton.testing.do_bench (L2 flushed), interleaved with cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
import traceback

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

LOG: list = []


def note(**row):
    row["t"] = round(time.time(), 2)
    LOG.append(row)
    print(json.dumps(row), flush=True)


@triton.jit
def _gelu(x):
    return x * 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def _tile_ids(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    group = tile // (GROUP_M * tiles_n)
    rows = tl.minimum(tiles_m - group * GROUP_M, GROUP_M)
    pm = group * GROUP_M + (tile % (GROUP_M * tiles_n)) % rows
    pn = (tile % (GROUP_M * tiles_n)) // rows
    return pm, pn


@triton.jit
def _one_tile(a_ptr, b_ptr, bias_ptr, c_ptr, a_desc, b_desc, c_desc, pm, pn,
              M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              TMA: tl.constexpr, B_KMAJOR: tl.constexpr, SWAP: tl.constexpr, EPI: tl.constexpr,
              STORE: tl.constexpr, PREC: tl.constexpr):
    m = pm * BM + tl.arange(0, BM)[:, None]
    n = pn * BN + tl.arange(0, BN)[None, :]
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if TMA:
            a = a_desc.load([pm * BM, k0])
            if B_KMAJOR:
                b = b_desc.load([pn * BN, k0]).T
            else:
                b = b_desc.load([k0, pn * BN])
        else:
            ka = k0 + tl.arange(0, BK)[None, :]
            kb = k0 + tl.arange(0, BK)[:, None]
            a = tl.load(a_ptr + m * K + ka)
            if B_KMAJOR:
                b = tl.load(b_ptr + kb + n * K)
            else:
                b = tl.load(b_ptr + kb * N + n)
        if SWAP:
            acc = tl.dot(tl.trans(b), tl.trans(a), acc, input_precision=PREC)
        else:
            acc = tl.dot(a, b, acc, input_precision=PREC)
    if SWAP:
        acc = tl.trans(acc)
    if STORE == 3:  # the epilogue itself in two halves along N (fewer live registers), each stored by TMA
        h0, h1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        n0 = pn * BN + tl.arange(0, BN // 2)[None, :]
        c_desc.store([pm * BM, pn * BN], _epilogue(h0, bias_ptr, n0, EPI).to(c_ptr.dtype.element_ty))
        c_desc.store([pm * BM, pn * BN + BN // 2],
                     _epilogue(h1, bias_ptr, n0 + BN // 2, EPI).to(c_ptr.dtype.element_ty))
    else:
        out = _epilogue(acc, bias_ptr, n, EPI).to(c_ptr.dtype.element_ty)
        if STORE == 0:
            tl.store(c_ptr + m * N + n, out)
        elif STORE == 1:
            c_desc.store([pm * BM, pn * BN], out)
        else:  # two halves along N: half the staging buffer
            halves = tl.split(tl.permute(tl.reshape(out, (BM, 2, BN // 2)), (0, 2, 1)))
            c_desc.store([pm * BM, pn * BN], halves[0])
            c_desc.store([pm * BM, pn * BN + BN // 2], halves[1])


@triton.jit
def _epilogue(acc, bias_ptr, n, EPI: tl.constexpr):
    if EPI:
        acc = _gelu(acc + tl.load(bias_ptr + n).to(tl.float32))
    return acc


@triton.jit
def transpose_kernel(x, y, R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """y[c, r] = x[r, c], both contiguous: y is x stored column-major."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    c = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    v = tl.load(x + r * C + c)
    tl.store(y + c * R + r, v)


@triton.jit
def probe_kernel(a_ptr, b_ptr, bias_ptr, c_ptr,
                 M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 TMA: tl.constexpr, B_KMAJOR: tl.constexpr, SWAP: tl.constexpr, EPI: tl.constexpr,
                 STORE: tl.constexpr, PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
                 PREC: tl.constexpr):
    a_desc = None
    b_desc = None
    c_desc = None
    if TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
        if B_KMAJOR:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    if STORE == 1:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    if STORE >= 2:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN // 2])
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    if PROGRAMS == 0:
        pm, pn = _tile_ids(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
        _one_tile(a_ptr, b_ptr, bias_ptr, c_ptr, a_desc, b_desc, c_desc, pm, pn, M, N, K, BM, BN, BK,
                  TMA, B_KMAJOR, SWAP, EPI, STORE, PREC)
    else:
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
            pm, pn = _tile_ids(tile, tiles_m, tiles_n, GROUP_M)
            _one_tile(a_ptr, b_ptr, bias_ptr, c_ptr, a_desc, b_desc, c_desc, pm, pn, M, N, K, BM, BN, BK,
                      TMA, B_KMAJOR, SWAP, EPI, STORE, PREC)


def _alloc(size, align, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def launcher(a, b, bias, c, *, bm, bn, bk, warps, stages, tma=False, b_kmajor=False, swap=False, epi=False,
             store=0, persistent=False, flatten=False, ws=False, prec="tf32"):
    M, K = a.shape
    N = c.shape[1]
    tiles = math.ceil(M / bm) * math.ceil(N / bn)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = min(sms, tiles) if persistent else 0
    grid = (programs or tiles,)
    kw = dict(M=M, N=N, K=K, BM=bm, BN=bn, BK=bk, GROUP_M=8, TMA=tma, B_KMAJOR=b_kmajor, SWAP=swap, EPI=epi,
              STORE=store, PROGRAMS=programs, FLATTEN=flatten, WS=ws, PREC=prec, num_warps=warps, num_stages=stages)
    return lambda: probe_kernel[grid](a, b, bias if bias is not None else c, c, **kw)


def us(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def interleaved(fns: dict, rounds=3) -> dict:
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(us(f))
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def try_variants(label, make_out, check, variants, reference: dict, flops):
    """Compile and check each variant, then time them all interleaved with the references."""
    fns = dict(reference)
    for name, kw in variants:
        try:
            c = make_out()
            f = launcher(**kw, c=c)
            f()
            torch.cuda.synchronize()
            err = check(c)
            if err > 0.05:
                note(section=label, variant=name, error=f"wrong result, rel err {err:.3g}")
                continue
            fns[name] = f
        except Exception as e:  # a variant the compiler rejects
            first = str(e).splitlines()[0][:300] if str(e) else ""
            note(section=label, variant=name, error=f"{type(e).__name__}: {first}")
    t = interleaved(fns)
    for name, v in sorted(t.items(), key=lambda kv: kv[1]):
        note(section=label, variant=name, us=round(v, 1), tflops=round(flops / v / 1e6, 1))
    return t


def rel_err(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def gelu_section(m=8192, n=4096, k=4096):
    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=torch.float16, device="cuda") / k ** 0.25
    w = torch.randn(k, n, dtype=torch.float16, device="cuda") / k ** 0.25
    bias = torch.randn(n, dtype=torch.float16, device="cuda") / k ** 0.25
    ref = F.gelu(x @ w + bias)
    base = dict(a=x, b=w, bias=bias, epi=True)
    V = []
    A = dict(bm=128, bn=256, bk=64, warps=8, stages=3)
    C = dict(bm=256, bn=128, bk=64, warps=8, stages=3)
    D = dict(bm=128, bn=128, bk=64, warps=8, stages=4)
    D3 = dict(bm=128, bn=128, bk=64, warps=4, stages=3)
    tma_p = dict(tma=True, persistent=True)
    V += [("ptr A", {**base, **A}), ("ptr A no-epilogue", {**base, **A, "epi": False}),
          ("ptr persistent flatten A", {**base, **A, "persistent": True, "flatten": True}),
          ("tma P flatten halves A no-epilogue", {**base, **A, **tma_p, "flatten": True, "store": 2, "epi": False}),
          ("tma P flatten halves A", {**base, **A, **tma_p, "flatten": True, "store": 2}),
          ("tma P flatten split-epilogue A", {**base, **A, **tma_p, "flatten": True, "store": 3}),
          ("tma P split-epilogue A", {**base, **A, **tma_p, "store": 3}),
          ("tma P ws halves A", {**base, **A, **tma_p, "ws": True, "store": 2}),
          ("tma P ws split-epilogue A", {**base, **A, **tma_p, "ws": True, "store": 3}),
          ("tma P flatten split-epilogue C", {**base, **C, **tma_p, "flatten": True, "store": 3}),
          ("tma P flatten split-epilogue D", {**base, **D, **tma_p, "flatten": True, "store": 3}),
          ("tma P ws split-epilogue D", {**base, **D, **tma_p, "ws": True, "store": 3}),
          ("ptr D3 (2 programs per SM)", {**base, **D3}),
          ("tma D3 (2 programs per SM)", {**base, **D3, "tma": True})]
    return try_variants("gelu 8192x4096x4096 fp16", lambda: torch.empty(m, n, dtype=torch.float16, device="cuda"),
                        lambda c: rel_err(c, ref), V, {"cublas mm alone": lambda: x @ w,
                                                        "eager gelu(x@w+b)": lambda: F.gelu(x @ w + bias)},
                        2 * m * n * k)


def square_section(size, dtype):
    torch.manual_seed(0)
    a = torch.randn(size, size, dtype=dtype, device="cuda") / size ** 0.25
    b = torch.randn(size, size, dtype=dtype, device="cuda") / size ** 0.25
    ref = a @ b
    base = dict(a=a, b=b, bias=None)
    A = dict(bm=128, bn=256, bk=64, warps=8, stages=3)
    C = dict(bm=256, bn=128, bk=64, warps=8, stages=3)
    tma_p = dict(tma=True, persistent=True)
    V = [("ptr A", {**base, **A}),
         ("tma P flatten halves A", {**base, **A, **tma_p, "flatten": True, "store": 2}),
         ("tma P flatten halves C", {**base, **C, **tma_p, "flatten": True, "store": 2}),
         ("tma P ws halves A", {**base, **A, **tma_p, "ws": True, "store": 2})]
    name = str(dtype).split(".")[-1]
    return try_variants(f"matmul {size}^3 {name}", lambda: torch.empty(size, size, dtype=dtype, device="cuda"),
                        lambda c: rel_err(c, ref), V, {"cublas": lambda: a @ b}, 2 * size ** 3)


def tf32_section(size=2048):
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    a = torch.randn(size, size, device="cuda") / size ** 0.25
    b = torch.randn(size, size, device="cuda") / size ** 0.25
    bt = b.t().contiguous()  # the same matrix, K-major (as W.T of a Linear is)
    ref = a @ b
    A = dict(bm=128, bn=256, bk=32, warps=8, stages=3)
    C = dict(bm=256, bn=128, bk=32, warps=8, stages=3)
    kmajor = dict(a=a, b=bt, bias=None, b_kmajor=True)
    V = [("ptr N-major B A", dict(a=a, b=b, bias=None, **A)),
         ("ptr K-major B A", {**kmajor, **A}), ("ptr K-major B C", {**kmajor, **C}),
         ("tma P K-major B A", {**kmajor, **A, "tma": True, "persistent": True}),
         ("tma P flatten halves K-major B A", {**kmajor, **A, "tma": True, "persistent": True, "flatten": True,
                                               "store": 2}),
         ("tma P flatten halves K-major B C", {**kmajor, **C, "tma": True, "persistent": True, "flatten": True,
                                               "store": 2})]
    y = torch.empty_like(b)
    refs = {"cublas": lambda: a @ b, "torch transpose copy of B": lambda: b.t().contiguous()}
    for br in (32, 64):
        refs[f"triton transpose copy of B {br}x{br}"] = (
            lambda br=br: transpose_kernel[(size // br, size // br)](b, y, R=size, C=size, BR=br, BC=br, num_warps=4))
    t = try_variants("matmul 2048^3 fp32 (TF32)", lambda: torch.empty(size, size, device="cuda"),
                     lambda c: rel_err(c, ref), V, refs, 2 * size ** 3)
    refs["triton transpose copy of B 64x64"]()
    note(section="tf32", transpose_ok=bool(torch.equal(y, bt)))
    torch.backends.cuda.matmul.allow_tf32 = False
    return t


def eqfuse_section():
    """The autotuner's trial timing vs the benchmark's, for the same kernel, same inputs."""
    import eqfuse
    from eqfuse.runtime import autotune

    torch.manual_seed(0)
    m, n, k = 8192, 4096, 4096
    x = torch.randn(m, k, dtype=torch.float16, device="cuda") / k ** 0.25
    w = torch.randn(k, n, dtype=torch.float16, device="cuda") / k ** 0.25
    bias = torch.randn(n, dtype=torch.float16, device="cuda") / k ** 0.25

    def gelu_linear(x, w, b):
        return F.gelu(x @ w + b)
    start = len(autotune.trials)
    note(section="eqfuse", phase="compile start")
    compiled = eqfuse.compile(gelu_linear, (x, w, bias))
    plain = eqfuse.compile(gelu_linear, (x, w, bias), cuda_graphs=False)
    note(section="eqfuse", phase="compile end")
    for _name, _, cfg, t in autotune.trials[start:]:
        note(section="eqfuse", trial=cfg, us=round(t, 1))
    (kinfo,) = compiled.kernels
    mod = compiled.module if hasattr(compiled, "module") else None
    note(section="eqfuse", kernel=kinfo.name, config=kinfo.constexprs | kinfo.launch, module=bool(mod))
    fns = {"eqfuse compiled() (CUDA graphs)": lambda: compiled(x, w, bias),
           "eqfuse compiled() (no CUDA graphs)": lambda: plain(x, w, bias),
           "cublas mm alone": lambda: x @ w}
    out = torch.empty(m, n, dtype=torch.float16, device="cuda")
    try:
        from eqfuse.runtime.cache import cache_key, load_module
        src = compiled.source
        module = load_module(cache_key(src, "probe"), src, interpret=False)
        fn = getattr(module, kinfo.name)
        fns["eqfuse kernel via JIT (as the autotuner)"] = lambda: fn[kinfo.grid](x, w, bias, out, **kinfo.constexprs,
                                                                                **kinfo.launch)
        fns["eqfuse kernel via its launcher"] = lambda: getattr(module, kinfo.name + "_launch")(x, w, bias, out)
    except Exception:
        note(section="eqfuse", error=traceback.format_exc()[-500:])
    t = interleaved(fns, rounds=5)
    for name, v in t.items():
        note(section="eqfuse interleaved", variant=name, us=round(v, 1))
    # Back to back, the autotuner's way (one do_bench each, no interleaving)
    for name, f in fns.items():
        note(section="eqfuse alone", variant=name, us=round(us(f), 1))


def ab_section():
    """eqfuse's generated gelu(x@W+b) kernel in its two forms, same tiles, against this
    probe's hand-written TMA kernel and cuBLAS, interleaved in one process."""
    import os

    import eqfuse
    from eqfuse.codegen.module import generate_module
    from eqfuse.runtime.cache import cache_key, load_module

    torch.manual_seed(0)
    m, n, k = 8192, 4096, 4096
    x = torch.randn(m, k, dtype=torch.float16, device="cuda") / k ** 0.25
    w = torch.randn(k, n, dtype=torch.float16, device="cuda") / k ** 0.25
    bias = torch.randn(n, dtype=torch.float16, device="cuda") / k ** 0.25
    os.environ["EQFUSE_AUTOTUNE"] = "0"
    compiled = eqfuse.compile(lambda x, w, b: F.gelu(x @ w + b), (x, w, bias))
    del os.environ["EQFUSE_AUTOTUNE"]
    name = compiled.kernels[0].name
    tile = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    ref = F.gelu(x @ w + bias)
    fns = {"cublas mm alone": lambda: x @ w}
    for label, cfg in (("eqfuse pointer form", tile), ("eqfuse TMA form", {**tile, "PROGRAMS": 132})):
        src, _ = generate_module(compiled.plan, "ab", "probe", {name: cfg})
        module = load_module(cache_key(src, "ab"), src, interpret=False)
        (out,) = module.call(x.device, [], x, w, bias)
        note(section="ab", variant=label, rel_err=rel_err(out, ref))
        fns[label] = lambda module=module: module.call(x.device, [], x, w, bias)
    c = torch.empty(m, n, dtype=torch.float16, device="cuda")
    fns["probe TMA kernel"] = launcher(x, w, bias, c, bm=128, bn=256, bk=64, warps=8, stages=3, tma=True,
                                       persistent=True, flatten=True, store=2, epi=True)
    t = interleaved(fns, rounds=5)
    for label, v in sorted(t.items(), key=lambda kv: kv[1]):
        note(section="ab gelu 8192x4096x4096 fp16", variant=label, us=round(v, 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--smi", default=None)
    p.add_argument("--only", default="eqfuse,gelu,tf32,square")
    args = p.parse_args()
    triton.set_allocator(_alloc)
    smi = None
    if args.smi:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                                "clocks_throttle_reasons.active", "--format=csv", "-lms", "250"],
                               stdout=open(args.smi, "w"), stderr=subprocess.STDOUT)
    note(device=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__)
    only = args.only.split(",")
    sections = [("ab", ab_section), ("eqfuse", eqfuse_section), ("tf32", tf32_section), ("gelu", gelu_section),
                ("square", lambda: [square_section(8192, torch.float16), square_section(4096, torch.bfloat16)])]
    for name, fn in sections:
        if name in only:
            try:
                fn()
            except Exception:
                note(section=name, error=traceback.format_exc()[-1500:])
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(LOG, f, indent=1)
    if smi:
        smi.terminate()


if __name__ == "__main__":
    main()
