"""How the pipeline depth of eqfuse's matmul kernels (one program per tile) sets their time.

    python benchmarks/stages_probe.py [--models gpt2 bert] [--out results.json]

Each model of the models benchmark (benchmarks/models.py) is compiled with
``backend="eqfuse"`` (autotune off: the tile model's first choice), forward alone and
forward + backward. Every matmul kernel of the generated modules that runs one program per
tile (not the TMA form, whose stages the tile model fits separately) is then launched on
its own, on random buffers of the plan's shapes and dtypes, with 2, 3 and 4 stages and
otherwise the chosen tile: per depth its median time (triton.testing.do_bench) and its
compile seconds with an empty Triton cache. Reported beside the depth the tile model chose.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time

import torch
import triton
from common import save_results
from models import MODELS, step
from triton import knobs
from triton.testing import do_bench

import eqfuse.backend
from eqfuse.runtime.cache import cache_key, load_module
from eqfuse.schema import ops

DEPTHS = (2, 3, 4)


def _buffer(b) -> torch.Tensor:
    dtype = ops.DTYPES[b.dtype]
    n = max(1, math.prod(b.shape))
    if dtype.is_floating_point:
        return torch.randn(n, device="cuda", dtype=dtype) * 0.1
    return torch.zeros(n, device="cuda", dtype=dtype)


def probe_graph(graph, label: str) -> list[dict]:
    module, rows = load_module(cache_key(graph.source), graph.source, interpret=False), []
    for info in graph.kernels:
        launcher = getattr(module, f"{info.name}_launch", None)
        consts = dict(getattr(launcher, "constexprs", {}))
        if "BLOCK_K" not in consts or "PROGRAMS" in consts:
            continue  # not a matmul, or the TMA form
        args = [_buffer(graph.plan.buffers[p]) for p in info.params]
        warps, chosen = launcher.options.get("num_warps", 4), launcher.options.get("num_stages")
        fn, grid = launcher.fn, launcher.grid
        row = {"graph": label, "kernel": info.name, "tile": consts, "num_warps": warps, "chosen_stages": chosen}
        for depth in DEPTHS:
            knobs.cache.dir = tempfile.mkdtemp(prefix="triton-")
            t0 = time.perf_counter()
            fn[grid](*args, **consts, num_warps=warps, num_stages=depth)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            us = do_bench(lambda d=depth: fn[grid](*args, **consts, num_warps=warps, num_stages=d),
                          warmup=50, rep=300) * 1e3
            row[f"stages_{depth}"] = {"us": round(us, 2), "compile_s": round(seconds, 2)}
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["gpt2", "bert"])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows = []
    for name in a.models:
        make, make_inputs = MODELS[name]
        for training in (False, True):
            torch.manual_seed(0)
            torch._dynamo.reset()
            eqfuse.backend.history.clear()
            model = make().to("cuda", torch.float16)
            fn = step(torch.compile(model, backend="eqfuse", options={"autotune": False}), training)
            fn(*make_inputs("cuda", torch.float16))
            torch.cuda.synchronize()
            for i, graph in enumerate(list(eqfuse.backend.history)):
                mode = "forward" if not training else ("training forward", "training backward")[min(i, 1)]
                rows += probe_graph(graph, f"{name} {mode}")
    save_results(a.out, rows, triton_version=triton.__version__, depths=list(DEPTHS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
