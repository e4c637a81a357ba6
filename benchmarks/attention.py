"""Attention written plainly: eqfuse vs eager vs torch.compile vs PyTorch's own fused
attention (``F.scaled_dot_product_attention``, flash), side by side in one run.

    python benchmarks/attention.py [--seq 2048 8192] [--out results.json]

Eager and torch.compile run the same plain function eqfuse compiles (the causal one masks
with ``tril`` + ``masked_fill`` and takes the softmax in float32); SDPA is the reference
for speed and for values. Times are medians over interleaved rounds (benchmarks/common.py).
TFLOP/s counts the two products, 4*B*H*S*S*D, halved when causal. Each row also keeps
the autotuner's trials (every configuration it timed for the kernel, in microseconds).
A contender that runs out of GPU memory (eager at long sequences materialises the
B*H*S*S scores) is recorded as such. The results file is rewritten after each case.
eqfuse compiles with ``validate=False``: its own check runs the plain graph too, which
needs that memory; the output is compared with SDPA's instead.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from common import bench_interleaved, inductor_compiled, save_results

import eqfuse
from eqfuse.examples import attention, causal_attention
from eqfuse.runtime import autotune

B, H = 4, 32


def sdpa(causal: bool):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for seq in args.seq:
        for d in args.dims:
            for dtype_name in args.dtypes:
                for causal in (False, True):
                    rows.append(run_case(seq, d, getattr(torch, dtype_name), causal))
                    save_results(args.out, rows, batch=B, heads=H)  # a run cut short keeps its cases
    return 0 if all(r["matches_sdpa"] for r in rows) else 1


def run_case(seq: int, d: int, dtype, causal: bool) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, seq, d, dtype=dtype, device="cuda") for _ in range(3))
    fn = causal_attention if causal else attention
    ref = sdpa(causal)(q, k, v)
    t0 = time.perf_counter()
    tried = len(autotune.trials)
    compiled = eqfuse.compile(fn, (q, k, v), validate=False)
    eq_compile_s = time.perf_counter() - t0
    trials = [{**cfg, "us": round(us, 1)} for _, _, cfg, us in autotune.trials[tried:]]
    got = compiled(q, k, v)
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    ok = err <= (2e-2 if dtype == torch.float16 else 5e-2) and not got.isnan().any().item()
    contenders = {"sdpa": lambda: sdpa(causal)(q, k, v), "eqfuse": lambda: compiled(q, k, v)}
    failed = {}
    def inductor():
        compiled_fn = inductor_compiled(fn, (q, k, v))[0]
        return lambda: compiled_fn(q, k, v)

    for name, make in (("eager", lambda: (lambda: fn(q, k, v))), ("torch_compile", inductor)):
        try:
            f = make()
            f()
            torch.cuda.synchronize()
            contenders[name] = f
        except torch.OutOfMemoryError:
            failed[name] = "out of memory"
        torch.cuda.empty_cache()
    times = bench_interleaved(contenders)
    flops = 4 * B * H * seq * seq * d / (2 if causal else 1)

    def tflops(name):
        return round(flops / (times[name] * 1e-6) / 1e12, 1) if name in times else None

    def us(name):
        return round(times[name], 1) if name in times else None
    row = {"workload": f"attention B{B} H{H} S{seq} D{d} {str(dtype)[6:]}{' causal' if causal else ''}",
           "seq": seq, "head_dim": d, "dtype": str(dtype)[6:], "causal": causal,
           **{f"{n}_us": us(n) for n in ("eager", "torch_compile", "sdpa", "eqfuse")},
           **{f"{n}_tflops": tflops(n) for n in ("eager", "torch_compile", "sdpa", "eqfuse")},
           "eqfuse_over_sdpa": round(times["eqfuse"] / times["sdpa"], 3),
           "speedup_vs_torch_compile": round(times["torch_compile"] / times["eqfuse"], 3)
           if "torch_compile" in times else None,
           "not_run": failed, "kernels": len(compiled.kernels), "fallbacks": len(compiled.fallbacks),
           "schedule": [k.schedule.describe() for k in compiled.kernels],
           "configs": [k.constexprs | k.launch for k in compiled.kernels],
           "max_rel_err_vs_sdpa": err, "matches_sdpa": ok, "eqfuse_compile_s": round(eq_compile_s, 2),
           "autotune_trials": trials}
    cells = "  ".join(f"{n} {times[n]:8.1f} ({tflops(n):5.1f} TF)" if n in times else f"{n} {failed[n]}"
                      for n in ("eager", "torch_compile", "sdpa", "eqfuse"))
    print(f"{row['workload']:42s} {cells}  eqfuse/sdpa {row['eqfuse_over_sdpa']:.2f} "
          f"kernels={len(compiled.kernels)} ok={ok} compile {eq_compile_s:.1f}s", flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
