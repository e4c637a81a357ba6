"""Start-up and dispatch of a small model: the JIT path (``eqfuse.compile``) against the
exported path (``eqfuse export`` + ``eqfuse.runtime.load_exported``, no Triton).

    python benchmarks/export_startup.py [--out results.json] [--repeats 3]

The model is eqfuse.models.LlamaLayer (hidden 64, 4 heads, MLP 128; batch 2, sequence 64,
float16): seven kernels, no eager step. Start-up is timed in fresh processes, from the
parent's spawn to the first result on the host after ``torch.cuda.synchronize()``; it is
split at the end of ``import torch``, which both paths pay alike. Each child makes the
same input, runs the graph once and checks it against eager. The JIT path runs twice:
with empty caches (eqfuse's module cache and Triton's kernel cache: every kernel compiled)
and with the caches the first run left (the plan is still captured, saturated and
extracted; Triton loads the compiled kernels from its cache). Dispatch is the host time
per call, in this process, of 500 calls back to back on the same inputs (the GPU work of
this model is a few microseconds, so the host is what is measured), median of interleaved
rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import save_results

import eqfuse
from eqfuse.export import export_graph
from eqfuse.runtime import load_exported

SHAPE = (2, 64, 64)  # batch, sequence, hidden

CHILD = r"""
import sys, time, json
import torch
after_torch = time.time()
mode, directory = sys.argv[1:]
from eqfuse.models import LlamaLayer
torch.manual_seed(0)
x = torch.randn(*SHAPE, dtype=torch.float16, device="cuda")
if mode == "exported":
    from eqfuse.runtime import load_exported
    out = load_exported(directory)(x)
else:
    import eqfuse
    model = LlamaLayer().to("cuda", torch.float16)
    out = eqfuse.compile(model, (x,))(x)
torch.cuda.synchronize()
first_result = time.time()
torch.save(out, directory + "/child_out.pt")
print(json.dumps({"after_torch": after_torch, "first_result": first_result,
                  "triton_imported": "triton" in sys.modules}))
""".replace("SHAPE", repr(SHAPE))


def model_and_input():
    from eqfuse.models import LlamaLayer
    torch.manual_seed(0)
    x = torch.randn(*SHAPE, dtype=torch.float16, device="cuda")
    model = LlamaLayer().to("cuda", torch.float16)
    return model, x


def start_up(mode: str, directory: str, env: dict, reference) -> dict:
    """One fresh process: seconds from spawn to the end of ``import torch``, and from there to the first result."""
    spawned = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, directory], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} child failed:\n{proc.stderr[-3000:]}")
    t = json.loads(proc.stdout.strip().splitlines()[-1])
    out = torch.load(os.path.join(directory, "child_out.pt"))
    err = (out.float() - reference.float()).abs().max().item()
    return {"spawn_to_torch_s": round(t["after_torch"] - spawned, 4),
            "torch_to_first_result_s": round(t["first_result"] - t["after_torch"], 4),
            "spawn_to_first_result_s": round(t["first_result"] - spawned, 4),
            "triton_imported": t["triton_imported"], "max_abs_err_vs_eager": err}


def dispatch_us(fn, x, calls: int = 500) -> float:
    for _ in range(50):
        fn(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("export_startup.py measures on a CUDA GPU; none here")

    model, x = model_and_input()
    reference = model(x)
    work = Path(tempfile.mkdtemp(prefix="eqfuse-export-bench-"))
    export_dir = work / "exported"
    compiled = eqfuse.compile(model, (x,))
    major, minor = torch.cuda.get_device_capability()
    t0 = time.perf_counter()
    export_graph(compiled, export_dir, arch=f"sm_{major}{minor}")
    export_s = time.perf_counter() - t0
    print(f"exported {len(compiled.kernels)} kernels in {export_s:.2f} s to {export_dir}")

    contenders = {"eager": model, "jit": compiled, "exported": load_exported(export_dir),
                  "jit, cuda_graphs=False": eqfuse.compile(model, (x,), cuda_graphs=False),
                  "exported, cuda_graphs=False": load_exported(export_dir, cuda_graphs=False)}
    times = {name: [] for name in contenders}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, fn in contenders.items():
                times[name].append(dispatch_us(fn, x))
    rows = []
    for name, ts in times.items():
        us = statistics.median(ts)
        rows.append({"path": name, "kind": "dispatch", "host_us_per_call": round(us, 2),
                     "rounds_us": [round(t, 2) for t in ts]})
        print(f"dispatch {name:24s} {us:8.2f} us per call", flush=True)
    env = dict(os.environ, EQFUSE_CACHE_DIR=str(work / "eqfuse-cache"), TRITON_CACHE_DIR=str(work / "triton-cache"))
    cold = start_up("jit", str(work), env, reference)
    rows.append({"path": "jit, empty caches", "kind": "start-up", **cold})
    for mode, label in (("jit", "jit, warm caches"), ("exported", "exported")):
        runs = [start_up(mode, str(export_dir if mode == "exported" else work), env, reference)
                for _ in range(args.repeats)]
        best = sorted(runs, key=lambda r: r["spawn_to_first_result_s"])[len(runs) // 2]  # the median run
        rows.append({"path": label, "kind": "start-up", **best,
                     "all_spawn_to_first_result_s": [r["spawn_to_first_result_s"] for r in runs]})
    for r in (r for r in rows if r["kind"] == "start-up"):
        print(f"{r['path']:20s} spawn->torch {r['spawn_to_torch_s']:.3f} s, torch->first result "
              f"{r['torch_to_first_result_s']:.3f} s, total {r['spawn_to_first_result_s']:.3f} s, "
              f"triton imported: {r['triton_imported']}, max err {r['max_abs_err_vs_eager']:.2e}")

    save_results(args.out, rows, model="LlamaLayer(hidden=64, heads=4, intermediate=128)",
                 input_shape=list(SHAPE), dtype="float16", kernels=len(compiled.kernels), export_seconds=export_s,
                 autotune=os.environ.get("EQFUSE_AUTOTUNE", "1") != "0")


if __name__ == "__main__":
    main(sys.argv[1:])
