"""eqfuse's matmul kernels forced to each Hopper template or to the best Triton kernel,
compiled in one process and timed in the same interleaved rounds (one GPU run).

    python benchmarks/matmul_template_ab.py [--out results.json] [--only NAME]

Each variant is autotuned over its own candidates only: the ping-pong template, the
cooperative one with a loader warp (L1) or without (L0), or the Triton kernels; cuBLAS's
product alone and torch.compile alongside.

Measured (NVIDIA H100, results/matmul-cooperative-ab_*; microseconds, cuBLAS alone
first): x@W+r at 8192x4096x4096, 410.7: cooperative L1 424.5, ping-pong 451.0, Triton
463.0, torch.compile 458.8. At GPT-2's MLP output (8192x768x3072, 56.4) the Triton kernel
76.2 and ping-pong 77.0 beat the cooperative 82-85 (three 256-column tiles across N: 192
tiles on 132 SMs). gelu(x@W+b) at 8192x4096x4096 (402.8): cooperative L1 448.8, ping-pong
462.4, L0 472.5, Triton 465.6, torch.compile 469.9; at GPT-2's MLP shape (62.6) ping-pong
88.1 and L0 88.6 against L1 118.5.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from common import bench_interleaved, inductor_compiled, relative, save_results

import eqfuse
from eqfuse.codegen import configs, matmul_templates

VARIANTS = {"pingpong": ("pingpong", None), "coop L0": ("cooperative", 0), "coop L1": ("cooperative", 1),
            "triton": None}


def forced(variant, tuning_candidates):
    """``configs.tuning_candidates`` for matmul kernels: the variant's configuration alone
    (the Triton kernels where the template does not apply)."""
    def candidates(sched):
        base = tuning_candidates(sched)
        if sched.kind != "matmul":
            return base
        triton_kernels = [c for c in base if "TEMPLATE" not in c]
        if variant is None:
            return triton_kernels
        template, loader = variant
        cfg = next((c for c in matmul_templates.candidates(sched) if c["TEMPLATE"] == template), None)
        if cfg is None:
            return triton_kernels
        return [cfg if loader is None else {**cfg, "LOADER": loader}]
    return candidates


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float16, device="cuda") / shape[-1] ** 0.25


def gelu_bias(x, w, b):
    return F.gelu(x @ w + b)


def residual(x, w, r):
    return x @ w + r


WORKLOADS = [
    ("gelu(x@W+b) 8192x4096x4096", gelu_bias, lambda: (rand(8192, 4096), rand(4096, 4096), rand(4096))),
    ("gelu(x@W+b) 8192x3072x768 (GPT-2 MLP)", gelu_bias, lambda: (rand(8192, 768), rand(768, 3072), rand(3072))),
    ("x@W+r 8192x4096x4096", residual, lambda: (rand(8192, 4096), rand(4096, 4096), rand(8192, 4096))),
    ("x@W+r 8192x768x3072 (GPT-2 MLP out)", residual, lambda: (rand(8192, 3072), rand(3072, 768), rand(8192, 768))),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--only", default="", help="a substring of the workloads' names")
    args = p.parse_args(argv)
    os.environ["EQFUSE_PLAN_CACHE"] = "0"
    tuning_candidates = configs.tuning_candidates
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for name, fn, make in WORKLOADS:
        if args.only not in name:
            continue
        inputs = make()
        want = fn(*inputs)
        fns = {"cublas mm alone": lambda: inputs[0] @ inputs[1]}
        tc, _ = inductor_compiled(fn, inputs)
        fns["torch.compile"] = lambda: tc(*inputs)
        row = {"workload": name, "err": {}, "chosen": {}}
        for label, variant in VARIANTS.items():
            # a cache directory each: the autotuner's stored choices would carry over
            os.environ["EQFUSE_CACHE_DIR"] = f"/tmp/eqfuse-template-ab-{label.replace(' ', '-')}"
            configs.tuning_candidates = forced(variant, tuning_candidates)
            try:
                compiled = eqfuse.compile(fn, inputs)
            finally:
                configs.tuning_candidates = tuning_candidates
            row["chosen"][label] = [(k.template, (k.constexprs or {}).get("LOADER")) for k in compiled.kernels]
            row["err"][label] = (compiled(*inputs).float() - want.float()).abs().max().item()
            fns[f"eqfuse {label}"] = lambda c=compiled: c(*inputs)
        us = bench_interleaved(fns)
        row["us"] = {k: round(v, 1) for k, v in us.items()}
        row["over_cublas"] = relative(us, "cublas mm alone")
        print(row, flush=True)
        rows.append(row)
        save_results(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
