"""Choosing each kernel's block sizes on the GPU.

With timing on (the default), a kernel's candidate configurations are timed once on the
example inputs and the winner is stored on disk by kernel source, shapes and device, so
later runs and later processes reuse it without timing again. With timing off the model's
first choice is taken, as long as it launches: Triton refuses some configurations only
when it compiles them (shared memory or registers the device does not have), so every
kernel is launched once on scratch buffers, and a configuration that fails gives way to
the next one the model ranks. A kernel no configuration runs is an error the caller turns
into an eager fallback.

Timing is done the way the benchmarks time: through the kernel's launcher, L2 flushed, the
candidates interleaved over rounds and the median kept, after the GPU has been kept busy
long enough for its clocks to settle. An H100 at its power cap runs a large fp16 matmul
at 1.5-1.7 GHz instead of 1.98: timed from idle, one after the other, the first candidate
(the model's favourite) ran 12% faster than it did a second later under load (424 against
479 us for gelu(x@W+b) at 8192x4096x4096), so the ranking favoured whichever came first
and the figures disagreed with every benchmark.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..codegen import configs as tile_configs  # looked up at each use: benchmarks patch its candidates
from ..codegen.module import generate_module
from ..errors import EqfuseError, one_line
from .cache import cache_dir, cache_key, load_module, switched_on, write_atomic

log = logging.getLogger("eqfuse")

# (kernel name, schedule, config, measured us) of every trial this process timed, newest
# last: benchmarks read it to see how well the tile model ranks what the GPU measures.
trials: list[tuple] = []

ROUNDS = 3  # timing rounds, each over every candidate
REP_MS = 20  # do_bench's repetition time per candidate and round
SETTLE_MS = 300  # GPU kept busy before the first round, for its clocks to settle


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
    # Keys in the config's own order: a kernel's constexpr parameters come in that order, so a
    # config read back sorted made another source than the one timed (and compiled) here,
    # and every later process compiled the graph's kernels again.
    write_atomic(_store_path(), json.dumps(store, indent=1))


def _scratch_tensors(plan, example_inputs, constants) -> dict:
    """The graph's inputs, and scratch buffers for every other buffer, to launch kernels alone."""
    from ..frontend.capture import real_examples, whole_storage
    from ..schema import ops

    tensors = dict(zip([b.name for b in plan.inputs], real_examples(list(example_inputs) + list(constants))))
    for name, b in plan.buffers.items():
        if name not in tensors:
            # With the buffer's own strides: an output kept in eager's layout may span more
            # than its elements (q, k, v viewed from one [B, S, 3 * H * D] product), and a
            # contiguous scratch buffer was written past its end (illegal address on an H100).
            t = torch.empty_strided(b.shape, b.layout, dtype=ops.DTYPES[b.dtype], device="cuda")
            memory = whole_storage(t)  # a gradient returned expanded overlaps itself
            if ops.is_float(b.dtype):
                memory.normal_()
            else:
                memory.zero_()
            tensors[name] = t
    return tensors


def choose_configs(plan, infos, title, version, example_inputs, constants, measure: bool = True,
                   parallel: bool = False, stats: dict | None = None, unchecked: frozenset = frozenset()) -> dict:
    """kernel name -> config. Each trial regenerates the kernel for its config, so the masks
    always match the block sizes. ``measure=False`` (or ``EQFUSE_AUTOTUNE=0``) takes the
    first configuration that launches, in the model's order, and stores nothing.
    ``parallel``: the candidates are compiled in parallel_compile's pool before their first
    launch; ``stats`` (a dict) gets the seconds spent compiling and launching candidates
    and the pool's outcome. ``unchecked``: kernels an untimed build takes the first
    configuration of without launching it (a template still compiling in the background,
    whose launcher checks its first launch itself: launch.KernelLauncher)."""
    measure = switched_on("EQFUSE_AUTOTUNE", measure)
    chosen, pending = _stored(plan, infos, version)
    if not measure:  # what first_choices takes for them
        chosen.update({info.name: tile_configs.fallback_candidates(info.schedule)[0] for info, _ in pending
                       if info.name in unchecked})
        pending = [(info, key) for info, key in pending if info.name not in unchecked]
    if not pending:
        return chosen
    outcome, seconds = _try_configs(pending, chosen, plan, title, version, example_inputs, constants, measure,
                                    parallel)
    if stats is not None:
        stats["seconds"] = seconds
        stats["pool"] = outcome
    return chosen


