"""Host overhead per call of a one-kernel graph: eqfuse vs eager vs torch.compile.

    python benchmarks/launch_overhead.py [--out results.json]

The graph is ``relu(x * 2 + y)`` on 4096 floats: its kernel takes a few microseconds on
the GPU, less than any contender needs on the host to issue a call, so calls issued
back to back without synchronising queue up behind the host, and wall time over many
calls divided by their number is the host's cost of one call (the GPU is never the
bottleneck: the script checks that a CUDA-graph replay of the eager ops is faster).
Contenders: eager PyTorch (three ops, three launches), torch.compile default and
"reduce-overhead" (CUDA graphs), eqfuse with and without CUDA graphs. The median of
ROUNDS rounds of CALLS calls each is reported.

Beside them, the floor on this host: what any call that allocates an output and launches
one kernel pays (one eager op, ``torch.empty_strided`` alone, eqfuse's kernel launched
alone into a preallocated output, a bare ``CUDAGraph.replay()``), and the pieces of
eqfuse's own call path (the signature check, the graph replayer's bookkeeping), so that
the figures say how much of a call is eqfuse's and how much the host's.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import save_results

import eqfuse

CALLS = 2000
ROUNDS = 7


def graph(x, y):
    return torch.relu(x * 2.0 + y)


def per_call_us(fns: dict, args) -> dict:
    """name -> median host microseconds per call; rounds interleave the contenders so that
    the host's drift (clock, other processes) spreads over all of them."""
    for fn in fns.values():
        for _ in range(50):
            fn(*args)
    torch.cuda.synchronize()
    rounds: dict = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fn(*args)
            torch.cuda.synchronize()
            rounds[name].append((time.perf_counter() - t0) / CALLS * 1e6)
    return {name: sorted(r)[ROUNDS // 2] for name, r in rounds.items()}


def contenders(args):
    torch._dynamo.reset()
    default = torch.compile(graph)
    reduce_overhead = torch.compile(graph, mode="reduce-overhead")
    with_graphs = eqfuse.compile(graph, args)
    without_graphs = eqfuse.compile(graph, args, cuda_graphs=False)
    assert len(with_graphs.kernels) == 1 and not with_graphs.fallbacks
    return {
        "eager": graph,
        "torch.compile": default,
        "torch.compile reduce-overhead": reduce_overhead,
        "eqfuse": without_graphs,
        "eqfuse cuda_graphs": with_graphs,
    }


def floor(fns: dict, args) -> dict:
    """What a call costs on this host before eqfuse adds anything, and eqfuse's pieces."""
    from eqfuse.runtime.compiled import _signature

    x, y = args
    variant = fns["eqfuse"]._main
    module = variant.module
    launcher = next(v for k, v in vars(module).items() if k.endswith("_launch"))
    out = torch.empty_like(x)
    replayer = fns["eqfuse cuda_graphs"]._main.graphs
    recording = next(iter(replayer._recordings.values()))[0]
    return {
        "floor: one eager op (relu)": lambda *_: torch.relu(x),
        "floor: torch.empty_strided": lambda *_: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                                    device=x.device),
        "floor: eqfuse kernel alone, output preallocated": lambda *_: launcher(x, y, out),
        "floor: CUDAGraph.replay() alone": lambda *_: recording.graph.replay(),
        "piece: eqfuse signature check": lambda *_: _signature(args),
        "piece: eqfuse generated call()": lambda *_: module.call(variant.device, [], x, y),
        "piece: eqfuse replayer (no signature check)": lambda *_: replayer(args),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--numel", type=int, default=4096)
    a = p.parse_args(argv)
    args = (torch.randn(a.numel, device="cuda"), torch.randn(a.numel, device="cuda"))
    fns = contenders(args)
    ref = graph(*args)
    for fn in fns.values():
        torch.testing.assert_close(fn(*args), ref)
    for _ in range(3):  # eqfuse records its CUDA graph at the second call: let floor() find it
        fns["eqfuse cuda_graphs"](*args)
    replay = torch.cuda.CUDAGraph()
    with torch.cuda.graph(replay):
        graph(*args)
    fns["(eager ops replayed from one CUDA graph)"] = lambda *_: replay.replay()
    fns.update(floor(fns, args))
    times = per_call_us(fns, args)
    gpu_bound = times.pop("(eager ops replayed from one CUDA graph)")
    assert fns["eqfuse cuda_graphs"]._main.graphs.replays > 0, "eqfuse's CUDA graph was never replayed"
    rows = [{"contender": name, "us_per_call": round(us, 2)} for name, us in times.items()]
    print(f"host time per call, one-kernel graph on {a.numel} floats, {torch.cuda.get_device_name()}")
    for name, us in times.items():
        print(f"  {name:30s} {us:7.2f} us")
    print(f"  (a replay of the eager ops' CUDA graph: {gpu_bound:.2f} us per call)")
    save_results(a.out, rows, numel=a.numel, calls=CALLS, rounds=ROUNDS,
                 eager_graph_replay_us=round(gpu_bound, 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
