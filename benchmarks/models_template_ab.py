"""GPT-2's and BERT's block forward (inference, fp16, autotuned) compiled by eqfuse with
and without the cooperative Hopper matmul template offered, in one process, timed in the
same interleaved rounds beside eager and torch.compile, with each kernel's device time.

    python benchmarks/models_template_ab.py [--out results.json] [--untuned] [gpt2] [bert]

``--untuned``: built with ``autotune=False`` (the models benchmark's default), where the
cooperative template goes first for a light epilogue over many tiles
(``matmul_templates.first_choice``); templates compile in the background meanwhile, so the
timing waits for them.

Measured (NVIDIA H100, results/models-gpt2-bert-cooperative-ab_*): GPT-2 299.6 us with it
(the q/k/v projection and the MLP's first product took it) against 306.9 without,
torch.compile 323.2, eager 348.3; BERT 181.2 against 180.4 (its autotuner kept the
ping-pong and Triton kernels).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from common import bench_interleaved, inductor_compiled, save_results
from matmul_pingpong_block import kernel_us
from models import MODELS

import eqfuse
from eqfuse.codegen import matmul_templates


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--untuned", action="store_true", help="autotune=False: each kernel's first choice")
    p.add_argument("models", nargs="*", default=["gpt2", "bert"])
    args = p.parse_args(argv)
    os.environ["EQFUSE_PLAN_CACHE"] = "0"
    offered = matmul_templates.candidates
    rows = []
    for name in args.models:
        make, make_inputs = MODELS[name]
        torch.manual_seed(0)
        model = make().to("cuda", torch.float16).eval()
        inputs = make_inputs("cuda", torch.float16)

        def forward(*xs):
            return model(*xs)
        with torch.no_grad():
            ref = model(*inputs).float()
            fns = {"eager": lambda: model(*inputs)}
            tc, _ = inductor_compiled(forward, tuple(inputs))
            fns["torch.compile"] = lambda: tc(*inputs)
            row = {"model": name}
            for label, cooperative in (("eqfuse", True), ("eqfuse, no cooperative template", False)):
                os.environ["EQFUSE_CACHE_DIR"] = f"/tmp/eqfuse-models-template-ab-{name}-{cooperative}"
                matmul_templates.candidates = offered if cooperative else (
                    lambda s: [c for c in offered(s) if c["TEMPLATE"] != "cooperative"])
                try:
                    compiled = eqfuse.compile(forward, tuple(inputs), autotune=not args.untuned)
                finally:
                    matmul_templates.candidates = offered
                row[label] = {"templates": {k.name: k.template for k in compiled.kernels if k.template},
                              "err": round((compiled(*inputs).float() - ref).abs().max().item(), 4)}
                fns[label] = lambda c=compiled: c(*inputs)
            if args.untuned:  # the templates compiling in the background, which the twins stand in for
                time.sleep(15)
                for f in fns.values():
                    f()
            us = bench_interleaved(fns)
            per_kernel = kernel_us({k: v for k, v in fns.items() if k.startswith("eqfuse")})
        row["us"] = {k: round(v, 1) for k, v in us.items()}
        for label, times in per_kernel.items():
            row[label]["kernel_us"] = times
        print(row, flush=True)
        rows.append(row)
        save_results(args.out, rows, autotune=not args.untuned)
    return 0


if __name__ == "__main__":
    sys.exit(main())
