"""Probe (one GPU run): GPT-2's block forward (inference) compiled by eqfuse with the ping-pong
matmul template (codegen/matmul_hopper.py) on both products it wins when timed alone (the
q/k/v projection, N = 2304; the MLP's first product, N = 3072), on one of them, or on none;
the block timed in interleaved rounds and each kernel's device time under the profiler.

    python benchmarks/matmul_pingpong_block.py [--out probe.json]

Measured (NVIDIA H100): with the MLP product's epilogue (bias, tanh-form gelu) unrolled
over each tile (results/models-gpt2-pingpong-which_*), it ran 87-88 us in the block
against the Triton kernel's 82, though 75 against 84 alone on the block's own data: two
copies of its code overflowed the instruction cache. Run in chunks of rows
(results/models-gpt2-pingpong-chunked-block_*): 73.9 against 81.5; the block, both as the
template 306.0 us, MLP only 320.8, q/k/v only 314.8, none 316.4.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from common import bench_interleaved, save_results
from models import MODELS
from torch.profiler import ProfilerActivity, profile

import eqfuse
from eqfuse.codegen import matmul_templates

VARIANTS = {"both": {2304, 3072}, "mlp only": {3072}, "qkv only": {2304}, "none": set()}


def kernel_us(fns: dict, rounds: int = 5) -> dict:
    """label -> kernel name -> median device microseconds, the labels profiled in turn."""
    times: dict = {label: {} for label in fns}
    for _ in range(rounds):
        for label, f in fns.items():
            for _ in range(3):
                f()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    f()
                torch.cuda.synchronize()
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    times[label].setdefault(e.name, []).append(e.device_time)
    return {label: {k: round(sorted(v)[len(v) // 2], 1) for k, v in ks.items()} for label, ks in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.pop("EQFUSE_PINGPONG", None)  # the template on (its default)
    os.environ["EQFUSE_PLAN_CACHE"] = "0"
    offered = matmul_templates.candidates
    make, make_inputs = MODELS["gpt2"]
    torch.manual_seed(0)
    model = make().to("cuda", torch.float16).eval()
    inputs = make_inputs("cuda", torch.float16)
    fns, rows = {}, {}
    with torch.no_grad():
        for label, ns in VARIANTS.items():
            # a cache directory each: the autotuner's stored choices would carry over
            os.environ["EQFUSE_CACHE_DIR"] = f"/tmp/eqfuse-pingpong-block-{label.replace(' ', '-')}"
            matmul_templates.candidates = lambda sched, ns=ns: offered(sched) if sched.n in ns else []
            compiled = eqfuse.compile(lambda *xs: model(*xs), tuple(inputs))
            rows[label] = {"templates": [k.name for k in compiled.kernels if k.template]}
            fns[label] = lambda c=compiled: c(*inputs)
        matmul_templates.candidates = offered
        us = bench_interleaved(fns)
        per_kernel = kernel_us(fns)
    for label in fns:
        rows[label].update(us=round(us[label], 1), kernel_us=per_kernel[label])
        print(label, rows[label], flush=True)
    save_results(args.out, [{"variant": k, **v} for k, v in rows.items()], model="gpt2 forward, 8 x 1024 tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