def first_choices(plan, infos, version) -> dict:
    """kernel name -> config, without launching anything: the one timed before (stored),
    else the model's first choice (what an untimed ``choose_configs`` takes when it runs)."""
    chosen, pending = _stored(plan, infos, version)
    for info, _ in pending:
        chosen[info.name] = tile_configs.fallback_candidates(info.schedule)[0]
    return chosen


def _stored(plan, infos, version) -> tuple[dict, list]:
    """({kernel name: config} of the kernels a config was timed for before, [(kernel info,
    store key)] of the others). A stored config this build would refuse (``kernel.fits``:
    one stored before a config key it now needs, such as a ping-pong epilogue's CHUNK) is
    timed again, not left to code generation, which would run the default in its place."""
    device = torch.cuda.get_device_name()
    store = _load_store()
    chosen: dict = {}
    pending = []
    for info in infos:
        # The source does not hold the sizes (they are constexpr arguments): key on them too.
        sizes = {**info.schedule.sizes, "grid": list(info.schedule.grid(info.constexprs)[1:])}
        dtypes = [plan.buffers[p].dtype for p in info.params]
        key = cache_key(info.source, sizes, dtypes, device, version)
        if key in store and tile_configs.fits(info.schedule, store[key]):
            chosen[info.name] = store[key]
        else:
            pending.append((info, key))
    return chosen, pending


def _try_configs(pending, chosen, plan, title, version, example_inputs, constants, measure, parallel):
    """Fills ``chosen`` for the ``pending`` kernels. Returns the pool's outcome (or None) and
    the seconds spent compiling candidates and launching each once (not timing them)."""
    tensors = _scratch_tensors(plan, example_inputs, constants)
    walk = tile_configs.tuning_candidates if measure else tile_configs.fallback_candidates
    candidates = {info.name: walk(info.schedule) for info, _ in pending}
    # The candidates a first pass launches (every one when timing, else each kernel's first),
    # in modules of one candidate per kernel: an untimed build's first choices are one
    # module, the same text as the final one, whose first launches then find them compiled.
    rounds = max(map(len, candidates.values())) if measure else 1
    prepared: dict = {}
    for r in range(rounds):
        cfgs = {name: c[r] for name, c in candidates.items() if r < len(c)}
        prepared.update(_prepare_round(plan, title, version, {**chosen, **cfgs}, list(cfgs), r, tensors))
    outcome, seconds = None, 0.0
    if parallel:
        from .parallel_compile import precompile
        outcome = precompile([(p.launcher, p.args) for p in prepared.values() if isinstance(p, Candidate)])
        seconds += outcome.seconds
    for info, key in pending:
        runs, failure = [], ""
        # Past the candidates, their tiles with one stage: an operand gathered from several
        # reads can stage more shared memory than the tile model counts (TinyLM's backward:
        # 434 KB asked on an H100), and one stage stages the least
        last_resorts = tile_configs.single_stage(candidates[info.name])
        for i, cfg in enumerate(candidates[info.name] + last_resorts):
            if runs and (not measure or i >= len(candidates[info.name])):
                break  # an untimed build takes the first that launches; a last resort only where none did
            candidate = prepared.get((info.name, i))
            if candidate is None:  # a later choice of an untimed build, or a last resort: in a module of its own
                candidate = _prepare(plan, title, version, {**chosen, info.name: cfg}, info.name, tensors)
            t0 = time.perf_counter()
            launch, failure = _first_launch(candidate)
            seconds += time.perf_counter() - t0
            if launch is None:
                log.info("eqfuse: %s with %s does not run: %s", info.name, cfg, failure)
                continue
            runs.append((cfg, launch))
        if not runs:
            raise NoRunnableConfig(f"kernel {info.name} ({info.schedule.describe()}) runs with none of its "
                                   f"{len(candidates[info.name]) + len(last_resorts)} configurations; "
                                   f"the last said {failure}")
        if not measure:
            chosen[info.name] = runs[0][0]
            continue
        times = _interleaved_us([launch for _, launch in runs])
        for (cfg, _), t in zip(runs, times):
            trials.append((info.name, info.schedule, cfg, t))
        best = min(range(len(runs)), key=times.__getitem__)
        chosen[info.name] = runs[best][0]
        _save(key, runs[best][0])
    return outcome, seconds


