"""Probe (one GPU run): the Gluon flash-attention template (codegen/flash_hopper.py) against
SDPA and eqfuse's portable attention kernel, side by side, at several tile configurations.

Results (H200, benchmarks/results/flash-hopper-probe_*): a first form without warp
specialisation (8 warps in step, a thread barrier per key tile) ran level with the
portable kernel (S=2048 D=128 fp16: 633 against 630 us); the warp-specialised form with
one ring for K and V 525 us at 3 stages but 668 at 2 (each load waited for both tiles'
release); with separate K and V rings, K released once its product is done, 531-540 us
at either depth. At D=64 the portable kernel stays ahead.

    python benchmarks/flash_hopper_probe.py [--out probe.json] [--quick]

First checks the Gluon kernel's values against SDPA at ragged sizes (17, 100, 300 rows),
causal and not, head dims 64, 96, 128, 192 and 256, fp16 and bf16, on contiguous ``[B, H, S, D]`` and on
``[B, S, H, D]`` transposed (a projection's layout); then times, per benchmark case, SDPA,
eqfuse's compiled plain function (the portable kernel, autotuned) and the Gluon kernel
at a few tile configurations, in interleaved rounds (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback

import torch
import torch.nn.functional as F
import triton
from common import bench_interleaved, save_results

import eqfuse
from eqfuse.codegen.flash import padded, persistent_programs
from eqfuse.codegen.flash_hopper import CONSUMER_REGS, MAXNREG, flash_attention_hopper
from eqfuse.examples import attention, causal_attention

B, H = 4, 32
CONFIGS = [  # (BLOCK_M, BLOCK_N, STAGES, persistent)
    (128, 128, 3, False),
    (128, 128, 2, False),
    (128, 64, 3, False),
    (128, 128, 2, True),
    (128, 64, 2, False),  # head dim 256: q 64 KiB, K and V 2 x 32 KiB each
    (128, 32, 3, False),
]


def flash(q, k, v, causal: bool, cfg, out=None):
    """SDPA's function through the Gluon kernel; q, k, v [B, H, S, D] with unit stride on D."""
    bm, bn, stages, persistent = cfg
    b, h, m, d = q.shape
    n = k.shape[2]
    o = torch.empty_like(q) if out is None else out
    scale = 1 / math.sqrt(d) / math.log(2)
    grid = (triton.cdiv(m, bm), b * h)
    programs = chunk = 0
    if persistent:  # heads and rows collapse: contiguous [B, H, S, D], S a multiple of the tiles
        assert all(x.is_contiguous() for x in (q, k, v, o)) and m % bm == 0 and n % bn == 0
        programs, chunk = persistent_programs(b * h, m, n, d, q.element_size(), bm)
        grid = (programs,)
    flash_attention_hopper[grid](
        q, k, v, o, H=h, M=m, N=n, D=d, DP=padded(d), OQ=0, OK=0, OV=0, OO=0,
        SQB=q.stride(0), SQH=q.stride(1), SQM=q.stride(2),
        SKB=k.stride(0), SKH=k.stride(1), SKN=k.stride(2),
        SVB=v.stride(0), SVH=v.stride(1), SVN=v.stride(2),
        SOB=o.stride(0), SOH=o.stride(1), SOM=o.stride(2),
        SCALE=scale, CAUSAL=causal, BAND_HI=0, KT=False, GROUP=1, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages,
        CONSUMER_REGS=CONSUMER_REGS, BH=b * h, PROGRAMS=programs, CHUNK=chunk, num_warps=4, maxnreg=MAXNREG)
    return o


def rel_err(got, ref) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


CHECKS = [  # (dtype, d, s, causal, layout, cfg index)
    *[(dt, d, s, c, "bhsd", 0) for dt in ("float16", "bfloat16") for d in (64, 128) for s in (17, 300)
      for c in (False, True)],
    *[("float16", d, 100, c, "bshd", i) for d in (64, 128) for c in (False, True) for i in (0, 1, 2)],
    ("bfloat16", 128, 256, True, "bhsd", 1), ("float16", 64, 256, False, "bhsd", 2),
    ("float16", 128, 1, True, "bhsd", 0), ("float16", 64, 129, True, "bhsd", 2),
    *[(dt, 96, s, c, layout, i) for dt in ("float16", "bfloat16") for s in (17, 300) for c in (False, True)
      for layout in ("bhsd", "bshd") for i in (0, 1)],
    *[("bfloat16", 96, s, c, "bhsd", 3) for s in (128, 384) for c in (False, True)],
    *[(dt, d, s, c, "bhsd", 3) for dt in ("float16", "bfloat16") for d in (64, 128) for s in (128, 384)
      for c in (False, True)],
    *[(dt, d, s, c, layout, i) for dt in ("float16", "bfloat16") for d in (192, 256) for s in (17, 300)
      for c in (False, True) for layout in ("bhsd", "bshd") for i in (4, 5)],
]


