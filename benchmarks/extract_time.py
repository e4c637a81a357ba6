"""Extraction time of a model's forward and backward graphs, on the CPU.

    python benchmarks/extract_time.py [--model llama|gpt2|bert] [--inference]
        [--hidden 4096 --heads 32 --intermediate 11008 --seq 2048 --batch 8]
        [--dtype float16] [--device meta] [--repeat 3] [--out results.json]

The Llama layer (eqfuse.models.LlamaLayer, at the sizes given), or the GPT-2 block or
BERT layer at the models benchmark's sizes (benchmarks/models.py), goes through
torch.compile with an AOTAutograd backend whose compilers run eqfuse's steps up to the
plan (capture, translate, saturate, serialise the e-graph, extract) and time each; the
layer itself runs uncompiled. ``--inference`` traces the forward alone, under no_grad,
as an inference compile does. On the meta device (the default) nothing is computed, so
the full size needs no memory: the graphs, shapes and dtypes, the e-graph and the plan
are those of a GPU compile, except that the cost model has the default device figures
(no calibration without a GPU). GPT-2's and BERT's SDPA is chosen per device (on
meta the GPT-2 graph is not a GPU compile's): trace them with ``--device cpu``, whose
graphs and plans match an H100 compile's. Extraction runs ``--repeat`` times on each saturated
e-graph, in the compiling process (its heap is a compile's: the garbage collector's
cost depends on it); the report gives the best and every run, the pipeline's "extract"
phase (serialise + extract, as ``CompiledGraph.report`` counts it) and the plan.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from eqfuse.models import LlamaLayer


def extraction_seconds(gm, example_inputs, repeat: int) -> dict:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from eqfuse.frontend.capture import capture
    from eqfuse.rewrite.egraph_json import serialize
    from eqfuse.rewrite.extract import Extractor
    from eqfuse.rewrite.saturate import Limits, saturate
    from eqfuse.schema.from_fx import translate

    row = {}
    t0 = time.perf_counter()
    captured = capture(gm, example_inputs)
    row["capture_s"] = time.perf_counter() - t0
    with unset_fake_temporarily():  # as the pipeline does after capture
        t0 = time.perf_counter()
        tr = translate(captured)
        row["translate_s"] = time.perf_counter() - t0
        sat = saturate(tr.egraph, Limits())  # the pipeline's default limits
        row["saturate_s"], row["stop_reason"] = sat.seconds, sat.stop_reason
        t0 = time.perf_counter()
        view = serialize(tr.egraph)
        row["serialize_s"] = time.perf_counter() - t0
        row["enodes"], row["eclasses"] = view.size()
        runs = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            plan, report = Extractor(view, tr).extract()
            runs.append(time.perf_counter() - t0)
        tr.egraph = None  # dropped on this thread, as the pipeline does
    row["extract_runs_s"] = runs
    row["extract_s"] = min(runs)
    row["pipeline_extract_s"] = row["serialize_s"] + runs[0]  # the first run, as in a compile
    row["plan"] = {"kernels": len(plan.kernels), "cost_us": report["plan_cost_us"],
                   "unfused_cost_us": report["unfused_cost_us"], "materialised": report["materialised"]}
    row["heap_objects"] = len(gc.get_objects())
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["llama", "gpt2", "bert"], default="llama")
    ap.add_argument("--inference", action="store_true", help="the forward graph alone, under no_grad")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="meta", help="meta (nothing computed) or cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--label", default="", help="recorded with the results (e.g. the commit)")
    ap.add_argument("--out")
    args = ap.parse_args()

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    rows = []

    def compiler(gm, example_inputs):
        rows.append({"graph": ("forward", "backward")[len(rows)] if len(rows) < 2 else f"graph {len(rows)}",
                     **extraction_seconds(gm, example_inputs, args.repeat)})
        return make_boxed_func(gm)

    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        if args.model == "llama":
            model = LlamaLayer(hidden=args.hidden, heads=args.heads, intermediate=args.intermediate,
                               max_seq=args.seq).to(dtype)
            inputs = (torch.randn(args.batch, args.seq, args.hidden, dtype=dtype),)
            size = (f"Llama layer hidden {args.hidden}, {args.heads} heads, intermediate {args.intermediate}, "
                    f"input {args.batch}x{args.seq}x{args.hidden}")
        else:
            from models import MODELS  # the models benchmark's blocks and sizes
            make, make_inputs = MODELS[args.model]
            model, inputs = make().to(dtype), make_inputs(args.device, dtype)
            size = f"{args.model} block, input {'x'.join(map(str, inputs[0].shape))}"
    size += f" {args.dtype} on {args.device}, {'inference' if args.inference else 'training'}"
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=compiler, bw_compiler=compiler))
    if args.inference:
        with torch.no_grad():
            compiled(*inputs)
    else:
        out = compiled(inputs[0].requires_grad_(), *inputs[1:])
        out.backward(torch.randn_like(out))

    print(size)
    print(f"{'graph':<10}{'e-nodes':>9}{'saturate s':>12}{'serialize s':>13}{'extract s (best)':>18}"
          f"{'runs':>24}{'kernels':>9}{'cost us':>11}")
    for r in rows:
        runs = " ".join(f"{t:.2f}" for t in r["extract_runs_s"])
        print(f"{r['graph']:<10}{r['enodes']:>9}{r['saturate_s']:>12.2f}{r['serialize_s']:>13.3f}"
              f"{r['extract_s']:>18.2f}{runs:>24}{r['plan']['kernels']:>9}{r['plan']['cost_us']:>11.1f}")
    if args.out:
        from eqfuse.bench import environment
        with open(args.out, "w") as f:
            json.dump({**environment(), "workload": size, "label": args.label, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
