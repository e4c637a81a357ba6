"""A Llama layer whose batch changes from call to call (one GPU run), inference.

    python benchmarks/dynamic_batch.py [--out results.json] [--batches 2 3 4 6 8]

Four ways, side by side, for each batch in turn: eager; eqfuse with the batch marked
dynamic (``torch._dynamo.mark_dynamic``: the first batch compiles, the second builds the
sized module, codegen/sized.py, which runs every batch after); eqfuse compiled for each
batch on its own (``dynamic=False``: one full compile per batch, each kernel specialised
to it); torch.compile with the batch marked dynamic. Records each first call's seconds
(what a new batch costs) and each way's median microseconds once compiled, timed in
interleaved rounds.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import bench_interleaved, save_results

import eqfuse.backend
from eqfuse.models import LlamaLayer

SEQ, HIDDEN, HEADS, INTERMEDIATE = 1024, 2048, 16, 5504


def first_call(fn, x) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(x)
    torch.cuda.synchronize()
    return round(time.perf_counter() - t0, 3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--batches", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    args = p.parse_args(argv)
    # One code object compiled by three backends, and once per batch by one of them
    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    torch.manual_seed(0)
    model = LlamaLayer(HIDDEN, HEADS, INTERMEDIATE, SEQ).cuda().half()
    inputs = {b: torch.randn(b, SEQ, HIDDEN, device="cuda", dtype=torch.half) for b in args.batches}
    for x in inputs.values():
        torch._dynamo.mark_dynamic(x, 0)
    rows = []
    with torch.no_grad():
        torch._dynamo.reset()
        dynamic = torch.compile(model, backend="eqfuse")
        inductor = torch.compile(model)
        for b, x in inputs.items():
            static = torch.compile(model, backend="eqfuse", dynamic=False)
            graphs_before = len(eqfuse.backend.history)
            row = {"batch": b, "seq": SEQ, "hidden": HIDDEN,
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
    save_results(args.out, rows, note="Llama layer (eqfuse.models) fp16 inference, the batch changing between "
                 "calls; eqfuse with autotune off (EQFUSE_AUTOTUNE=0), as in benchmarks/models.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
