"""Split-K: a matmul whose output has too few tiles to fill the GPU becomes two kernels.

A weight gradient of a transformer layer, ``x.T @ dy`` over the tokens, has a small
output and a long K: [768 x 8192] @ [8192 x 768] is 72 tiles of 128 x 64 on a 132-SM
H100, each walking all 8192 tokens while 60 SMs idle. So, where a matmul kernel's output
tiles (the tile model's first choice) are fewer than the SMs and K is long, K is cut
into ``S`` chunks of ``L``:

* stage 1 (``<kernel>_partials``) is the product as a batched matmul over the chunks: A
  [M, K] seen as [S, M, L] (reshaped to [M, S, L] and permuted), B [K, N] as [S, L, N],
  both zero-padded to ``S * L`` along K where ``S`` does not divide it, written as float32
  partials [S, M, N]: ``S`` times the tiles, each ``S`` times shorter;
* stage 2 (the kernel's own name) is the original kernel with the product replaced by
  the sum of its partials over ``S`` (a row reduction of [M * N, S], the partials read
  through a stride of M * N): the epilogue (bias, gelu, residual, cast) is unchanged.

Both are ordinary plan kernels, built from the plan's own ops (load, reshape, permute,
cat, dot, cast, reduce), so the batched-matmul and reduction code generators write them
and the launcher, the autotuner, parallel compilation, the plan cache and export handle
them like any other kernel. The sum of a chunk's products accumulates in float32 as the
single kernel's does; the result differs from it only by the order of the additions.

``S`` is chosen by the model: each count that divides K, gives chunks of at least
``MIN_CHUNK`` and stage 1 at most ``MAX_WAVES`` times the SMs in tiles (counted with the
single kernel's tiles) is weighed as stage 1's modelled time (codegen/tiles.py) plus
stage 2's (the partials written and read, the output written, at the memory bandwidth)
plus a launch; the least wins where it is modelled at least ``MIN_GAIN`` faster than the
single kernel (a split adds a kernel and a float32 buffer, and the model errs by about
that much either way: below). Counts
that do not divide K are not chosen: the padding turns the operands' plain reads into
computed ones (a select and two conversions per element in the K loop, no TMA), which
measured 2.1-2.7x slower than the single kernel (S = 3 at K = 8192 below). Forced
counts may pad.

Measured on an H100 (benchmarks/matmul_split_k.py, autotune off, device time of the
kernels by torch.profiler), ``a.t() @ b`` fp16 with 8192 tokens as K:

* [768 x 8192] @ [8192 x 768]: single kernel (72 tiles of 128 x 64, TMA) 36.4 us; S = 2
  26.3 + 2.1 us (stage 1 72 tiles of 128 x 128), S = 4 25.2 + 2.9, S = 8 24.0 + 5.8;
  S = 3 (padded) 68.6 + 2.6. The model picks S = 2 (a second run: 33.1 -> 26.5 + 2.3 us;
  a call, host included, 48.5 -> 35.5 us, torch.mm 29.3).
* [3072 x 8192] @ [8192 x 768] (and its transpose): single kernel (72 tiles of 128 x 256,
  TMA) 80.4 us; S = 2 80.9 + 6.4, S = 4 69.1 + 12.4, S = 8 79.5 + 30.7, S = 3 (padded)
  221.9 + 8.6. No count gains: the partials' traffic eats what the idle SMs give. The
  model puts S = 4 0.3% under the single kernel, inside MIN_GAIN: none is split.

Not split: batched products, several products in one kernel (SwiGLU's pair, or products
only summed), integer products, kernels with a grid already full or a short K.
``EQFUSE_SPLIT_K=0`` turns splitting off (to compare); tests force a count with
``FORCE_CHUNKS``.
"""

from __future__ import annotations

import math

from ..errors import Unschedulable
from ..rewrite.cost import device_model
from ..runtime.cache import switched_on
from ..schema import ops
from ..schema.plan import Buffer, KernelSpec, Plan, PNode, rewrite_kernels, substitute
from . import configs, schedules, tiles, tma
from . import kernel as kgen

# Shared with split reductions: a stage-1 kernel's (and its buffers') suffix and name.
from .split import STAGE1_SUFFIX, stage1_name

