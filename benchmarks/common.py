"""What the benchmark scripts share: interleaved timing, torch.compile with its compile
time, rank correlation, and the JSON results file with the environment it was measured in."""

from __future__ import annotations

import json
import time

import torch

from eqfuse.bench import environment, gpu_us, spearman  # noqa: F401 - spearman is used by the scripts


def inductor_compiled(fn, inputs):
    """``torch.compile(fn)`` compiled for ``inputs`` by one call: (callable, seconds)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn)
    t0 = time.perf_counter()
    compiled(*inputs)
    torch.cuda.synchronize()
    return compiled, time.perf_counter() - t0


def stage_timer(record, before=None):
    """A Triton stages-inspection hook (``knobs.runtime.add_stages_inspection_hook``) that
    runs ``before`` (the hook already set: eqfuse's, runtime/ptx_loops.py), then times every
    stage of each compile: ``record(stage name, seconds)`` as each ends, ``ttir`` first."""
    def hook(backend, stages, options, language, capability):
        if before is not None:
            before(backend, stages, options, language, capability)
        for name in list(stages):
            stages[name] = timed(name, stages[name])

    def timed(name, stage):
        def run(src, metadata):
            t = time.perf_counter()
            out = stage(src, metadata)
            record(name, round(time.perf_counter() - t, 3))
            return out
        return run
    return hook


def save_results(path: str | None, rows: list, **extra) -> None:
    """Write ``rows`` with the device, date and versions they were measured with."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump({**environment(), **extra, "results": rows}, f, indent=1)


ROUNDS = 5


bench = gpu_us  # median microseconds, L2 flushed


def relative(us: dict, base: str) -> dict:
    """Each contender's time over ``base``'s, to three places."""
    return {name: round(t / us[base], 3) for name, t in us.items()}


def bench_interleaved(fns: dict, window_ms: float = 50.0) -> dict:
    """name -> median over ROUNDS rounds (``bench_rounds``)."""
    return {name: sorted(ts)[len(ts) // 2] for name, ts in bench_rounds(fns, window_ms).items()}


def bench_rounds(fns: dict, window_ms: float = 50.0) -> dict:
    """name -> [microseconds in each of ROUNDS rounds], each round timing every contender
    once, each time over a window of at least ``window_ms``. Each round starts one
    contender further on: times drift within a run by a few percent, and a contender
    always timed last in its round meets the drift first (the zoo's Llama and Qwen2
    training steps on an H200: eqfuse 0.95x torch.compile in three windows timed last,
    1.00-1.04x in two windows rotated; docs/zoo.md)."""
    times: dict = {name: [] for name in fns}
    names = list(fns)
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(round(bench(fns[name], window_ms), 1))
    return times
