"""What the benchmark scripts share: interleaved timing, torch.compile with its compile
time, rank correlation, and the JSON results file with the environment it was measured in."""

from __future__ import annotations

import datetime
import json
import platform
import time

import torch
import triton
import triton.testing

import eqfuse


def inductor_compiled(fn, inputs):
    """``torch.compile(fn)`` compiled for ``inputs`` by one call: (callable, seconds)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn)
    t0 = time.perf_counter()
    compiled(*inputs)
    torch.cuda.synchronize()
    return compiled, time.perf_counter() - t0


def save_results(path: str | None, rows: list, **extra) -> None:
    """Write ``rows`` with the device, date and versions they were measured with."""
    if not path:
        return
    result = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "triton": triton.__version__, "eqfuse": eqfuse.__version__,
              "python": platform.python_version(), **extra, "results": rows}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


ROUNDS = 5


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3  # us


def bench_interleaved(fns: dict) -> dict:
    """name -> median over ROUNDS rounds, each round timing every contender once."""
    times: dict = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            times[name].append(bench(fn))
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def spearman(xs, ys) -> float | None:
    if len(xs) < 3:
        return None
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    d2 = sum((a - b) ** 2 for a, b in zip(rx, ry))
    return 1 - 6 * d2 / (n * (n * n - 1))