MIN_K = 2048  # a shorter K: the single kernel's loop is too short for the partials to pay
MIN_CHUNK = 512  # shortest chunk of K a stage-1 tile walks
MAX_WAVES = 2  # stage-1 tiles aimed for: at most this many per SM (with the single kernel's tiles)
# ... or this many where an operand is computed in registers (int4 weights): such programs wait
# on their loads, and the more an SM holds, the more of the waits overlap (H100, int4 weights
# [4096 x 4096] at 16 rows: 38 us unsplit, 16 with K in 8 chunks of 4 tiles an SM;
# benchmarks/results/matmul-int4-sweep_*.json)
MAX_WAVES_COMPUTED = 8
MIN_GAIN = 0.05  # a split's modelled time must be at least this much under the single kernel's
FLOATS = ("float16", "bfloat16", "float32")
FORCE_CHUNKS = 0  # tests: this many chunks for every matmul that may split, whatever the model says
ENV = "EQFUSE_SPLIT_K"


def enabled() -> bool:
    """Unless ``EQFUSE_SPLIT_K`` says 0, false, off or no (a plan cache key holds this too)."""
    return switched_on(ENV)


def split_matmuls(plan: Plan) -> None:
    """Rewrite ``plan`` in place: each matmul kernel that qualifies (module docstring)
    becomes its two stages, and their partials buffer joins ``plan.buffers``. Running it
    again changes nothing (stage 1 is batched, stage 2 a reduction)."""
    if not enabled():
        return

    def stages(kernel, buffers):
        parts = split_kernel(kernel, buffers)
        return parts and ([parts[0], parts[1]], [parts[2]])
    rewrite_kernels(plan, stages)


def split_kernel(spec: KernelSpec, buffers: dict) -> tuple | None:
    """(stage 1, stage 2, partials Buffer) for a matmul kernel worth splitting, else None."""
    if spec.name.endswith(STAGE1_SUFFIX):
        return None
    try:
        sched = schedules.schedule_of(spec)
    except Unschedulable:
        return None
    dot = single_product(spec, sched)
    if dot is None:
        return None
    chunks = choose_chunks(spec, dot, sched)
    if chunks < 2:
        return None
    first, second, partials = build_stages(spec, dot, chunks, buffers)
    try:  # the writers take both, or the kernel stays whole
        for stage in (first, second):
            kgen.generate_kernel(stage, {**buffers, partials.name: partials})
    except Unschedulable:
        return None
    return first, second, partials


def single_product(spec: KernelSpec, sched: schedules.Schedule) -> PNode | None:
    """The kernel's one product if the kernel may split: a single unbatched float product
    with a long K and fewer output tiles than SMs (both waived under FORCE_CHUNKS)."""
    if sched.kind != "matmul" or sched.batch or sched.dots != 1 or sched.summed or sched.dot_dtype not in FLOATS:
        return None
    dots = [n for n in spec.walk() if n.op == "dot"]
    if len(dots) != 1 or len(dots[0].shape) != 2 or dots[0].dtype not in FLOATS or sched.m * sched.n == 0:
        return None
    if FORCE_CHUNKS:
        return dots[0] if sched.k >= 2 else None
    if sched.k < MIN_K or output_tiles(sched) >= tma.sm_count():
        return None
    return dots[0]


def output_tiles(sched: schedules.Schedule) -> int:
    """Output tiles of the tile model's first choice (of every matrix of a batch)."""
    return tiles.output_tiles(sched, configs.default_config(sched))


def choose_chunks(spec: KernelSpec, dot: PNode, sched: schedules.Schedule) -> int:
    """The chunk count S (module docstring); below 2 where the single kernel is modelled
    no slower than any split."""
    if FORCE_CHUNKS:
        return min(FORCE_CHUNKS, sched.k)
    return _best_split(spec, dot, sched, device_model())[0]


def modelled_us(spec: KernelSpec, sched: schedules.Schedule, device) -> float:
    """The modelled time of the kernel's product for extraction's costs, which weigh plans
    before any kernel is split: the single kernel's (the tile model's first choice;
    infinite where no tile fits), or, for a product with a computed operand, both stages
    where it will split. There the split decides whether the operand is computed in the
    product at all (int4 weights at 16 tokens: 38 us unsplit, 19 split, against 34 for the
    weights dequantised first). A plain product reads its operands either way; weighing
    its splits made GPT-2's backward extraction 15% slower for no other plan."""
    ranked = tiles.ranked(sched, device)
    if not ranked:
        return math.inf
    single = tiles.modelled_time_us(sched, ranked[0], device)
    dot = single_product(spec, sched) if enabled() and sched.gathered_sides else None
    if dot is None:
        return single
    if FORCE_CHUNKS:
        return split_time_us(spec, dot, sched, min(FORCE_CHUNKS, sched.k), device)
    return _best_split(spec, dot, sched, device, single)[1]


