"""Transformer blocks through torch.compile: eqfuse vs eager vs Inductor, in one run.

    python benchmarks/models.py [--models llama gpt2 bert] [--contenders eqfuse] [--no-timing] [--out results.json]

The blocks are eqfuse.models' plain-PyTorch ones with random weights, fp16: a Llama-style
decoder layer (RMSNorm, rotary, causal attention written with masked_fill, SwiGLU MLP)
at batch 8, sequence 2048, hidden 4096, 32 heads, intermediate 11008; a GPT-2 block
(LayerNorm, SDPA causal attention, gelu MLP) at GPT-2 base size, batch 8, sequence 1024;
a BERT layer (bidirectional attention with an additive padding mask, post-LayerNorm, erf
gelu MLP) at BERT-base size, batch 8, sequence 512, the sequences padded after 512, 480,
... 288 tokens (the mask is a second input, as a model hands it to its layers). Each runs
forward only (no_grad) and forward + backward. Reported per contender: the median time
of a call (triton.testing.do_bench, interleaved rounds), compile seconds cold (the first
call, caches empty) and warm (compiled again after torch._dynamo.reset), and for eqfuse
the kernels and eager steps of the graphs it compiled, its compile seconds per stage (cold
and warm) and what parallel kernel compilation did; per contender, the memory allocated before a
call and the peak during it (torch.cuda.max_memory_allocated, weights and gradients
included).
eqfuse compiles with autotune off (the tile model's first choice) to keep compile time
bounded, unless ``--autotune``. ``EQFUSE_PARALLEL_COMPILE=0``
compiles its kernels one after another at their first launch instead (recorded in the
results file). Both contenders run in this process, torch.compile first for each block, so
a block's cold compile finds the process warm from what ran before it;
``benchmarks/compile_cold.py`` runs each contender alone in a fresh process. Cold
compile times count the imports a first compile makes: where eqfuse
and egglog were installed without bytecode (``pip install --no-compile``, as on the GPU
machines this repository benchmarks on), run ``python -m compileall`` over them first, as
a plain ``pip install`` would have (compiling their modules from source added 0.7 s).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

for var in ("EQFUSE_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):  # cold means cold
    os.environ.setdefault(var, tempfile.mkdtemp(prefix=var.lower() + "-"))

import torch  # noqa: E402
from common import bench_interleaved, save_results  # noqa: E402

import eqfuse.backend  # noqa: E402
from eqfuse.models import BertLayer, GPT2Block, LlamaLayer, padding_mask  # noqa: E402


def hidden_states(*shape):
    return lambda device, dtype: (torch.randn(*shape, device=device, dtype=dtype),)


def bert_inputs(device, dtype, batch=8, seq=512):
    lengths = seq - 32 * torch.arange(batch, device=device)  # 512, 480, ... 288 tokens
    return torch.randn(batch, seq, 768, device=device, dtype=dtype), padding_mask(lengths, seq, dtype)


# name -> (the model, its inputs from (device, dtype)); the first input is the hidden states
MODELS = {
    "llama": (lambda: LlamaLayer(hidden=4096, heads=32, intermediate=11008, max_seq=2048),
              hidden_states(8, 2048, 4096)),
    "gpt2": (lambda: GPT2Block(hidden=768, heads=12), hidden_states(8, 1024, 768)),
    "bert": (lambda: BertLayer(hidden=768, heads=12, intermediate=3072), bert_inputs),
}


# contender -> torch.compile's keywords
CONTENDERS = {"torch.compile": {}, "eqfuse": {"backend": "eqfuse", "options": {"autotune": False}},
              # not run unless named: the backward recomputing cheap forward values (min-cut)
              "eqfuse-recompute": {"backend": "eqfuse", "options": {"autotune": False, "recompute": True}},
              # not run unless named: every product generated, none a cuBLAS call (codegen/library.py)
              "eqfuse-generated": {"backend": "eqfuse", "options": {"autotune": False, "cublas": False}}}


def step(model, training: bool):
    if training:
        cotangent = []  # one random upstream gradient, made at the first call (a squared-mean
        # loss gives fp16 gradients of ~3e-8 at these sizes, below fp16's smallest normal)

        def run(*inputs):
            out = model(*inputs)
            if not cotangent:
                cotangent.append(torch.randn_like(out))
            out.backward(cotangent[0])
            return out
        return run

    def infer(*inputs):
        with torch.no_grad():
            return model(*inputs)
    return infer


def first_call(fn, inputs) -> tuple[float, torch.Tensor]:
    """(seconds until the first result is ready, the result)."""
    t0 = time.perf_counter()
    out = fn(*inputs)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out.detach().float()


def memory_mib(fn, inputs) -> dict:
    """MiB allocated before a call (weights, gradients, inputs, whatever the process holds)
    and the most allocated during it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(*inputs)
    torch.cuda.synchronize()
    return {"resident_mib": round(before / 2**20, 1), "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)}


def _stage_seconds(graphs) -> dict:
    """Seconds per compile stage (capture, saturate, extract, validate ...) over all graphs."""
    total: dict = {}
    for g in graphs:
        for stage, s in g.report.get("seconds", {}).items():
            total[stage] = round(total.get(stage, 0) + s, 2)
    return total


def _pool_outcomes(graphs) -> list:
    """What parallel compilation did in each graph (report["compile"]), and its notes."""
    return [{**g.report.get("compile", {}), **({"note": g.report["note"]} if g.report.get("note") else {})}
            for g in graphs]


def measure(name: str, training: bool, contenders=CONTENDERS, timing: bool = True) -> dict:
    make, make_inputs = MODELS[name]
    torch.manual_seed(0)
    model = make().to("cuda", torch.float16)
    inputs = make_inputs("cuda", torch.float16)
    with torch.no_grad():
        ref = model(*inputs).float()
    row = {"model": name, "mode": "forward+backward" if training else "forward", "shape": list(inputs[0].shape)}
    fns = {"eager": step(model, training)}
    for contender in contenders:
        backend_kw = CONTENDERS[contender]
        seconds, stages, pools = [], [], []
        for _ in range(2):  # cold, then warm
            torch._dynamo.reset()
            eqfuse.backend.history.clear()
            fn = step(torch.compile(model, **backend_kw), training)
            t, out = first_call(fn, inputs)
            seconds.append(t)
            stages.append(_stage_seconds(eqfuse.backend.history))
            pools.append(_pool_outcomes(eqfuse.backend.history))
        fns[contender] = fn
        err = (out - ref).abs().max().item()
        entry = {"compile_s_cold": round(seconds[0], 1), "compile_s_warm": round(seconds[1], 1),
                 "max_abs_err_vs_eager": round(err, 4)}
        if contender.startswith("eqfuse"):
            graphs = list(eqfuse.backend.history)
            entry.update(graphs=len(graphs), kernels=sum(len(g.kernels) for g in graphs),
                         cublas_calls=sum(len(g.library_calls) for g in graphs),
                         eager_steps=[str(f) for g in graphs for f in g.fallbacks],
                         cold_compile_stages_s=stages[0], warm_compile_stages_s=stages[1],
                         parallel_compile_cold=pools[0], parallel_compile_warm=pools[1])
        row[contender] = entry
    for n, f in fns.items():
        row.setdefault(n, {}).update(memory_mib(f, inputs))
    if not timing:
        return row
    times = bench_interleaved({n: (lambda f=f: f(*inputs)) for n, f in fns.items()})
    for n, us in times.items():
        row.setdefault(n, {})["us"] = round(us, 1)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--modes", nargs="+", choices=["forward", "forward+backward"],
                   default=["forward", "forward+backward"])
    p.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=["torch.compile", "eqfuse"])
    p.add_argument("--no-timing", action="store_true", help="compile seconds only, no call timing")
    p.add_argument("--autotune", action="store_true", help="eqfuse times its tile candidates (compile time unbounded)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    for name in ("eqfuse", "eqfuse-recompute", "eqfuse-generated"):
        CONTENDERS[name]["options"]["autotune"] = a.autotune
    rows = []
    for name in a.models:
        for mode in a.modes:
            row = measure(name, training=mode != "forward", contenders=a.contenders, timing=not a.no_timing)
            rows.append(row)
            print(json.dumps(row), flush=True)
            save_results(a.out, rows, dtype="float16", eqfuse_options={"autotune": a.autotune},
                         parallel_compile=os.environ.get("EQFUSE_PARALLEL_COMPILE", "1") != "0")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
