"""Plain products: eqfuse's cuBLAS call (eqfuse/codegen/library.py) against the same product
generated (``cublas=False``, autotuned), eager and torch.compile, side by side in one run.

    python benchmarks/matmul_library.py [--out results.json]

Shapes a model's plain products take, fp16: decode and prompt rows against a 4096 x 4096
weight, GPT-2's weight gradients (x^T @ dy over 8192 tokens: a column-major left operand),
Llama-7B's MLP projections. Medians of interleaved rounds, L2 flushed, microseconds.
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import bench_interleaved, inductor_compiled, save_results

import eqfuse

# (M, N, K, whether A is read transposed: a weight gradient's x^T)
SHAPES = [(1, 4096, 4096, False), (16, 4096, 4096, False), (128, 4096, 4096, False), (512, 4096, 4096, False),
          (768, 768, 8192, True), (3072, 768, 8192, True), (768, 3072, 8192, True),
          (4096, 11008, 4096, False), (4096, 4096, 11008, False)]


def mm(a, b):
    return a @ b


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for m, n, k, transposed in SHAPES:
        a = (torch.randn(k, m, dtype=torch.float16, device="cuda").T if transposed
             else torch.randn(m, k, dtype=torch.float16, device="cuda")) / 8
        b = torch.randn(k, n, dtype=torch.float16, device="cuda") / 8
        library = eqfuse.compile(mm, [a, b])
        generated = eqfuse.compile(mm, [a, b], cublas=False)
        assert library.library_calls and not generated.library_calls
        inductor, _ = inductor_compiled(mm, [a, b])
        ref = a @ b
        ok = all(torch.allclose(f(a, b), ref, rtol=1e-2, atol=1e-2) for f in (library, generated))
        t = bench_interleaved({"eager": lambda: a @ b, "torch_compile": lambda: inductor(a, b),
                               "eqfuse": lambda: library(a, b), "eqfuse_generated": lambda: generated(a, b)})
        row = {"shape": [m, n, k], "a_transposed": transposed, **{f"{c}_us": round(v, 1) for c, v in t.items()},
               "generated_kernels": [f"{g.schedule.describe()} {g.config}" for g in generated.kernels],
               "matches_eager": ok}
        rows.append(row)
        print(f"{m:5d} x {n:5d} x {k:5d}{' A^T' if transposed else '    '} eager {t['eager']:7.1f} "
              f"torch.compile {t['torch_compile']:7.1f} eqfuse (cuBLAS) {t['eqfuse']:7.1f} "
              f"generated {t['eqfuse_generated']:7.1f} ok={ok}", flush=True)
    save_results(args.out, rows, dtype="float16")
    return 0 if all(r["matches_eager"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