def _best_split(spec: KernelSpec, dot: PNode, sched: schedules.Schedule, device, single: float | None = None) -> tuple:
    """(chunks, modelled us): the count whose two stages are modelled fastest, or (0, the
    single kernel's time) where none beats it by MIN_GAIN."""
    waves = MAX_WAVES_COMPUTED if sched.gathered_sides else MAX_WAVES
    most = min(sched.k // MIN_CHUNK, waves * tma.sm_count() // output_tiles(sched))
    counts = [s for s in range(2, most + 1) if sched.k % s == 0]  # no padding (module docstring)
    single = single if single is not None else tiles.modelled_time_us(sched, configs.default_config(sched), device)
    best, best_us = 0, single * (1 - MIN_GAIN)
    for chunks in counts:
        us = split_time_us(spec, dot, sched, chunks, device)
        if us < best_us:
            best, best_us = chunks, us
    return (best, best_us) if best else (0, single)


def split_time_us(spec: KernelSpec, dot: PNode, sched: schedules.Schedule, chunks: int, device) -> float:
    """Modelled time of the two stages: stage 1 by the tile model (its first choice, which
    times the partials' store), stage 2 as the bytes it moves (the float32 partials read,
    the output written) at the memory bandwidth, and the second launch."""
    first = schedules.schedule_of(KernelSpec("stage1", [(_chunked_product(dot, chunks), "partials")]))
    stage1 = tiles.modelled_time_us(first, configs.default_config(first), device)
    partial_bytes = chunks * sched.m * sched.n * 4
    out_bytes = sum(root.numel * ops.itemsize(root.dtype) for root, _ in spec.roots)
    return stage1 + (partial_bytes + out_bytes) / device.bandwidth_bytes_per_us + device.launch_us


def build_stages(spec: KernelSpec, dot: PNode, chunks: int, buffers: dict) -> tuple:
    """The two kernels and the partials buffer [S, M, N] float32."""
    m, n = dot.shape
    name = stage1_name(f"buf_{spec.name}", buffers)
    partials = Buffer(name, (chunks, m, n), "float32", "temp")
    first = KernelSpec(spec.name + STAGE1_SUFFIX, [(_chunked_product(dot, chunks), name)], list(spec.fx_nodes))
    # Stage 2 reads the partials [S, M, N] as [M * N, S]: chunk s of element r at s * M * N + r
    load = PNode("load", (name, (1, m * n), 0), (), (m * n, chunks), "float32")
    total = PNode("reduce", ("sum",), (load,), (m * n, 1), dot.dtype)
    product = PNode("reshape", (), (total,), (m, n), dot.dtype, dot.eclass)
    second = KernelSpec(spec.name, [(substitute(root, {id(dot): product}), buf) for root, buf in spec.roots],
                        list(spec.fx_nodes))
    return first, second, partials


def _chunked_product(dot: PNode, chunks: int) -> PNode:
    """``dot`` over ``chunks`` chunks of K, as a batched product [S, M, N] in float32."""
    a, b = dot.args
    (m, k), n = a.shape, b.shape[1]
    length = -(-k // chunks)
    a = _zero_pad(a, 1, chunks * length)
    a = PNode("reshape", (), (a,), (m, chunks, length), a.dtype)
    a = PNode("permute", ((1, 0, 2),), (a,), (chunks, m, length), a.dtype)
    b = _zero_pad(b, 0, chunks * length)
    b = PNode("reshape", (), (b,), (chunks, length, n), b.dtype)
    product = PNode("dot", dot.attrs, (a, b), (chunks, m, n), dot.dtype)
    # The accumulator is float32 already: the cast keeps it unrounded in the partials
    return product if dot.dtype == "float32" else PNode("cast", ("float32",), (product,), product.shape, "float32")


def _zero_pad(x: PNode, dim: int, size: int) -> PNode:
    """``x`` extended with zeros to ``size`` along ``dim`` (zeros add nothing to a product)."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    pad = PNode("const", (0.0,), (), tuple(shape), x.dtype)
    shape[dim] = size
    return PNode("cat", (dim,), (x, pad), tuple(shape), x.dtype)
