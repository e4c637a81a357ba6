"""Probe (one GPU run): what makes eqfuse's attention kernel slower than SDPA at head dim 128?

    python benchmarks/attention_probe.py [--out probe.json] [--quick]

Times, side by side with ``F.scaled_dot_product_attention`` in interleaved rounds:

* eqfuse's generated kernel at chosen configurations (the plan compiled once, the module
  regenerated per configuration, as the autotuner does);
* a hand-written flash-attention kernel with constexpr switches, so that each change is
  measured alone: K/V tiles through pointers or TMA descriptors (``TMA``), the softmax
  scale applied as one FMA after the row max (``FMA``), ``tl.range(warp_specialize=...)``
  (``WS``), causal programs longest first (``REV``).

A variant that does not compile is recorded with its error, not fatal. Every variant's
output is checked against SDPA's.

What it found on H100s (benchmarks/results/attention-probe_..., two sessions; the
autotuner's trials in the attention benchmark's results agree): at head dim 128 the
fastest tiles are 64 x 64 on 4 warps (two programs per SM) or 128 x 128 on 8 warps;
128 x 64 on 4 warps spills (255 registers) when offset tiles are kept across the loop.
TMA descriptors for K and V helped the hand kernel where pointers spilled (128 x 64,
4 warps: 3-10%) but in eqfuse's kernel (q, k and v through descriptors, offered to the
autotuner beside the pointer form) won none of 16 benchmark cases, 1-10% behind; the form
was taken out again. Issuing the next tile's q @ k before this tile's softmax made the
kernel slower (Triton waits for the product at once; with 4 warps it spills), persistent
programs were slower, and ``tl.range(flatten=True)`` over the nested key loops either ran
out of shared memory, failed to compile or gave wrong results. ``warp_specialize`` on the
key loop compiled only without a mask and changed nothing. A third session computed the
exponentials two at a time in half precision (``fma=2``, ex2.approx.f16x2: half the
special-function unit's work, which at 128 x 128 tiles equals the two products' tensor
time if nothing overlaps): no faster anywhere (S2048 D128: 605 against 596 us; S8192:
8608 against 8481; 8306 with TMA descriptors), twice the error. The softmax is not bound
by the exponentials but by waiting: Triton waits for each tile's q @ k before its softmax,
and nothing else has the tensor cores meanwhile.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

B, H = 4, 32
LOG: list = []


def note(**row):
    LOG.append(row)
    print(json.dumps(row), flush=True)


@triton.jit
def _softmax_pv(acc, l_i, m_i, qk, v, qk_scale, FMA: tl.constexpr):
    """Running max, rescale, second product, for one tile of raw products ``qk``. FMA = 2:
    the exponentials two at a time in half precision (ex2.approx.f16x2: half the
    special-function unit's work, which bounds the softmax at head dim 128)."""
    if FMA == 2:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        x = (qk * qk_scale - m_new[:, None]).to(tl.float16)
        p = tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x], dtype=tl.float16,
                                      is_pure=True, pack=2)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        return acc, l_i, m_new
    if FMA:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    else:
        s = qk * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _loop(acc, l_i, m_i, q, K, V, desc_k, desc_v, bh, lo, hi, offs_m, qk_scale,
          S: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
          MASKED: tl.constexpr, FMA: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr):
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    kp = K + bh * S * D + offs_d[:, None] + (lo + offs_n)[None, :] * D
    vp = V + bh * S * D + (lo + offs_n)[:, None] * D + offs_d[None, :]
    for n0 in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        if TMA:
            k = desc_k.load([bh * S + n0, 0]).T
            v = desc_v.load([bh * S + n0, 0])
        else:
            k = tl.load(kp)
            v = tl.load(vp)
        qk = tl.dot(q, k)
        if MASKED:
            qk = tl.where(offs_m[:, None] >= (n0 + offs_n)[None, :], qk, -float("inf"))
        acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, qk, v, qk_scale, FMA)
        kp += BLOCK_N * D
        vp += BLOCK_N * D
    return acc, l_i, m_i


