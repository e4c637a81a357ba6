"""GPU autotuning of block sizes: each kernel's candidate configurations are timed once
on the example inputs, and the winner is stored on disk by kernel source, shapes and
device, so later runs and later processes reuse it without timing again."""

from __future__ import annotations

import json
import os

import torch

from ..codegen import kernel as kgen
from ..codegen.module import generate_module
from .cache import cache_dir, cache_key, load_module, write_atomic

# (kernel name, schedule, config, measured us) of every trial this process timed, newest
# last: benchmarks read it to see how well the tile model ranks what the GPU measures.
trials: list[tuple] = []


def _store_path():
    return cache_dir() / "autotune.json"


def _load_store() -> dict:
    try:
        return json.loads(_store_path().read_text())
    except (OSError, ValueError):
        return {}


def _save(key: str, cfg: dict) -> None:
    store = _load_store()
    store[key] = cfg
    write_atomic(_store_path(), json.dumps(store, indent=1, sort_keys=True))


def autotune(plan, infos, title, version, example_inputs, constants) -> dict:
    """kernel name -> best config. Each trial regenerates the kernel for its config, so the
    masks always match the block sizes."""
    import triton.testing

    device = torch.cuda.get_device_name()
    store = _load_store()
    chosen: dict = {}
    pending = []
    for info in infos:
        # The source does not hold the sizes (they are constexpr arguments): key on them too.
        sizes = {**info.schedule.sizes, "grid": list(info.schedule.grid(info.constexprs)[1:])}
        dtypes = [plan.buffers[p].dtype for p in info.params]
        key = cache_key(info.source, sizes, dtypes, device, version)
        if key in store:
            chosen[info.name] = store[key]
        else:
            pending.append((info, key))
    if not pending or os.environ.get("EQFUSE_AUTOTUNE", "1") == "0":
        return chosen
    # Inputs of the graph, and scratch buffers for every other buffer, to launch kernels alone.
    from ..frontend.capture import real_examples
    tensors = dict(zip([b.name for b in plan.inputs], real_examples(list(example_inputs) + list(constants))))
    for name, b in plan.buffers.items():
        if name not in tensors:
            from ..schema import ops
            tensors[name] = torch.randn(b.shape, device="cuda").to(ops.DTYPES[b.dtype]) \
                if ops.is_float(b.dtype) else torch.zeros(b.shape, dtype=ops.DTYPES[b.dtype], device="cuda")
    for info, key in pending:
        best, best_t = None, float("inf")
        for cfg in kgen.tuning_candidates(info.schedule):
            trial = dict(chosen)
            trial[info.name] = cfg
            src, trial_infos = generate_module(plan, title, version, trial)
            mod = load_module(cache_key(src, "tune"), src, interpret=False)
            ti = next(i for i in trial_infos if i.name == info.name)
            fn = getattr(mod, ti.name)
            args = [tensors[p] for p in ti.params]

            def launch(fn=fn, ti=ti, args=args):
                fn[ti.grid](*args, **ti.constexprs, **ti.launch)
            try:
                t = triton.testing.do_bench(launch, warmup=10, rep=40, return_mode="median")
            except Exception:  # a config the compiler rejects (too many registers...)
                continue
            trials.append((info.name, info.schedule, cfg, t * 1e3))
            if t < best_t:
                best, best_t = cfg, t
        if best is not None:
            chosen[info.name] = best
            _save(key, best)
    return chosen
