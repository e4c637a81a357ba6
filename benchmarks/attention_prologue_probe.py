"""Probe (one GPU run): what the Hopper flash template does for attention kernels that
did not reach it before, side by side with SDPA, torch.compile and eqfuse's portable kernel.

    python benchmarks/attention_prologue_probe.py [--out probe.json]

Cases (B=4, H=32, S=2048, D=128, fp16, causal with tril + masked_fill, untuned builds):
- q scaled by a weight vector before the product (a pointwise prologue on q, as Llama's
  rotary embedding is): eqfuse as extraction plans it now (on Hopper the portable kernel
  is costed at its measured rate, rewrite/cost.py: the prologue becomes a kernel of its
  own and the attention runs as the template) against the plan that keeps the prologue
  fused (the cost factor set to 1);
- k stored transposed ([B, H, D, S], the layout Llama's plan writes k in): the template
  reading k^T's boxes against the portable kernel.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from common import bench_interleaved, inductor_compiled, save_results

import eqfuse
from eqfuse.examples import causal_attention
from eqfuse.rewrite import cost

B, H, S, D = 4, 32, 2048, 128


def scaled_q_attention(q, k, v, w):
    return causal_attention(q * w, k, v)


def build(fn, inputs, slowdown: float, portable: bool = False):
    """eqfuse's untuned build of ``fn``, extracted with the portable kernel costed at
    ``slowdown`` at every tile width; ``portable``: its attention kernel as the portable kernel."""
    before = cost.PORTABLE_ATTENTION_SLOWDOWN
    cost.PORTABLE_ATTENTION_SLOWDOWN = dict.fromkeys(before, slowdown)
    try:
        if portable:
            from eqfuse.codegen import flash
            saved = flash.candidates
            flash.candidates = lambda sched: []
            try:
                return eqfuse.compile(fn, inputs, autotune=False, validate=False, plan_cache=False)
            finally:
                flash.candidates = saved
        return eqfuse.compile(fn, inputs, autotune=False, validate=False, plan_cache=False)
    finally:
        cost.PORTABLE_ATTENTION_SLOWDOWN = before


def describe(compiled) -> list:
    return [f"{k.name}: {k.template or k.schedule.kind}" for k in compiled.kernels]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    torch.manual_seed(0)
    rows = []
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float16, device="cuda") for _ in range(3))
    w = torch.rand(D, dtype=torch.float16, device="cuda") + 0.5
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # k's values, stored [B, H, D, S]
    cases = [("q * w prologue", scaled_q_attention, (q, k, v, w), lambda: F.scaled_dot_product_attention(
                  q * w, k, v, is_causal=True),
              {"eqfuse, prologue a kernel of its own": (1.3, False),
               "eqfuse, prologue fused (portable kernel)": (1.0, False)}),
             ("k stored transposed", causal_attention, (q, kt, v), lambda: F.scaled_dot_product_attention(
                  q, kt, v, is_causal=True),
              {"eqfuse, template": (1.3, False), "eqfuse, portable kernel": (1.3, True)})]
    for name, fn, inputs, reference, variants in cases:
        want = reference()
        fns = {"sdpa": reference}
        tc, _ = inductor_compiled(fn, inputs)
        fns["torch.compile"] = lambda tc=tc, inputs=inputs: tc(*inputs)
        row = {"case": name, "kernels": {}, "max_abs_err_vs_sdpa": {}}
        for label, (slowdown, portable) in variants.items():
            compiled = build(fn, inputs, slowdown, portable)
            row["kernels"][label] = describe(compiled)
            row["max_abs_err_vs_sdpa"][label] = round((compiled(*inputs).float() - want.float()).abs().max().item(), 5)
            fns[label] = lambda c=compiled, inputs=inputs: c(*inputs)
        row["us"] = {key: round(t, 1) for key, t in bench_interleaved(fns).items()}
        print(row, flush=True)
        rows.append(row)
        save_results(args.out, rows, batch=B, heads=H, seq=S, head_dim=D)
    return 0


if __name__ == "__main__":
    sys.exit(main())
