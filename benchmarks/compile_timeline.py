"""Cold compile seconds of the model blocks, eqfuse against torch.compile, with the compile
pool's timeline: when each kernel's compile started and ended in the pool, and how much of
it was Triton's compile and how much its C launcher's build.

    python benchmarks/compile_timeline.py [bert gpt2 llama] [--autotune] [--out results.json]

Each model runs forward (no_grad) then forward + backward, torch.compile first, each with
empty caches (this process's temporary directories) but in one process: the first compile
of the process pays for imports and the pool's start. eqfuse runs untimed unless
``--autotune``. Prints, per graph, the stage seconds of eqfuse's report.

``--phases`` then compiles each of eqfuse's kernels again, one at a time in this process
into an empty cache, timing Triton's stages (source to TTIR, TTGIR, LLVM IR, PTX, and
ptxas to the cubin) and noting its registers, spills and what it holds (a product, TMA,
erf): where a pool's wall time goes when one kernel is its slowest.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

for var in ("EQFUSE_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
    os.environ.setdefault(var, tempfile.mkdtemp(prefix=var.lower() + "-"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from common import save_results, stage_timer  # noqa: E402
from models import MODELS, first_call, step  # noqa: E402

import eqfuse.backend  # noqa: E402
from eqfuse.runtime import parallel_compile as pc  # noqa: E402

SHOW_SOURCE_S = 1.0  # --phases keeps the source of kernels that took longer than this
_jobs: list = []
_sent: list = []  # the Job objects, for --phases
_t0 = [0.0]
_compile = pc._Worker.compile


def _timed_compile(self, job, timeout):
    start = time.perf_counter()
    reply = _compile(self, job, timeout)
    _sent.append(job)
    _jobs.append({"kernel": job.name, "start_s": round(start - _t0[0], 2),
                  "end_s": round(time.perf_counter() - _t0[0], 2),
                  "compile_s": round(reply.get("seconds", 0.0) - reply.get("launcher_seconds", 0.0), 2),
                  "launcher_s": round(reply.get("launcher_seconds", 0.0), 2)})
    return reply


def phases(job) -> dict:
    """``job`` compiled again here, alone, into an empty cache: seconds per Triton stage."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from eqfuse.runtime.compile_worker import load_kernels

    seconds: dict = {}
    before = knobs.runtime.add_stages_inspection_hook  # eqfuse's (runtime/ptx_loops.py)
    knobs.cache.dir = tempfile.mkdtemp(prefix="phases-")
    knobs.runtime.add_stages_inspection_hook = stage_timer(seconds.__setitem__, before)
    try:
        fn = getattr(load_kernels(job.path, {}), job.name)
        text = open(job.path).read()
        start = time.perf_counter()
        kernel = triton.compile(ASTSource(fn, job.signature, job.constexprs, job.attrs),
                                target=GPUTarget(*job.target), options=job.options, _env_vars=job.env_vars)
        total = time.perf_counter() - start
        kernel._init_handles()  # loads the cubin: its registers and spills
    finally:
        knobs.runtime.add_stages_inspection_hook = before
    body = text[text.find(f"def {job.name}("):]
    body = body[:body.find("\n@triton.jit", 1) if "\n@triton.jit" in body else len(body)]
    return {"kernel": job.name, "total_s": round(total, 3), "stages_s": seconds,
            "source_s": round(total - sum(seconds.values()), 3),
            "regs": kernel.n_regs, "spills": kernel.n_spills, "num_warps": kernel.metadata.num_warps,
            "dot": "tl.dot" in body, "tma": "make_tensor_descriptor" in body, "erf": "erf" in body,
            "lines": body.count("\n"), **({"source": body} if total > SHOW_SOURCE_S else {})}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="*", default=["bert", "gpt2", "llama"])
    p.add_argument("--autotune", action="store_true")
    p.add_argument("--phases", action="store_true", help="time Triton's stages of each kernel, alone")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    pc._Worker.compile = _timed_compile
    rows = []
    for name in args.models:
        make, make_inputs = MODELS[name]
        torch.manual_seed(0)
        model = make().to("cuda", torch.float16)
        inputs = make_inputs("cuda", torch.float16)
        for training in (False, True):
            row = {"model": name, "mode": "forward+backward" if training else "forward"}
            for contender in ("torch.compile", "eqfuse"):
                torch._dynamo.reset()
                eqfuse.backend.history.clear()
                _jobs.clear()
                _sent.clear()
                kw = ({"backend": "eqfuse", "options": {"autotune": args.autotune}} if contender == "eqfuse"
                      else {})
                _t0[0] = time.perf_counter()
                seconds, _ = first_call(step(torch.compile(model, **kw), training), inputs)
                row[contender] = {"compile_s_cold": round(seconds, 2)}
                if contender == "eqfuse":
                    row[contender]["stages_s"] = [g.report.get("seconds", {}) for g in eqfuse.backend.history]
                    row[contender]["pool_jobs"] = sorted(_jobs, key=lambda j: j["start_s"])
                    if args.phases:
                        row[contender]["phases"] = sorted((phases(j) for j in _sent), key=lambda r: -r["total_s"])
                        for r in row[contender]["phases"]:
                            print("   ", r, flush=True)
            print(name, row["mode"], {c: row[c]["compile_s_cold"] for c in ("torch.compile", "eqfuse")},
                  *row["eqfuse"]["stages_s"], sep="\n  ", flush=True)
            rows.append(row)
    save_results(args.out, rows, eqfuse_options={"autotune": args.autotune})


if __name__ == "__main__":
    main()
