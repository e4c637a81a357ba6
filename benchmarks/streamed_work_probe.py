"""The weight of pointwise work on an attention kernel's keys (one GPU run), inference.

    python benchmarks/streamed_work_probe.py [--out results.json] [--weights 1 4]

A Llama layer (hidden 2048, head dim 128, fp16, batch 4) compiled by eqfuse for each
sequence length on its own, once per value of the cost model's ``STREAMED_WORK``, beside
eager and torch.compile, timed in interleaved rounds. Weight 1 leaves k's rotary
embedding in the attention kernel up to 1024 tokens; 4 keeps it in a kernel of its own
(rewrite/cost.py says why). Records each plan's kernels.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from common import bench_interleaved, save_results

import eqfuse.backend
from eqfuse.models import LlamaLayer
from eqfuse.rewrite import cost

HIDDEN, HEADS, INTERMEDIATE, BATCH = 2048, 16, 5504, 4


def entry(model, tag: str):
    """``model(x)`` under a code object of its own, so that dynamo keeps one compiled graph
    per weight (a reset would drop the others)."""
    ns: dict = {}
    exec(compile(f"def f_{tag}(x):\n    return model(x)\n", f"<{tag}>", "exec"), {"model": model}, ns)
    return ns[f"f_{tag}"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--weights", type=float, nargs="+", default=[1.0, cost.STREAMED_WORK])
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 640, 1024, 2048])
    args = p.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 64
    torch.manual_seed(0)
    model = LlamaLayer(HIDDEN, HEADS, INTERMEDIATE, max(args.seqs)).cuda().half()
    compiled = {w: torch.compile(entry(model, f"w{i}"), backend="eqfuse", dynamic=False)
                for i, w in enumerate(args.weights)}
    inductor = torch.compile(entry(model, "inductor"), dynamic=False)
    rows = []
    with torch.no_grad():
        for s in args.seqs:
            x = torch.randn(BATCH, s, HIDDEN, device="cuda", dtype=torch.half)
            row = {"batch": BATCH, "seq": s, "hidden": HIDDEN, "kernels": {}, "max_rel_err": {}}
            ref = model(x)
            for w, fn in compiled.items():
                cost.STREAMED_WORK = w
                os.environ["EQFUSE_CACHE_DIR"] = f"/tmp/eqfuse-streamed-{w}"  # plans cached per weight
                out = fn(x)
                row["kernels"][w] = [k.name for k in eqfuse.backend.history[-1].plan.kernels]
                err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
                row["max_rel_err"][w] = round(err.item(), 5)
            inductor(x)
            us = bench_interleaved({"eager": lambda: model(x), "torch_compile": lambda: inductor(x),
                                    **{f"eqfuse_weight_{w}": (lambda fn=fn: fn(x)) for w, fn in compiled.items()}})
            row["us"] = {k: round(v, 1) for k, v in us.items()}
            print(row, flush=True)
            rows.append(row)
    save_results(args.out, rows, note="Llama layer (eqfuse.models) fp16 inference compiled per sequence length, "
                 "eqfuse with autotune off (EQFUSE_AUTOTUNE=0), once per STREAMED_WORK weight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
