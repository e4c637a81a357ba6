"""A Llama layer whose batch or sequence length changes from call to call (one GPU run), inference.

    python benchmarks/dynamic_batch.py [--out results.json] [--dim batch|seq] [--sizes 2 3 4 6 8]

Four ways, side by side, for each size in turn: eager; eqfuse with the dimension marked
dynamic (``torch._dynamo.mark_dynamic``: the first size compiles, the second builds the
sized module, codegen/sized.py, which runs every size after); eqfuse compiled for each
size on its own (``dynamic=False``: one full compile per size, each kernel specialised
to it); torch.compile with the dimension marked dynamic. Records each first call's seconds
(what a new size costs) and each way's median microseconds once compiled, timed in
interleaved rounds. ``--dim batch``: sequence 1024, batches 2-8; ``--dim seq``: batch 4,
sequences 512-2048.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import bench_interleaved, save_results

import eqfuse.backend
from eqfuse.models import LlamaLayer

SEQ, BATCH, HIDDEN, HEADS, INTERMEDIATE = 1024, 4, 2048, 16, 5504
DEFAULT_SIZES = {"batch": [2, 3, 4, 6, 8], "seq": [512, 640, 1024, 1536, 2048]}


def first_call(fn, x) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(x)
    torch.cuda.synchronize()
    return round(time.perf_counter() - t0, 3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--dim", choices=list(DEFAULT_SIZES), default="batch")
    p.add_argument("--sizes", type=int, nargs="+")
    args = p.parse_args(argv)
    sizes = args.sizes or DEFAULT_SIZES[args.dim]
    dim = 0 if args.dim == "batch" else 1
    # One code object compiled by three backends, and once per batch by one of them
    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    torch.manual_seed(0)
    model = LlamaLayer(HIDDEN, HEADS, INTERMEDIATE, max(SEQ, *sizes)).cuda().half()
    shape = (lambda n: (n, SEQ, HIDDEN)) if dim == 0 else (lambda n: (BATCH, n, HIDDEN))
    inputs = {n: torch.randn(*shape(n), device="cuda", dtype=torch.half) for n in sizes}
    for x in inputs.values():
        torch._dynamo.mark_dynamic(x, dim)
    rows = []
    with torch.no_grad():
        torch._dynamo.reset()
        dynamic = torch.compile(model, backend="eqfuse")
        inductor = torch.compile(model)
        for x in inputs.values():
            static = torch.compile(model, backend="eqfuse", dynamic=False)
            graphs_before = len(eqfuse.backend.history)
            row = {"batch": x.shape[0], "seq": x.shape[1], "hidden": HIDDEN,
                   "first_call_s": {"eqfuse_dynamic": first_call(dynamic, x)}}
            row["eqfuse_dynamic_compiled_graphs"] = len(eqfuse.backend.history) - graphs_before
            row["first_call_s"]["torch_compile_dynamic"] = first_call(inductor, x)
            x_static = x.clone()  # unmarked: compiled for this batch alone
            row["first_call_s"]["eqfuse_per_batch"] = first_call(static, x_static)
            ref = model(x)
            for name, fn, inp in (("eqfuse_dynamic", dynamic, x), ("eqfuse_per_batch", static, x_static),
                                  ("torch_compile_dynamic", inductor, x)):
                err = ((fn(inp).float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                row.setdefault("max_rel_err", {})[name] = round(err, 5)
            us = bench_interleaved({"eager": lambda: model(x), "eqfuse_dynamic": lambda: dynamic(x),
                                    "eqfuse_per_batch": lambda: static(x_static),
                                    "torch_compile_dynamic": lambda: inductor(x)})
            row["us"] = {k: round(v, 1) for k, v in us.items()}
            print(row, flush=True)
            rows.append(row)
    save_results(args.out, rows, note=f"Llama layer (eqfuse.models) fp16 inference, the {args.dim} changing "
                 "between calls; eqfuse with autotune off (EQFUSE_AUTOTUNE=0), as in benchmarks/models.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