def check_values(log):
    bad = 0
    for dtype_name, d, s, causal, layout, i in CHECKS:
        dtype, cfg = getattr(torch, dtype_name), CONFIGS[i]
        torch.manual_seed(s + d)
        shape = (2, 3, s, d) if layout == "bhsd" else (2, s, 3, d)
        q, k, v = (torch.randn(shape, dtype=dtype, device="cuda") for _ in range(3))
        if layout == "bshd":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out = torch.full_like(q, float("nan"))
        try:
            flash(q, k, v, causal, cfg, out=out)
            err = rel_err(out, ref)
            ok = err < (1e-2 if dtype == torch.float16 else 3e-2) and not out.isnan().any().item()
        except Exception as e:  # noqa: BLE001 - a probe records what fails
            err, ok = f"{type(e).__name__}: {str(e)[:300]}", False
        row = dict(check=True, dtype=dtype_name, d=d, s=s, causal=causal, layout=layout, cfg=cfg, err=err, ok=ok)
        log.append(row)
        if not ok:
            bad += 1
            print("MISMATCH", row, flush=True)
    print(f"value checks: {bad} failed of {len(CHECKS)}", flush=True)
    return bad


def time_case(seq, d, dtype, causal, log):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, seq, d, dtype=dtype, device="cuda") for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    compiled = eqfuse.compile(causal_attention if causal else attention, (q, k, v), validate=False)
    fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
           "eqfuse": lambda: compiled(q, k, v)}
    errs = {"eqfuse": rel_err(compiled(q, k, v), ref)}
    for cfg in CONFIGS:
        name = "gluon_" + "x".join(map(str, cfg[:3])) + ("_persistent" if cfg[3] else "")
        try:
            out = flash(q, k, v, causal, cfg)
            errs[name] = rel_err(out, ref)
            fns[name] = (lambda c: (lambda: flash(q, k, v, causal, c)))(cfg)
        except Exception as e:  # noqa: BLE001
            errs[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
    times = bench_interleaved(fns)
    flops = 4 * B * H * seq * seq * d / (2 if causal else 1)
    row = dict(seq=seq, d=d, dtype=str(dtype)[6:], causal=causal,
               us={n: round(t, 1) for n, t in times.items()},
               tflops={n: round(flops / t / 1e6, 1) for n, t in times.items()},
               err=errs, eqfuse_configs=[kk.constexprs | kk.launch for kk in compiled.kernels])
    log.append(row)
    best = min((t, n) for n, t in times.items() if n.startswith("gluon"))
    print(f"S{seq} D{d} {row['dtype']} {'causal' if causal else 'full  '}: sdpa {times['sdpa']:.1f}  "
          f"eqfuse {times['eqfuse']:.1f}  best gluon {best[0]:.1f} ({best[1]})  "
          f"gluon/sdpa {best[0] / times['sdpa']:.3f}  eqfuse/sdpa {times['eqfuse'] / times['sdpa']:.3f}", flush=True)
    print("   ", {n: round(t, 1) for n, t in times.items()}, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="S=2048 fp16 only")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--seq", type=int, nargs="+", help="sequence lengths timed (default 2048, 8192)")
    p.add_argument("--dims", type=int, nargs="+", default=[128, 64], help="head dims timed")
    args = p.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.uint8, device="cuda"))
    log: list = []
    bad = 0 if args.no_check else check_values(log)
    seqs = args.seq or ((2048,) if args.quick else (2048, 8192))
    cases = [(s, d, dt, c) for s in seqs for d in args.dims
             for dt in ((torch.float16,) if args.quick else (torch.float16, torch.bfloat16)) for c in (False, True)]
    for case in cases:
        try:
            time_case(*case, log)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        save_results(args.out, log, batch=B, heads=H)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