@dataclass
class Candidate:
    """One kernel of a loaded module, and the tensors to launch it on."""
    launcher: Any
    args: list


def _prepare_round(plan, title, version, configs, names, r, tensors) -> dict:
    """(kernel name, r) -> Candidate (or why it is none) for each of ``names``, all from one
    module generated with ``configs``."""
    try:
        mod, infos = _load(plan, title, version, configs)
    except Exception as e:  # noqa: BLE001 - each kernel then gets a module of its own
        log.info("eqfuse: round %d of candidates does not load: %s", r, e)
        return {}
    by_name = {i.name: i for i in infos}
    return {(name, r): _candidate(mod, by_name[name], tensors) for name in names}


def _prepare(plan, title, version, configs, name, tensors):
    try:
        mod, infos = _load(plan, title, version, configs)
    except Exception as e:  # noqa: BLE001 - a config the code generator or Python rejects
        return one_line(e)
    return _candidate(mod, next(i for i in infos if i.name == name), tensors)


def _load(plan, title, version, configs):
    src, infos = generate_module(plan, title, version, configs)
    return load_module(cache_key(src, "tune"), src, interpret=False), infos


def _candidate(mod, info, tensors):
    """The kernel's Candidate, or why it is none. A TMA kernel whose tensors TMA cannot take
    (an input not 16-byte aligned) is not a candidate: its launcher would run the kernel
    without TMA in its place."""
    if any(tensors[p].data_ptr() % 16 for p in info.aligned):
        return "an input TMA would read is not 16-byte aligned"
    launcher = getattr(mod, f"{info.name}_launch", None)
    if launcher is None:
        return "the module has no launcher for it (a zero-size kernel)"
    return Candidate(launcher, [tensors[p] for p in info.params])


def _first_launch(candidate):
    """(the candidate's launch, launched once, or None; why not)."""
    if not isinstance(candidate, Candidate):
        return None, candidate
    launcher, args = candidate.launcher, candidate.args
    try:
        launcher(*args)  # compiles it, unless the pool has
        torch.cuda.synchronize()
    except Exception as e:  # a config the compiler rejects (shared memory, registers...)
        return None, one_line(e)
    return (lambda: launcher(*args)), ""


def _interleaved_us(launches: list) -> list[float]:
    """Median microseconds of each launch over ROUNDS rounds that time every launch once
    (L2 flushed before each call), after SETTLE_MS of the first launch back to back."""
    import triton.testing

    end = time.perf_counter() + SETTLE_MS / 1e3
    while time.perf_counter() < end:
        for _ in range(10):
            launches[0]()
        torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in launches]
    for _ in range(ROUNDS):
        for i, launch in enumerate(launches):
            times[i].append(triton.testing.do_bench(launch, warmup=5, rep=REP_MS, return_mode="median") * 1e3)
    return [sorted(t)[len(t) // 2] for t in times]
