"""Probe (one GPU run): is a model's training step bound by the host or by the GPU?

    python benchmarks/host_step_probe.py [gpt2|bert|llama] [--out probe.json]

For eager, torch.compile and eqfuse (models.py's blocks and contenders, plus eqfuse with
CUDA graphs asked for on every graph), the host's time to enqueue one step with the GPU kept busy (a spin
kernel first, so that the host never waits on it; median of five rounds of four steps),
the step's median time as models.py measures it, and the peak memory of a step. Where
the host's time exceeds the GPU's, the step's time follows the host's speed.

What it found on an H100 (benchmarks/results/host-step-probe_..., before training graphs
replayed CUDA graphs): every contender's step takes the host longer than the GPU. GPT-2
block B8 S1024: the host enqueues a step in 1.9 ms in eager, 2.5 under torch.compile and
2.7 under eqfuse (its kernels take 1.25-1.3 ms), and the steps' times follow (1.6, 2.4
and 2.7 ms). BERT layer: 3.0, 2.5 and 2.3 ms of host time, steps of 2.5, 2.3 and 2.0 ms.
That is why the backend now has short training graphs replay CUDA graphs, attention
steps included (eqfuse/backend.py); each row records how many calls each graph replayed
and, where one did not record, why.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

for var in ("EQFUSE_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
    os.environ.setdefault(var, tempfile.mkdtemp(prefix=var.lower() + "-"))

import torch  # noqa: E402
from common import save_results  # noqa: E402
from models import CONTENDERS, MODELS, step  # noqa: E402

import eqfuse  # noqa: E402
from eqfuse.bench import gpu_us  # noqa: E402


def host_us(fn, inputs, steps: int = 4, rounds: int = 5) -> float:
    """Median host microseconds to enqueue one step while the GPU is busy."""
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU spin ahead of the steps
        t0 = time.perf_counter()
        for _ in range(steps):
            fn(*inputs)
        times.append((time.perf_counter() - t0) / steps * 1e6)
        torch.cuda.synchronize()
    return sorted(times)[rounds // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default="gpt2", choices=list(MODELS))
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    make, make_inputs = MODELS[a.model]
    torch.manual_seed(0)
    model = make().to("cuda", torch.float16)
    inputs = make_inputs("cuda", torch.float16)
    contenders = {"eager": None, "torch.compile": CONTENDERS["torch.compile"], "eqfuse": CONTENDERS["eqfuse"],
                  "eqfuse+graphs": {"backend": "eqfuse", "options": {"autotune": False, "cuda_graphs": True}}}
    rows = []
    for name, kw in contenders.items():
        # Each contender measured right after its compile: a dynamo reset for the next one
        # would have it compile again, outside what graphs names
        torch._dynamo.reset()
        eqfuse.backend.history.clear()
        fn = step(model if kw is None else torch.compile(model, **kw), True)
        for _ in range(4):
            fn(*inputs)
        graphs = list(eqfuse.backend.history)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        row = {"model": a.model, "contender": name, "host_us": round(host_us(fn, inputs), 1),
               "step_us": round(gpu_us(lambda f=fn: f(*inputs)), 1),
               "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
               "reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1)}
        if graphs:  # how many of its calls each graph served from a CUDA graph
            replayers = [g._main.graphs for g in graphs]
            row["replays"] = [r.replays if r else None for r in replayers]
            row["not_recorded"] = [r.disabled if r else None for r in replayers]
            row["modelled_us"] = [round(g._main.plan.cost, 1) for g in graphs]
        rows.append(row)
        print(row, flush=True)
        del fn
    save_results(a.out, rows, dtype="float16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
