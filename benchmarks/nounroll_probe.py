"""What keeping ptxas from unrolling K loops (eqfuse/runtime/ptx_loops.py) does to compile
time and to the kernels' speed: each workload compiled twice in one process, the mark off
then on, each into empty caches, its kernels compiled here one after another (parallel
compilation off, so that this process's switch decides), then timed side by side.

    python benchmarks/nounroll_probe.py [--out results.json]

Per workload and variant: compile seconds (eqfuse.compile and the first call, kernels
compiled serially), the
HGMMA instructions in its cubins' SASS (an unrolled K loop repeats them), and the median
microseconds in interleaved rounds beside eager.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["EQFUSE_PARALLEL_COMPILE"] = "0"  # this process compiles, under its own switch
os.environ["EQFUSE_PLAN_CACHE"] = "0"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import bench_interleaved, save_results  # noqa: E402

import eqfuse  # noqa: E402
from eqfuse.runtime import ptx_loops  # noqa: E402


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.float16) / shape[-1] ** 0.25


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v


def attention_causal(q, k, v):
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    n = s.shape[-1]
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
    return torch.softmax(s.masked_fill(~mask, float("-inf")).float(), -1).to(q.dtype) @ v


# name -> (function, inputs)
WORKLOADS = {
    "mm 4096^3": (lambda a, b: a @ b, lambda: (rand(4096, 4096), rand(4096, 4096))),
    "gelu(x@W+b) 8192x4096x4096": (lambda x, w, b: F.gelu(x @ w + b),
                                   lambda: (rand(8192, 4096), rand(4096, 4096), rand(4096))),
    "weight grad x^T @ dy, 4096 tokens, 768x768": (lambda x, dy: x.t() @ dy,
                                                    lambda: (rand(4096, 768), rand(4096, 768))),
    "BERT FFN gelu(x@W1+b1)@W2, 4096 tokens": (lambda x, w1, b1, w2: F.gelu(x @ w1 + b1) @ w2,
                                              lambda: (rand(4096, 768), rand(768, 3072), rand(3072),
                                                       rand(3072, 768))),
    "attention S2048 D128": (attention, lambda: tuple(rand(4, 32, 2048, 128) for _ in range(3))),
    "attention causal S2048 D128": (attention_causal, lambda: tuple(rand(4, 32, 2048, 128) for _ in range(3))),
}


def hgmma_count(triton_cache: str) -> int:
    from triton import knobs
    cuobjdump = knobs.nvidia.cuobjdump.path
    total = 0
    for cubin in Path(triton_cache).rglob("*.cubin"):
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True).stdout
        total += sass.count("HGMMA")
    return total


def build(fn, inputs, enabled: bool):
    from triton import knobs
    ptx_loops.ENABLED = enabled
    for name in [m for m in sys.modules if m.startswith("eqfuse_generated_")]:
        del sys.modules[name]  # a new module: new JIT functions, nothing compiled in memory
    os.environ["EQFUSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="eqfuse-")
    knobs.cache.dir = tempfile.mkdtemp(prefix="triton-")
    start = time.perf_counter()
    compiled = eqfuse.compile(fn, inputs, autotune=False)
    compiled(*inputs)
    torch.cuda.synchronize()
    return compiled, time.perf_counter() - start, hgmma_count(knobs.cache.dir)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    build(lambda x: x * 2, (rand(64),), True)  # the process's first compile pays for imports
    for name, (fn, make) in WORKLOADS.items():
        torch.manual_seed(0)
        inputs = make()
        ref = fn(*inputs).float()
        row = {"workload": name, "variants": {}}
        fns = {"eager": lambda: fn(*inputs)}
        for label, enabled in (("unrolled as ptxas chooses", False), ("nounroll", True)):
            compiled, seconds, hgmma = build(fn, inputs, enabled)
            err = (compiled(*inputs).float() - ref).abs().max().item()
            row["variants"][label] = {"compile_s": round(seconds, 2), "hgmma_in_sass": hgmma,
                                      "max_abs_err": round(err, 4), "kernels": len(compiled.kernels)}
            fns[label] = (lambda c=compiled: c(*inputs))
        for label, us in bench_interleaved(fns).items():
            row["variants"].setdefault(label, {})["us"] = round(us, 1)
        print(name, row["variants"], flush=True)
        rows.append(row)
    save_results(args.out, rows)


if __name__ == "__main__":
    main()
