"""Choosing each kernel's block sizes on the GPU.

With timing on (the default), a kernel's candidate configurations are timed once on the
example inputs and the winner is stored on disk by kernel source, shapes and device, so
later runs and later processes reuse it without timing again. With timing off the model's
first choice is taken, as long as it launches: Triton refuses some configurations only
when it compiles them (shared memory or registers the device does not have), so every
kernel is launched once on scratch buffers, and a configuration that fails gives way to
the next one the model ranks. A kernel no configuration runs is an error the caller turns
into an eager fallback.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from ..codegen import kernel as kgen
from ..codegen.module import generate_module
from ..errors import EqfuseError
from .cache import cache_dir, cache_key, load_module, write_atomic

log = logging.getLogger("eqfuse")

# (kernel name, schedule, config, measured us) of every trial this process timed, newest
# last: benchmarks read it to see how well the tile model ranks what the GPU measures.
trials: list[tuple] = []


class NoRunnableConfig(EqfuseError):
    """No configuration of a kernel compiles on this device."""


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


def _scratch_tensors(plan, example_inputs, constants) -> dict:
    """The graph's inputs, and scratch buffers for every other buffer, to launch kernels alone."""
    from ..frontend.capture import real_examples
    from ..schema import ops

    tensors = dict(zip([b.name for b in plan.inputs], real_examples(list(example_inputs) + list(constants))))
    for name, b in plan.buffers.items():
        if name not in tensors:
            tensors[name] = torch.randn(b.shape, device="cuda").to(ops.DTYPES[b.dtype]) \
                if ops.is_float(b.dtype) else torch.zeros(b.shape, dtype=ops.DTYPES[b.dtype], device="cuda")
    return tensors


def choose_configs(plan, infos, title, version, example_inputs, constants, measure: bool = True) -> dict:
    """kernel name -> config. Each trial regenerates the kernel for its config, so the masks
    always match the block sizes. ``measure=False`` (or ``EQFUSE_AUTOTUNE=0``) takes the
    first configuration that launches, in the model's order, and stores nothing."""
    measure = measure and os.environ.get("EQFUSE_AUTOTUNE", "1") != "0"
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
    if not pending:
        return chosen
    _try_configs(pending, chosen, plan, title, version, example_inputs, constants, measure)
    return chosen


def _try_configs(pending, chosen, plan, title, version, example_inputs, constants, measure) -> None:
    import triton.testing

    tensors = _scratch_tensors(plan, example_inputs, constants)
    for info, key in pending:
        best, best_t, failure = None, float("inf"), ""
        candidates = kgen.tuning_candidates(info.schedule) if measure else kgen.fallback_candidates(info.schedule)
        for cfg in candidates:
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
                if measure:
                    t = triton.testing.do_bench(launch, warmup=10, rep=40, return_mode="median")
                else:
                    launch()
                    torch.cuda.synchronize()
                    t = 0.0
            except Exception as e:  # a config the compiler rejects (shared memory, registers...)
                failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.info("eqfuse: %s with %s does not run: %s", info.name, cfg, failure)
                continue
            if measure:
                trials.append((info.name, info.schedule, cfg, t * 1e3))
            if t < best_t:
                best, best_t = cfg, t
            if not measure:
                break
        if best is None:
            raise NoRunnableConfig(f"kernel {info.name} ({info.schedule.describe()}) runs with none of its "
                                   f"{len(candidates)} configurations; the last said {failure}")
        chosen[info.name] = best
        if measure:
            _save(key, best)