@triton.jit
def _loop_pipelined(acc, l_i, m_i, q, K, V, desc_k, desc_v, bh, lo, hi, qk_scale,
                    S: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, FMA: tl.constexpr, TMA: tl.constexpr):
    """Unmasked keys, each tile's products q @ k issued before the previous tile's softmax,
    so that the tensor cores have work while the softmax runs (FlashAttention-3's overlap
    within a warp group, written out)."""
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    kp = K + bh * S * D + offs_d[:, None] + offs_n[None, :] * D
    vp = V + bh * S * D + offs_n[:, None] * D + offs_d[None, :]
    if lo < hi:
        if TMA:
            k = desc_k.load([bh * S + lo, 0]).T
        else:
            k = tl.load(kp + lo * D)
        qk = tl.dot(q, k)
        for n0 in range(lo + BLOCK_N, hi, BLOCK_N):
            if TMA:
                k = desc_k.load([bh * S + n0, 0]).T
                v = desc_v.load([bh * S + n0 - BLOCK_N, 0])
            else:
                k = tl.load(kp + n0 * D)
                v = tl.load(vp + (n0 - BLOCK_N) * D)
            qk_next = tl.dot(q, k)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, qk, v, qk_scale, FMA)
            qk = qk_next
        if TMA:
            v = desc_v.load([bh * S + hi - BLOCK_N, 0])
        else:
            v = tl.load(vp + (hi - BLOCK_N) * D)
        acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, qk, v, qk_scale, FMA)
    return acc, l_i, m_i


