"""Split reductions: a reduction with too few rows to fill the GPU becomes two kernels.

A bias or LayerNorm-weight gradient sums 8192 tokens for each of 768 features: a column
reduction (codegen/kernel.py) of 768 rows, 16 rows a program, is 48 programs on a
132-SM H100, each walking all 8192 tokens, at a fraction of the memory bandwidth. So,
where a reduction kernel has fewer programs than the GPU has SMs and a long reduced
axis, the axis is cut into ``S`` chunks of ``L`` elements:

* stage 1 (``<kernel>_partials``) reduces each chunk: the same reduction over
  ``[S, rows, L]`` (the input reshaped to ``[rows, S, L]``, zero-padded to ``S * L``
  where ``S`` does not divide the axis, and permuted), written as float32 partials
  ``[S, rows, 1]``: ``S`` times the programs;
* stage 2 (the kernel's own name) is the original kernel with each reduction replaced by
  the same reduction over its partials, read as ``[rows, S]``: everything the kernel
  computes after the sum (its epilogue, its other row outputs) is unchanged.

Both are ordinary plan kernels, so the module's launcher, the autotuner, parallel
compilation and export handle them like any other. ``S`` is the smallest count that
gives stage 1 ``SPLIT_WAVES`` programs per SM (a divisor of the axis where one is
close), with chunks no shorter than ``SPLIT_MIN_CHUNK``, for kernels with fewer programs
than that. Sums accumulate in float32 in
both stages, as the single kernel does (float64 stays float64); the result differs from
the single kernel's only by the order of the additions.

Not split (the single kernel stays):
* a kernel that also stores full-size outputs (``y = x * w`` beside ``y.sum(0)``): stage 1
  would have to store them through the chunked index, and a kernel that writes a full
  tensor has work enough to spread anyway;
* a reduction nested in another's input (softmax's ``sum(exp(x - max(x)))``): the inner
  one needs the whole axis before the outer can start;
* integer and boolean reductions (no float32 partials for them), and products or
  attention kernels (not reduction schedules).

``EQFUSE_SPLIT_REDUCTIONS=0`` turns splitting off (to compare). Tests lower the
thresholds below to split small reductions on the CPU interpreter.
"""

from __future__ import annotations

from ..errors import Unschedulable
from ..runtime.cache import switched_on
from ..schema import ops
from ..schema.plan import Buffer, KernelSpec, Plan, PNode, contiguous_strides, rewrite_kernels, substitute
from . import configs, schedules, tma
from . import kernel as kgen

SPLIT_MIN_ELEMENTS = 1 << 21  # below this (4 MB of fp16 read), the second launch costs more than it saves
SPLIT_MIN_CHUNK = 256  # shortest chunk of the reduced axis a stage-1 program reduces
SPLIT_WAVES = 2  # stage-1 programs per SM aimed for
SPLIT_MAX = 1024  # most chunks (stage 2 keeps S partials of a row in registers)
FORCE_CHUNKS = 0  # tests: this many chunks for every kernel that may split, whether or not it gains programs
STAGE1_SUFFIX = "_partials"
ENV = "EQFUSE_SPLIT_REDUCTIONS"


def enabled() -> bool:
    """Unless ``EQFUSE_SPLIT_REDUCTIONS`` says 0, false, off or no (a plan cache key holds this too)."""
    return switched_on(ENV)


def split_reductions(plan: Plan) -> None:
    """Rewrite ``plan`` in place: each reduction kernel that qualifies (module docstring)
    becomes its two stages, and their partials buffers join ``plan.buffers``. In place, so
    that whoever runs the plan after code generation (autotuner, compile pool, export)
    sees the kernels the module launches. Running it again changes nothing."""
    if not enabled():
        return

    def stages(kernel, buffers):
        parts = split_kernel(kernel, buffers)
        return parts and ([parts[0], parts[1]], parts[2])
    rewrite_kernels(plan, stages)


def split_kernel(spec: KernelSpec, buffers: dict) -> tuple | None:
    """(stage 1, stage 2, [partials Buffer]) for a kernel worth splitting, else None."""
    if spec.name.endswith(STAGE1_SUFFIX) or any(
            n.op == "load" and n.attrs[0].endswith(STAGE1_SUFFIX) for n in spec.walk()):
        return None  # a stage already
    try:
        sched = schedules.schedule_of(spec)
    except Unschedulable:
        return None
    if not _splittable(spec, sched):
        return None
    chunks = choose_chunks(sched, tma.sm_count())
    if chunks < 2:
        return None
    first, second, partials = build_stages(spec, sched, chunks, buffers)
    try:  # the writer takes both, or the kernel stays whole
        for stage in (first, second):
            kgen.generate_kernel(stage, {**buffers, **{b.name: b for b in partials}})
    except Unschedulable:
        return None
    return first, second, partials


