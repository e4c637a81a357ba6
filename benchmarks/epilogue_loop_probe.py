"""Probe: does running a subtiled epilogue's two halves in a run-time loop, instead of
unrolled (``tl.static_range``, as eqfuse writes it: kernel.py ``subtiled``), buy compile
time, and what does it cost in speed? The epilogue's code is then written once: ptxas took
0.7-1.1 s on BERT's erf gelu kernel (8000 lines of PTX, 128 erf inlined per thread).

    python benchmarks/epilogue_loop_probe.py [--out results.json]

Each workload is compiled once (autotuning off); its module is then edited, loaded into
an empty Triton cache and compiled here at its first call, per variant:

* ``unrolled``: as generated;
* ``run-time loop``: ``for half in range(2)``, each accumulator's half picked by a select,
  the half's columns under names of their own (a name bound before a run-time loop is
  carried through it at one type);
* ``run-time loop, erf without branches``: also libdevice's erff written with selects in
  place of its two branches (the same polynomials: the same values to a unit in the last
  place), one basic block per erf instead of four.

Per workload and variant: Triton's stages of the slowest kernel (``cubin`` is ptxas), its
registers, and the median microseconds in interleaved rounds beside eager and torch.compile.

What it found on an H100 (benchmarks/results/epilogue-loop-probe_...; an earlier run
with the loop written by the code generator agreed): the loop cuts the slowest kernel's
compile by 25-40% (BERT's gelu backward 1.94 -> 1.17 s, 1.07 with the erf without
branches) and costs 2-31% of its speed (that backward 66.3 -> 86.9 us, 78.6, where
torch.compile took 63.5; GPT-2's tanh 84.5 -> 93.1). A kernel runs many times and
compiles once: eqfuse keeps the halves unrolled.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

os.environ["EQFUSE_PLAN_CACHE"] = "0"
os.environ["EQFUSE_AUTOTUNE"] = "0"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import bench_interleaved, inductor_compiled, save_results, stage_timer  # noqa: E402

import eqfuse  # noqa: E402
from eqfuse.runtime.cache import cache_key, load_module  # noqa: E402

SELECT_ERF = '''
@triton.jit
def _erf_selects(x):
    a = tl.abs(x)
    big = a >= 1.002959966659546
    t = tl.where(big, a, x * x)
    p = tl.where(big, 1.6425845387857407e-05, 8.483494457323104e-05)
    p = tl.fma(p, t, tl.where(big, -0.0004680210549850017, -0.0008213091641664505))
    p = tl.fma(p, t, tl.where(big, 0.0052647641859948635, 0.005213488824665546))
    p = tl.fma(p, t, tl.where(big, -0.034303076565265656, -0.026868773624300957))
    p = tl.fma(p, t, tl.where(big, 0.1532936990261078, 0.11284004896879196))
    p = tl.fma(p, t, tl.where(big, 0.9163130521774292, -0.37612664699554443))
    p = tl.fma(p, t, tl.where(big, 0.6282998323440552, 0.12837915122509003))
    u = tl.where(big, -t, x)
    r = tl.fma(p, u, u)
    e = 1.0 - tl.exp2(r)
    return tl.where(big, tl.where(x < 0, -e, e), r)

'''


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.float16) / shape[-1] ** 0.25


def gelu_grad(dy, w, h):
    """BERT's backward through gelu: (dy @ W) * gelu'(h), written out."""
    cdf = 0.5 * (1.0 + torch.erf(h * 0.7071067811865476))
    pdf = torch.exp(-0.5 * h * h) * 0.3989422804014327
    return (dy @ w) * (cdf + h * pdf)


WORKLOADS = {
    "BERT FFN gelu(x@W^T+b), 4096x3072x768": (lambda x, w, b: F.gelu(F.linear(x, w, b)),
                                              lambda: (rand(4096, 768), rand(3072, 768), rand(3072))),
    "BERT gelu backward (dy@W)*gelu'(h), 4096x3072x768": (gelu_grad,
                                                          lambda: (rand(4096, 768), rand(768, 3072),
                                                                   rand(4096, 3072))),
    "GPT-2 FFN gelu_tanh(x@W^T+b), 8192x3072x768": (lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"),
                                                    lambda: (rand(8192, 768), rand(3072, 768), rand(3072))),
    "gelu(x@W+b) 8192x4096x4096": (lambda x, w, b: F.gelu(x @ w + b),
                                   lambda: (rand(8192, 4096), rand(4096, 4096), rand(4096))),
}
VARIANTS = {"unrolled": (False, False), "run-time loop": (True, False),
            "run-time loop, erf without branches": (True, True)}

STAGES: list = []  # one dict of stage seconds per kernel compiled


def run_time_halves(source: str) -> str:
    """``source`` with each subtiled epilogue's halves in a run-time loop."""
    lines, out, i = source.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.strip() != "for half in tl.static_range(2):":
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())] + "    "
        out.append(line.replace("tl.static_range(2)", "range(2)"))
        while i < len(lines) and lines[i].startswith(indent):
            if lines[i].strip() == "if half == 0:":  # if / lo / else / hi: one select
                name, lo = lines[i + 1].strip().split(" = ")
                hi = lines[i + 3].strip().split(" = ")[1]
                out.append(f"{indent}{name} = tl.where(half == 0, {lo}, {hi})")
                i += 4
                continue
            out.append(re.sub(r"\bnindex\b", "nindex_half", re.sub(r"\bnmask\b", "nmask_half", lines[i])))
            i += 1
    return "\n".join(out)


