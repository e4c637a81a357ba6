"""Where a cold compile spends its time on the CPU: the model blocks' graphs captured the
way the dynamo backend captures them (AOTAutograd, min-cut partitioner; forward under
no_grad, forward + backward), then built by ``eqfuse.pipeline.build`` with validation and
autotuning off, at full size on fake tensors (no kernel runs).

    python benchmarks/compile_profile.py [--models gpt2 bert] [--repeat 2] [--profile out.prof]
        [--fingerprint out.json]

Prints per-stage seconds for each graph: its first build in this process (which a cold
compile is) and the best of ``--repeat``. ``--fingerprint`` writes each graph's
generated source hash and kernel names, to check that a speedup left the plans alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def capture_graphs(name: str) -> list:
    """[(label, GraphModule, example inputs)] of the model's inference, forward and backward graphs."""
    import torch
    from functorch.compile import min_cut_rematerialization_partition
    from models import MODELS
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def grab(label):
        def compiler(gm, example_inputs):
            graphs.append((label, gm, list(example_inputs)))
            out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            vals = [n.meta["val"] if isinstance(n, torch.fx.Node) else None for n in out]

            def fake(*args):
                return [None if v is None else torch.empty_strided(v.shape, v.stride(), dtype=v.dtype).zero_()
                        for v in vals]
            return fake
        return compiler

    make, make_inputs = MODELS[name]
    torch.manual_seed(0)
    model = make().to(torch.float16)
    inputs = make_inputs("cpu", torch.float16)
    for training in (False, True):
        torch._dynamo.reset()
        backend = aot_autograd(fw_compiler=grab("forward" if training else "?"), bw_compiler=grab("backward"),
                               inference_compiler=grab("inference"),
                               partition_fn=min_cut_rematerialization_partition)
        f = torch.compile(model, backend=backend)
        if training:
            x = inputs[0].clone().requires_grad_(True)
            y = f(x, *inputs[1:])
            y.backward(torch.ones_like(y))
        else:
            with torch.no_grad():
                f(*inputs)
    return graphs


def real(example_inputs):
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).zero_() for t in example_inputs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "bert"])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--profile", default=None, help="cProfile output of each graph's first build")
    p.add_argument("--fingerprint", default=None)
    a = p.parse_args(argv)

    from eqfuse.pipeline import build
    from eqfuse.runtime.compiled import Options

    options = Options(validate=False, autotune=False, plan_cache=False)
    prints = {}
    totals: dict = {}
    for name in a.models:
        for label, gm, ex in capture_graphs(name):
            ex = real(ex)
            best = first = None
            for r in range(a.repeat):
                prof = None
                if a.profile and r == 0:
                    import cProfile
                    prof = cProfile.Profile()
                    prof.enable()
                t0 = time.perf_counter()
                res = build(gm, ex, options)
                wall = time.perf_counter() - t0
                if prof is not None:
                    prof.disable()
                    prof.dump_stats(f"{a.profile}.{name}.{label}")
                secs = dict(res["report"]["seconds"], wall=round(wall, 3))
                first = first or secs
                if best is None or wall < best["wall"]:
                    best = secs
            key = f"{name} {label}"
            print(key, "first", json.dumps(first), flush=True)
            print(key, "best ", json.dumps(best), flush=True)
            for which, secs in (("first", first), ("best", best)):
                for k, v in secs.items():
                    totals.setdefault(which, {})[k] = round(totals.get(which, {}).get(k, 0) + v, 3)
            prints[key] = {"source_sha": hashlib.sha256(res["source"].encode()).hexdigest()[:16],
                           "kernels": [k.name for k in res["kernels"]],
                           "fallbacks": [str(f) for f in res["fallbacks"]],
                           "cost": res["report"].get("extraction", {}).get("plan_cost_us")}
    for which, secs in totals.items():
        print("total", which, json.dumps(secs))
    if a.fingerprint:
        with open(a.fingerprint, "w") as f:
            json.dump(prints, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
