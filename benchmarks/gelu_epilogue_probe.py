"""Probe (one GPU run): what does the epilogue of gelu(x @ W + b) cost, and what hides it?

    python benchmarks/gelu_epilogue_probe.py [--out probe.json] [--quick]

At 8192 x 4096 x 4096 fp16 eqfuse's fused kernel took 1.15x cuBLAS's product alone
(benchmarks/results/matmul_...), while its plain 8192^3 product is within 1% of cuBLAS.
This times eqfuse's generated kernel (the plan compiled once, the module regenerated per
tile configuration, as the autotuner does) with its epilogue edited in the source:

* ``exact``: as generated (bias, erf gelu, the graph's casts);
* ``nocast``: without the fp16 round trip the decomposition puts before the store;
* ``bias``: bias only, no gelu;
* ``none``: the accumulator stored as it is;
* ``fast_erf``: erf from Abramowitz and Stegun 7.1.26 (absolute error 1.5e-7: one
  approximate reciprocal, one exp2, five FMAs) instead of libdevice's erff;
* ``poly_erf``: erf without branches, to float32 accuracy: x P(x^2) below 0.921875,
  1 - exp(Q(|x|) - x^2) above (least-squares fits; both computed, one selected).

beside cuBLAS's product alone, eager (addmm + gelu) and torch.compile, on random inputs
(tensor cores draw less power on zeros, and the clock follows the power), medians of
interleaved rounds, L2 flushed.

What it found on H100s (benchmarks/results/gelu-epilogue-probe_..., two runs): the TMA
form's product with no epilogue runs at 1.01x cuBLAS (399 against 394 us), one program per
tile at 1.08-1.10x. The gelu epilogue adds 48-70 us: at 128 x 256 an SM holds one program,
so nothing overlaps a tile's epilogue arithmetic (33.5M erf, issue-bound). libdevice's erff
spills 12-16 registers there; A&S 7.1.26 does not, and in the TMA form gave 447 us against
471 (torch.compile: cuBLAS + a gelu kernel, 450), but its absolute error near 0 makes it
no general erf. The branch-free fit (``poly_erf``) costs more than it saves. Tiles that
let two programs share an SM (128 x 128) lose more in the product than they hide.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing
from common import save_results

M, N, K = 8192, 4096, 4096
LOG: list = []

FAST_ERF = '''
@triton.jit
def _fast_erf(x):
    # Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7
    a = tl.abs(x)
    t = tl.fdiv(1.0, 1.0 + 0.3275911 * a)  # div.full.f32: approximate, no IEEE rounding
    p = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    y = 1.0 - p * tl.exp2(-1.4426950408889634 * a * a)
    return tl.where(x < 0, -y, y)

'''

POLY_ERF = '''
@triton.jit
def _poly_erf(x):
    a = tl.abs(x)
    s = x * x
    small = x * (1.1283791669000527 + s * (-0.37612634941385537 + s * (0.11283708417276159 + s * (
        -0.026859956802533877 + s * (0.0052021751139599 + s * (-0.0008153773140525677 + s * 8.410998370338152e-05))))))
    t = tl.minimum(a, 4.0)
    q = 0.00030254106347185584 + t * (-1.1301639752148425 + t * (0.36805835865939085 + t * (
        -0.10997404107717278 + t * (0.026362377034772247 + t * (-0.004739416536036992 + t * (
            0.000592601466091941 + t * (-4.557115369491216e-05 + t * 1.6131002842367792e-06)))))))
    big = 1.0 - tl.exp2((q - t * t) * 1.4426950408889634)
    return tl.where(a < 0.921875, small, tl.where(x < 0, -big, big))

'''


def gelu_linear(x, w, b):
    return F.gelu(x @ w + b)


def edit(source: str, how: str) -> str:
    """The generated module with its epilogue changed as ``how`` says."""
    if how == "exact":
        return source
    if how == "nocast":
        return source.replace(".to(tl.float16).to(tl.float32)", "")
    if how in ("fast_erf", "poly_erf"):
        source = re.sub(r"tl\.erf\(", f"_{how}(", source)
        helper = FAST_ERF if how == "fast_erf" else POLY_ERF
        return source.replace("\n\n@triton.jit", "\n" + helper + "@triton.jit", 1)
    store = re.search(r"tl\.store\((\w+) \+ (.*?), \((\w+)\)\.to", source)
    assert store, "no store found in the generated kernel"
    if how == "bias":
        biased = re.search(r"(t\d+) = \(acc\d+ \+ v\d+\)", source).group(1)
        return source.replace(f"({store.group(3)}).to", f"({biased}).to")
    if how == "none":
        acc = re.search(r"(acc\d+) = tl\.dot", source).group(1)
        return source.replace(f"({store.group(3)}).to", f"({acc}).to")
    raise ValueError(how)


def variant(compiled, inputs, cfg: dict, how: str):
    from eqfuse.codegen.module import generate_module
    from eqfuse.runtime.cache import cache_key, load_module
    (kern,) = compiled.kernels
    source, _ = generate_module(compiled.plan, "probe", "probe", {kern.name: cfg})
    source = edit(source, how)
    module = load_module(cache_key(source), source, interpret=False)
    launcher = getattr(module, f"{kern.name}_launch")

    def run():
        return module.call(inputs[0].device, [], *inputs)[0]
    run.compiled_of = lambda: [c.kernel for c in launcher._compiled.values()]
    return run


def registers(fn) -> dict:
    try:
        ks = fn.compiled_of()
        return {"regs": ks[0].n_regs, "spills": ks[0].n_spills} if ks else {}
    except Exception:  # noqa: BLE001 - a figure for the record only
        return {}


CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs: 0 = one program per tile)
    (128, 256, 64, 8, 3, 0),
    (128, 256, 64, 8, 4, 0),
    (256, 128, 64, 8, 3, 0),
    (128, 128, 64, 8, 3, 0),
    (128, 128, 64, 8, 4, 0),
    (128, 128, 64, 4, 3, 0),
    (128, 256, 64, 8, 3, 132),
]
EPILOGUES = ["exact", "nocast", "bias", "none", "fast_erf", "poly_erf"]


def main(argv=None) -> int:
    import eqfuse
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--configs", nargs="+", type=int, default=None, help="indices into CONFIGS")
    p.add_argument("--epilogues", nargs="+", default=None,
                   help="for every configuration (default: all on the first, three on the others)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    torch.manual_seed(0)
    x = torch.randn(M, K, dtype=torch.float16, device="cuda") / K ** 0.25
    w = torch.randn(K, N, dtype=torch.float16, device="cuda") / K ** 0.25
    b = torch.randn(N, dtype=torch.float16, device="cuda") / K ** 0.25
    ref = gelu_linear(x, w, b).float()
    t0 = time.time()
    compiled = eqfuse.compile(gelu_linear, (x, w, b), validate=False, autotune=False)
    print(f"compiled {time.time() - t0:.1f}s; model's choice", [k.constexprs | k.launch for k in compiled.kernels],
          flush=True)
    tc = torch.compile(gelu_linear)
    fns = {"cublas x@w": lambda: x @ w, "eager": lambda: gelu_linear(x, w, b), "torch.compile": lambda: tc(x, w, b),
           "eqfuse as compiled": lambda: compiled(x, w, b)}
    configs = [CONFIGS[i] for i in a.configs] if a.configs else CONFIGS[:2] if a.quick else CONFIGS
    for bm, bn, bk, warps, stages, programs in configs:
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": stages}
        if programs:
            cfg["PROGRAMS"] = programs
        hows = a.epilogues or (EPILOGUES if (bm, bn, stages, programs) == (128, 256, 3, 0)
                               else ["exact", "fast_erf", "poly_erf"])
        for how in hows:
            name = f"{bm}x{bn}x{bk} w{warps} s{stages}{' p' + str(programs) if programs else ''} {how}"
            try:
                fns[name] = variant(compiled, (x, w, b), cfg, how)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                LOG.append({"variant": name, "error": repr(e)[-400:]})
                print(name, repr(e)[-400:], flush=True)
    good = {}
    for name, fn in fns.items():
        try:
            got = fn().float()
            torch.cuda.synchronize()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            if name.split()[-1] in ("exact", "nocast", "fast_erf", "poly_erf", "compiled") and not err < 1e-2:
                raise AssertionError(f"relative error {err}")
            good[name] = (fn, err)
        except Exception as e:  # noqa: BLE001
            LOG.append({"variant": name, "error": repr(e)[-400:]})
            print(name, repr(e)[-400:], flush=True)
    times: dict = {n: [] for n in good}
    for _ in range(5):
        for name, (fn, _) in good.items():
            times[name].append(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3)
    cublas = sorted(times["cublas x@w"])[2]
    for name, ts in times.items():
        us = sorted(ts)[2]
        fn, err = good[name]
        row = {"variant": name, "us": round(us, 1), "tflops": round(2 * M * N * K / us / 1e6, 1),
               "over_cublas_product": round(us / cublas, 3), "max_rel_err": round(err, 6), **registers(fn)}
        LOG.append(row)
        print(row, flush=True)
    save_results(a.out, LOG, shape=[M, N, K], dtype="float16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