@triton.jit
def _block(Q, K, V, Out, desc_q, desc_k, desc_v, bh, pid_m, S: tl.constexpr, D: tl.constexpr, qk_scale,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, FMA: tl.constexpr,
           TMA: tl.constexpr, WS: tl.constexpr, PIPE: tl.constexpr):
    """One block of query rows of one head."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    if TMA:
        q = desc_q.load([bh * S + pid_m * BLOCK_M, 0])
    else:
        q = tl.load(Q + bh * S * D + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    mid = pid_m * BLOCK_M if CAUSAL else S
    if PIPE:
        acc, l_i, m_i = _loop_pipelined(acc, l_i, m_i, q, K, V, desc_k, desc_v, bh, 0, mid, qk_scale,
                                        S, D, BLOCK_N, FMA, TMA)
    else:
        acc, l_i, m_i = _loop(acc, l_i, m_i, q, K, V, desc_k, desc_v, bh, 0, mid, offs_m, qk_scale,
                              S, D, BLOCK_N, False, FMA, TMA, WS)
    if CAUSAL:
        acc, l_i, m_i = _loop(acc, l_i, m_i, q, K, V, desc_k, desc_v, bh, mid, mid + BLOCK_M, offs_m, qk_scale,
                              S, D, BLOCK_N, True, FMA, TMA, WS)
    out = (acc / l_i[:, None]).to(Out.dtype.element_ty)
    tl.store(Out + bh * S * D + offs_m[:, None] * D + offs_d[None, :], out)


@triton.jit
def _descriptors(Q, K, V, BH: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    desc_q = tl.make_tensor_descriptor(Q, shape=[BH * S, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    desc_k = tl.make_tensor_descriptor(K, shape=[BH * S, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    desc_v = tl.make_tensor_descriptor(V, shape=[BH * S, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    return desc_q, desc_k, desc_v


@triton.jit
def probe_attn(Q, K, V, Out, BH: tl.constexpr, S: tl.constexpr, D: tl.constexpr, qk_scale: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, FMA: tl.constexpr,
               TMA: tl.constexpr, WS: tl.constexpr, REV: tl.constexpr, PIPE: tl.constexpr):
    """One program per block of query rows and head."""
    pid_m = tl.program_id(0)
    if REV:
        pid_m = tl.num_programs(0) - 1 - pid_m
    desc_q = None
    desc_k = None
    desc_v = None
    if TMA:
        desc_q, desc_k, desc_v = _descriptors(Q, K, V, BH, S, D, BLOCK_M, BLOCK_N)
    _block(Q, K, V, Out, desc_q, desc_k, desc_v, tl.program_id(1), pid_m, S, D, qk_scale,
           BLOCK_M, BLOCK_N, CAUSAL, FMA, TMA, WS, PIPE)


@triton.jit
def probe_attn_persistent(Q, K, V, Out, BH: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                          qk_scale: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          CAUSAL: tl.constexpr, FMA: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
                          REV: tl.constexpr, PIPE: tl.constexpr, PROGRAMS: tl.constexpr, FLAT: tl.constexpr):
    """PROGRAMS programs, each walking blocks (head-major, longest first within a head)."""
    NM: tl.constexpr = S // BLOCK_M
    desc_q = None
    desc_k = None
    desc_v = None
    if TMA:
        desc_q, desc_k, desc_v = _descriptors(Q, K, V, BH, S, D, BLOCK_M, BLOCK_N)
    for t in tl.range(tl.program_id(0), NM * BH, PROGRAMS, flatten=FLAT):
        _block(Q, K, V, Out, desc_q, desc_k, desc_v, t // NM, NM - 1 - t % NM, S, D, qk_scale,
               BLOCK_M, BLOCK_N, CAUSAL, FMA, TMA, WS, PIPE)


def _alloc(size: int, align: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def hand(q, k, v, causal, bm, bn, warps, stages, fma=True, tma=False, ws=False, rev=None, pipe=False,
         programs=0, flat=False):
    """A hand-written kernel; ``programs`` > 0: that many persistent programs."""
    out = torch.empty_like(q)
    s, d = q.shape[-2], q.shape[-1]
    rev = causal if rev is None else rev
    kw = dict(BH=B * H, S=s, D=d, qk_scale=1 / math.sqrt(d) / math.log(2), BLOCK_M=bm, BLOCK_N=bn,
              CAUSAL=causal, FMA=fma, TMA=tma, WS=ws, REV=rev, PIPE=pipe, num_warps=warps, num_stages=stages)
    if programs:
        kernel, grid = probe_attn_persistent, (programs,)
        kw.update(PROGRAMS=programs, FLAT=flat)
    else:
        kernel, grid = probe_attn, (s // bm, B * H)
    compiled = []

    def run():
        k_ = kernel[grid](q, k, v, out, **kw)
        if not compiled:
            compiled.append(k_)
        return out
    run.compiled = compiled
    return run


def eqfuse_variant(compiled, q, k, v, cfg):
    from eqfuse.codegen.module import generate_module
    from eqfuse.runtime.cache import cache_key, load_module
    (kern,) = compiled.kernels
    source, _ = generate_module(compiled.plan, "probe", "probe", {kern.name: cfg})
    module = load_module(cache_key(source), source, interpret=False)
    launcher = getattr(module, f"{kern.name}_launch")

    def run():
        return module.call(q.device, [], q, k, v)[0]
    run.compiled_of = lambda: [c.kernel for c in launcher._compiled.values()]
    return run, source


def registers(fn) -> dict:
    """Registers and spills of a variant's compiled kernel, where it can be had."""
    try:
        ks = fn.compiled_of() if hasattr(fn, "compiled_of") else fn.compiled
        return {"regs": ks[0].n_regs, "spills": ks[0].n_spills} if ks else {}
    except Exception:  # noqa: BLE001 - a figure for the record only
        return {}


SM = 132
HAND_128 = [  # (bm, bn, warps, stages, switches)
    (128, 128, 8, 3, {"fma": 2}),
    (128, 128, 8, 3, {"fma": 2, "tma": True}),
    (128, 64, 4, 2, {"fma": 2}),
    (128, 64, 4, 2, {}),
    (128, 128, 8, 3, {}),
    (128, 64, 4, 2, {"tma": True}),
    (128, 64, 4, 2, {"pipe": True}),
    (128, 64, 8, 3, {"pipe": True}),
    (128, 128, 8, 3, {"pipe": True}),
    (128, 64, 8, 3, {"pipe": True, "tma": True}),
    (128, 128, 8, 3, {"pipe": True, "tma": True}),
    (128, 128, 8, 3, {"programs": SM}),
    (128, 128, 8, 3, {"programs": SM, "flat": True}),
    (128, 128, 8, 3, {"programs": SM, "flat": True, "tma": True}),
    (128, 64, 4, 2, {"programs": 2 * SM, "flat": True}),
    (128, 64, 8, 3, {"programs": SM, "flat": True, "pipe": True}),
]
HAND_64 = [
    (64, 64, 4, 3, {"fma": 2}),
    (64, 64, 4, 3, {}),
    (64, 64, 4, 3, {"pipe": True}),
    (128, 64, 4, 3, {"pipe": True}),
    (128, 64, 8, 3, {"pipe": True}),
    (64, 64, 4, 3, {"programs": 4 * SM, "flat": True}),
]
EQ_128 = [(128, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 2),
          (64, 32, 4, 3)]
