"""Tile configurations and K splits of the int4-dequantised matmul at few tokens, timed.

    python benchmarks/matmul_int4_sweep.py [--tokens 16 128] [--splits 1 2 4 8 16] [--out results.json]

x [tokens, 4096] @ W [4096, 4096], W stored as int4 (8 per int32 along K, a scale and a
zero point per 32 rows), compiled by eqfuse with the weights unpacked in the product (its
extraction is kept from storing them dequantised, as it may choose to), K forced into each
chunk count (1: not split) and the autotuner offered a wide grid of tiles (block sizes,
warps, stages) instead of the tile model's finalists. Each trial is the autotuner's own timing of the product's
kernel (stage 1 where split); each split's whole call is timed beside torch.compile's.
The tile model's constants for computed operands (codegen/tiles.py: GATHERED_TILES,
GATHER_*) and split-K's MAX_WAVES_COMPUTED were fitted to this sweep.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from common import bench_interleaved, inductor_compiled, save_results

import eqfuse
from eqfuse.codegen import configs, splitk
from eqfuse.examples import MATMUL_EXAMPLES
from eqfuse.rewrite.extract import Extractor
from eqfuse.runtime import autotune

INT4 = MATMUL_EXAMPLES["int4_matmul"]
N = K = 4096


def grid(tokens: int) -> list[dict]:
    """Tiles of at most 128 accumulators a thread and 200 KB of operand stages."""
    out = []
    for bm in sorted({max(16, min(bm, tokens)) for bm in (16, 32, 64, 128)}):
        for bn in (32, 64, 128, 256):
            for bk in (64, 128, 256):
                for warps in (2, 4, 8):
                    for stages in (1, 2, 3, 4):
                        if bm * bn // (32 * warps) <= 128 and bk * bn * 2 * stages <= 200_000:
                            out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
                                        "num_warps": warps, "num_stages": stages})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 128])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    device = torch.cuda.get_device_name()
    print(device, flush=True)
    model_choice = configs.tuning_candidates
    Extractor._storable = lambda self, c: False  # one kernel: the weights unpacked as the product loads them
    rows = []
    for tokens in a.tokens:
        configs.tuning_candidates = lambda sched, t=tokens: grid(t) if sched.kind == "matmul" else model_choice(sched)
        inputs = INT4.make_inputs(tokens, N, K, torch.float16, "cuda")
        ref = INT4.fn(*inputs)
        inductor, _ = inductor_compiled(INT4.fn, inputs)
        for chunks in a.splits:
            if chunks > 1 and K // chunks < 64:
                continue
            splitk.FORCE_CHUNKS = chunks if chunks > 1 else 0
            os.environ[splitk.ENV] = "1" if chunks > 1 else "0"
            start = len(autotune.trials)
            compiled = eqfuse.compile(INT4.fn, inputs, plan_cache=False)
            err = ((compiled(*inputs).float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            trials = sorted(([round(us, 2), cfg] for name, sched, cfg, us in autotune.trials[start:]
                             if sched.kind == "matmul"), key=lambda t: t[0])
            t = bench_interleaved({"eqfuse": lambda c=compiled: c(*inputs), "torch.compile": lambda: inductor(*inputs)})
            row = {"tokens": tokens, "chunks": chunks, "kernels": [k.name for k in compiled.kernels],
                   "eqfuse_us": round(t["eqfuse"], 1), "torch_compile_us": round(t["torch.compile"], 1),
                   "max_rel_err": err, "product_trials_us": trials}
            rows.append(row)
            print(f"tokens {tokens} chunks {chunks}: eqfuse {t['eqfuse']:.1f} us (best product {trials[0][0]} us "
                  f"{trials[0][1]}), torch.compile {t['torch.compile']:.1f}, err {err:.1e}", flush=True)
    configs.tuning_candidates = model_choice
    save_results(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