def erf_with_selects(source: str) -> str:
    source = source.replace("tl.erf(", "_erf_selects(")
    return source.replace("\n@triton.jit", SELECT_ERF + "\n@triton.jit", 1)


def time_stages() -> None:
    from triton import knobs

    from eqfuse.runtime import ptx_loops

    def record(name, seconds):
        if name == "ttir":  # a kernel's first stage
            STAGES.append({})
        STAGES[-1][name] = seconds
    ptx_loops.install()
    knobs.runtime.add_stages_inspection_hook = stage_timer(record, knobs.runtime.add_stages_inspection_hook)


def variant(source: str, inputs, loop: bool, selects: bool):
    """The module edited as asked, its kernels compiled at a first call into an empty cache."""
    from triton import knobs
    if loop:
        source = run_time_halves(source)
    if selects:
        source = erf_with_selects(source)
    knobs.cache.dir = tempfile.mkdtemp(prefix="triton-")
    del STAGES[:]
    module = load_module(cache_key(source, "probe"), source, interpret=False)
    module.call(inputs[0].device, [], *inputs)
    torch.cuda.synchronize()
    slowest = max(STAGES, key=lambda s: sum(s.values()))
    kernels = [c.kernel for name, launcher in vars(module).items() if name.endswith("_launch")
               for c in launcher._compiled.values()]
    facts = {"slowest_kernel_stages_s": slowest, "slowest_kernel_s": round(sum(slowest.values()), 3),
             "max_regs": max(k.n_regs for k in kernels), "loop": "for half in range(2):" in source}
    return (lambda: module.call(inputs[0].device, [], *inputs)[0]), facts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    time_stages()
    rows = []
    eqfuse.compile(lambda x: x * 2, (rand(64),))(rand(64))  # the process's first compile pays for imports
    for name, (fn, make) in WORKLOADS.items():
        torch.manual_seed(0)
        inputs = make()
        ref = fn(*inputs).float()
        scale = ref.abs().max().item()
        row = {"workload": name, "variants": {}}
        tc, tc_s = inductor_compiled(fn, inputs)
        fns = {"eager": lambda: fn(*inputs), "torch.compile": lambda: tc(*inputs)}
        row["variants"]["torch.compile"] = {"compile_s": round(tc_s, 2)}
        compiled = eqfuse.compile(fn, inputs, validate=False)
        assert "for half in tl.static_range(2):" in compiled.source, "no subtiled epilogue"
        for label, (loop, selects) in VARIANTS.items():
            run, facts = variant(compiled.source, inputs, loop, selects)
            err = (run().float() - ref).abs().max().item()
            row["variants"][label] = {**facts, "max_rel_err": round(err / scale, 6)}
            fns[label] = run
        flops = 2 * ref.numel() * inputs[0].shape[-1]  # [M, N] out of M x K and K x N
        for label, us in bench_interleaved(fns).items():
            row["variants"].setdefault(label, {}).update(us=round(us, 1), tflops=round(flops / us / 1e6, 1))
        print(name, row["variants"], flush=True)
        rows.append(row)
    save_results(args.out, rows)


if __name__ == "__main__":
    sys.exit(main())