def _splittable(spec: KernelSpec, sched: schedules.Schedule) -> bool:
    if sched.kind != "reduction" or sched.rows * sched.cols < SPLIT_MIN_ELEMENTS:
        return False
    nodes = spec.walk()
    if any(n.op in ("dot", "expdot", "expsum") for n in nodes):
        return False
    reduces = [n for n in nodes if n.op == "reduce"]
    if any(not ops.is_float(r.dtype) or not ops.is_float(r.args[0].dtype) for r in reduces):
        return False
    if any(m.op == "reduce" for r in reduces for m in r.args[0].walk()):
        return False  # nested
    if any(root.numel == sched.rows * sched.cols and sched.cols != 1 for root, _ in spec.roots):
        return False  # a full-size output
    programs = sched.grid(configs.default_config(sched))[0]
    return programs < SPLIT_WAVES * tma.sm_count() or FORCE_CHUNKS > 0


def stage1_programs(sched: schedules.Schedule, chunks: int) -> int:
    """Programs of stage 1 with ``chunks`` chunks, under the default configuration (its
    reads run the way the single kernel's do)."""
    length = -(-sched.cols // chunks)
    columns = sched.columns and length >= schedules.COLUMN_MIN
    est = schedules.Schedule("reduction", rows=chunks * sched.rows, cols=length,
                        reduce_shape=(chunks, sched.rows, length), columns=columns,
                        persistent=schedules.next_pow2(length) <= schedules.PERSISTENT_MAX and not columns)
    return est.grid(configs.default_config(est))[0]


def choose_chunks(sched: schedules.Schedule, sms: int) -> int:
    """The chunk count S: the least that gives stage 1 ``SPLIT_WAVES * sms`` programs (a
    divisor of the axis within a factor of two of it where there is one: no padding, and
    the index keeps its digit structure), else the one that gives it the most programs.
    Below 2 (no split) where no S gives stage 1 more programs than the single kernel has."""
    if FORCE_CHUNKS:
        return min(FORCE_CHUNKS, sched.cols)
    most = min(SPLIT_MAX, sched.cols // SPLIT_MIN_CHUNK)
    best, best_programs = 0, sched.grid(configs.default_config(sched))[0]
    for chunks in range(2, most + 1):
        programs = stage1_programs(sched, chunks)
        if programs >= SPLIT_WAVES * sms:
            near = range(chunks, min(most, 2 * chunks) + 1)
            return next((s for s in near if sched.cols % s == 0), chunks)
        if programs > best_programs:
            best, best_programs = chunks, programs
    return best


def build_stages(spec: KernelSpec, sched: schedules.Schedule, chunks: int, buffers: dict) -> tuple:
    """The two kernels and the partials buffers, one per reduction of ``spec``."""
    outer, cols, rows = tuple(sched.reduce_shape[:-1]), sched.cols, sched.rows
    length = -(-cols // chunks)
    reduces = [n for n in spec.walk() if n.op == "reduce"]
    partials, stage1_roots, combined = [], [], {}
    for i, red in enumerate(reduces):
        op = red.attrs[0]
        dtype = "float64" if "float64" in (red.dtype, red.args[0].dtype) else "float32"
        name = stage1_name(f"buf_{spec.name}_{i}", buffers)
        partials.append(Buffer(name, (chunks, rows, 1), dtype, "temp"))
        stage1_roots.append((_chunk_reduce(red, outer, rows, chunks, length, dtype), name))
        # Stage 2 reads the partials [S, rows] as [*outer, S]: chunk s of row r at s * rows + r
        strides = contiguous_strides(outer) + (rows,)
        load = PNode("load", (name, strides, 0), (), outer + (chunks,), dtype)
        combined[id(red)] = PNode("reduce", (op,), (load,), red.shape, red.dtype, red.eclass)
    first = KernelSpec(spec.name + STAGE1_SUFFIX, stage1_roots, list(spec.fx_nodes))
    second = KernelSpec(spec.name, [(substitute(root, combined), buf) for root, buf in spec.roots],
                        list(spec.fx_nodes))
    return first, second, partials


def _chunk_reduce(red: PNode, outer: tuple, rows: int, chunks: int, length: int, dtype: str) -> PNode:
    """``red`` over each chunk: its input [*outer, C] padded with the reduction's neutral
    element to [*outer, S * L], seen as [rows, S, L], permuted to [S, rows, L], reduced."""
    x = red.args[0]
    cols = x.shape[-1]
    op = red.attrs[0]
    if chunks * length > cols:
        pad = PNode("const", (ops.reduce_identity(op, x.dtype),), (), outer + (chunks * length - cols,), x.dtype)
        x = PNode("cat", (len(outer),), (x, pad), outer + (chunks * length,), x.dtype)
    grouped = PNode("reshape", (), (x,), (rows, chunks, length), x.dtype)
    chunked = PNode("permute", ((1, 0, 2),), (grouped,), (chunks, rows, length), x.dtype)
    return PNode("reduce", (op,), (chunked,), (chunks, rows, 1), dtype)


def stage1_name(base: str, buffers: dict) -> str:
    """A buffer name ``base...`` ending in STAGE1_SUFFIX that ``buffers`` does not hold."""
    k, out = 0, base + STAGE1_SUFFIX
    while out in buffers:
        k += 1
        out = f"{base}{k}{STAGE1_SUFFIX}"
    return out