EQ_64 = [(64, 64, 4, 3), (128, 64, 4, 3), (64, 32, 4, 3)]


def run_case(seq, d, causal, dtype, quick, n_hand=None, n_eqfuse=None):
    import eqfuse
    from eqfuse.examples import attention, causal_attention
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, seq, d, dtype=dtype, device="cuda") for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    compiled = eqfuse.compile(causal_attention if causal else attention, (q, k, v), validate=False, autotune=False)
    sources = {}
    for bm, bn, w, st in (EQ_128 if d == 128 else EQ_64)[: 2 if quick else n_eqfuse]:
        name = f"eqfuse {bm}x{bn} w{w} s{st}"
        fns[name], sources[name] = eqfuse_variant(compiled, q, k, v,
                                                  {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st})
    for bm, bn, w, st, sw in (HAND_128 if d == 128 else HAND_64)[: 3 if quick else n_hand]:
        name = f"hand {bm}x{bn} w{w} s{st} " + ",".join(f"{a}={int(b)}" for a, b in sw.items())
        fns[name] = hand(q, k, v, causal, bm, bn, w, st, **sw)
    good, errors = {}, {}
    for name, fn in fns.items():
        try:
            got = fn()
            torch.cuda.synchronize()
            err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            if not err < 2e-2:
                raise AssertionError(f"relative error {err}")
            good[name] = fn
            errors[name] = round(err, 6)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result
            note(case=f"S{seq} D{d}{' causal' if causal else ''}", variant=name, error=repr(e)[-600:])
            traceback.print_exc(limit=2)
    times = {n: [] for n in good}
    for _ in range(3):
        for name, fn in good.items():
            times[name].append(triton.testing.do_bench(fn, warmup=10, rep=30, return_mode="median") * 1e3)
    flops = 4 * B * H * seq * seq * d / (2 if causal else 1)
    sdpa = sorted(times["sdpa"])[1]
    for name, ts in times.items():
        us = sorted(ts)[1]
        note(case=f"S{seq} D{d}{' causal' if causal else ''} {str(dtype)[6:]}", variant=name, us=round(us, 1),
             tflops=round(flops / us / 1e6, 1), over_sdpa=round(us / sdpa, 3), rel_err=errors.get(name),
             **registers(good[name]))
    return sources


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="a few variants only (a smoke test)")
    p.add_argument("--hand", type=int, default=None, help="only the first N hand-written variants")
    p.add_argument("--eqfuse", type=int, default=None, help="only the first N eqfuse configurations")
    p.add_argument("--cases", nargs="+", default=["2048:128:0", "2048:128:1", "8192:128:1", "8192:128:0",
                                                   "2048:64:0", "2048:64:1"], help="seq:head_dim:causal")
    args = p.parse_args(argv)
    triton.set_allocator(_alloc)
    print(torch.cuda.get_device_name(), flush=True)
    t0 = time.time()
    sources = {}
    for case in args.cases:
        seq, d, causal = (int(x) for x in case.split(":"))
        sources[case] = run_case(seq, d, bool(causal), torch.float16, args.quick, args.hand, args.eqfuse)
        print(f"-- {time.time() - t0:.0f}s", flush=True)
        if args.out:  # after each case: a run cut short keeps what it measured
            from eqfuse.bench import environment
            with open(args.out, "w") as f:
                json.dump({**environment(), "batch": B, "heads": H, "rows": LOG, "sources": sources}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
