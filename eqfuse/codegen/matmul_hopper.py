"""The Hopper matmul templates (Gluon), with a kernel's own epilogue plugged in.

Both are persistent, a program per SM, their operands streamed through a ring of
shared-memory slots by TMA, their products on ``wgmma``, and both hide the epilogue behind
the next tile's K loop, which plain Triton does not do (its whole program runs the
epilogue with the tensor cores idle). Each MMA warpgroup holds 128 float32 accumulator
registers a thread.

* ``matmul_pingpong``: a loader warp fills the ring; two consumer warpgroups take
  alternate 128 x 128 output tiles. A consumer runs its tile's K loop, hands the tensor
  cores to the other through a pair of mbarriers (its turn), then runs the epilogue while
  the other's K loop runs. The turns also keep a consumer from waiting on a ring slot two
  fills ahead, where an mbarrier's phase parity cannot tell the fill it wants from the one
  before.
* ``matmul_cooperative``: two MMA warpgroups share each 128 x 256 tile, 64 rows each, one B
  tile read by both, so the K loop moves fewer bytes a product than two ping-pong tiles
  (on an H100 at 8192 x 4096 x 4096 it ran at cuBLAS's time with a bias epilogue; the
  ping-pong one's K loop is 1.05-1.07x). The product goes, rounded to the operands' dtype,
  to a staging tile in shared memory, whose epilogue warps of their own compute and store
  while the MMA warpgroups run the next tile. The ring is filled by a loader warp beside
  two epilogue warps (``LOADER`` 1), or by the first MMA warpgroup beside four epilogue
  warps (``LOADER`` 0), which keep up with a costly epilogue where the K loop is short.

The epilogue is a ``@gluon.jit`` function passed as a constexpr (codegen/matmul_templates.py
writes it from the kernel's plan): ``EPILOGUE(x, mindex, nindex, M, N, *epi_args)`` returns
the output for a float32 tile ``x`` of the product; ``mindex`` and ``nindex`` are its rows
and columns in its layout, so that loads made from them come back in it. The ping-pong
consumers each have their own copy of the epilogue's code, so it has two forms:

* in halves (CHUNK = 0): ``x`` is half a consumer's accumulator, ``[BLOCK_M, BLOCK_N / 2]``
  in the MMA layout; the output is staged in shared memory and stored by TMA, which drops
  what falls past M and N (TMA reads zeros past them and past K);
* in chunks of CHUNK rows (``_chunked_epilogue``), for an epilogue with a special
  function: the product rounded to the operands' dtype goes through shared memory and the
  epilogue runs in a loop, its code one chunk's (``_store_chunks``, as the cooperative
  template's epilogue warps run it). Unrolled over a tile, two copies of erf's overflow the
  instruction cache (the erf form ran 146 us at GPT-2's MLP shape, 86 chunked).

Measured (NVIDIA H100): GPT-2's MLP shape, 8192 x 3072 x 768 fp16 with a bias and gelu's
tanh form, 78.0 us as the ping-pong template against the best Triton kernel's 86.2 (cuBLAS's
product alone 62.9); x@W + r at 8192 x 4096 x 4096, 424.5-425.7 as the cooperative one
against 440.6-463.0 for the best Triton kernel and 407.8-410.7 for cuBLAS's product alone
(benchmarks/matmul_template_ab.py). An epilogue's float32 instructions still cost nearly
their issue time, overlapped or not (benchmarks/matmul_epilogue_cost.py). The autotuner
times the templates beside the Triton kernels and keeps the fastest.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Registers a thread: at launch, 12 warps (the loader's warp counts as a warpgroup) x 32 x
# 168 fit the SM's 64K; then the loader gives back most of its own to the consumers.
# The same split as flash_hopper's, spelled again: compile workers load each template file
# alone, without its package (runtime/compile_worker.py), so neither imports the other.
MAXNREG = 168
CONSUMER_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)


@gluon.jit
def sigmoid(x):
    """``tl.sigmoid``'s formula (Gluon has none)."""
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _tile(tile, TILES_M: gl.constexpr, TILES_N: gl.constexpr, GROUP_M: gl.constexpr):
    """Output tile number -> (tile row, tile column), in groups of GROUP_M tile rows:
    tiles that run at once read the same operand tiles, which then come from L2."""
    group = tile // (GROUP_M * TILES_N)
    rows = gl.minimum(TILES_M - group * GROUP_M, GROUP_M)
    pid_m = group * GROUP_M + (tile % (GROUP_M * TILES_N)) % rows
    pid_n = (tile % (GROUP_M * TILES_N)) // rows
    return pid_m, pid_n


@gluon.jit
def _operand_descriptors(a_ptr, b_ptr, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr, SA: gl.constexpr,
                         SB: gl.constexpr, B_KMAJOR: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         BLOCK_K: gl.constexpr):
    """TMA descriptors of A ``[M, K]`` in boxes of BLOCK_M x BLOCK_K and of B ``[K, N]`` (or
    ``[N, K]`` where B_KMAJOR) in boxes of BLOCK_K x BLOCK_N, swizzled as wgmma reads them."""
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_desc = tma.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[SA, 1], block_shape=[BLOCK_M, BLOCK_K],
                                        layout=gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype))
    if B_KMAJOR:
        b_desc = tma.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[SB, 1], block_shape=[BLOCK_N, BLOCK_K],
                                            layout=gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype))
    else:
        b_desc = tma.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[SB, 1], block_shape=[BLOCK_K, BLOCK_N],
                                            layout=gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype))
    return a_desc, b_desc


@gluon.jit
def _fill(g, pid_m, pid_n, kk, a_desc, b_desc, a_smem, b_smem, ready, empty, PARTS: gl.constexpr,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
          B_KMAJOR: gl.constexpr):
    """Ring fill g, once a consumer has released its slot: K step kk of the tile's A rows,
    in PARTS boxes of BLOCK_M (one a consumer warpgroup), and of its B columns. A fresh
    mbarrier counts as having completed the phase before its first: the first pass does
    not wait."""
    slot = g % STAGES
    mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), PARTS * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    for part in gl.static_range(PARTS):
        tma.async_copy_global_to_shared(a_desc, [(pid_m * PARTS + part) * BLOCK_M, kk * BLOCK_K], ready.index(slot),
                                        a_smem.index(slot * PARTS + part))
    if B_KMAJOR:
        tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, kk * BLOCK_K], ready.index(slot), b_smem.index(slot))
    else:
        tma.async_copy_global_to_shared(b_desc, [kk * BLOCK_K, pid_n * BLOCK_N], ready.index(slot), b_smem.index(slot))


@gluon.jit
def _loader(a_desc, b_desc, a_smem, b_smem, ready, empty, PARTS: gl.constexpr,
            K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
            TILES_M: gl.constexpr, TILES_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
            PROGRAMS: gl.constexpr, B_KMAJOR: gl.constexpr):
    """One warp: each of the program's output tiles, K step by K step, into the ring."""
    KT: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    g = 0  # ring fills, over all tiles
    for tile in range(gl.program_id(0), TILES_M * TILES_N, PROGRAMS):
        pid_m, pid_n = _tile(tile, TILES_M, TILES_N, GROUP_M)
        for kk in range(KT):
            _fill(g, pid_m, pid_n, kk, a_desc, b_desc, a_smem, b_smem, ready, empty, PARTS, BLOCK_M, BLOCK_N,
                  BLOCK_K, STAGES, B_KMAJOR)
            g += 1


@gluon.jit
def _products(a_smem, b_smem, ready, empty, turn, zero, j, WHICH: gl.constexpr, KT: gl.constexpr,
              STAGES: gl.constexpr, B_KMAJOR: gl.constexpr):
    """The K loop of consumer WHICH's j-th tile (the program's): its products on the tensor
    cores, one in flight while the next slot's data is awaited, each slot given back to the
    loader once its product is done; the turn handed to the other consumer once the last
    product is issued. Returns the accumulator, every product complete."""
    g = j * KT  # ring fills before this tile's first
    acc = zero
    # This consumer's turn: the other has issued its last tile's products. The first tile
    # of consumer 0 waits for the phase before a fresh barrier's first: no wait.
    mbarrier.wait(turn.index(WHICH), ((j // 2) & 1) ^ (1 - WHICH))
    for kk in range(KT):
        slot = g % STAGES
        mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
        if B_KMAJOR:
            b = b_smem.index(slot).permute((1, 0))
        else:
            b = b_smem.index(slot)
        acc = warpgroup_mma(a_smem.index(slot), b, acc, use_acc=kk > 0, is_async=True)
        # Wait for the previous product only: its slot goes back to the loader.
        acc = warpgroup_mma_wait(1, deps=(acc,))
        if kk > 0:
            mbarrier.arrive(empty.index((g - 1) % STAGES), count=1)
        g += 1
    mbarrier.arrive(turn.index(1 - WHICH), count=1)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((g - 1) % STAGES), count=1)
    return acc


@gluon.jit
def _epilogue(acc, m0, n0, staging, EPILOGUE: gl.constexpr, epi_args, M: gl.constexpr, N: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The epilogue of the ``[BLOCK_M, BLOCK_N]`` part of a tile at (m0, n0), into its
    place in the staging tile."""
    layout: gl.constexpr = acc.type.layout
    mindex = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))[:, None]
    nindex = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))[None, :]
    out = EPILOGUE(acc, mindex, nindex, M, N, *epi_args)
    staging.store(out.to(staging.dtype))


@gluon.jit
def _store_chunks(chunks, first, row0, pid_n, c_ptr, EPILOGUE: gl.constexpr, epi_args, COUNT: gl.constexpr,
                  M: gl.constexpr, N: gl.constexpr, SC: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr):
    """The epilogue of COUNT chunks of CHUNK rows from shared memory (``chunks.index(first)``
    on, the output's rows from row0), one at a time in a loop so that its code is one
    chunk's: each loaded in a row layout over the partition's warps, its epilogue computed
    and stored from there (masked at M and N)."""
    out: gl.constexpr = c_ptr.dtype.element_ty
    LANES_N: gl.constexpr = BLOCK_N // 8 if BLOCK_N // 8 < 32 else 32  # 8 elements (16 bytes) a thread
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANES_N, LANES_N], [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))[:, None]
    nindex = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))[None, :]
    for i in range(COUNT):
        x = chunks.index(first + i).load(layout).to(gl.float32)
        mindex = row0 + i * CHUNK + r
        y = EPILOGUE(x, mindex, nindex, M, N, *epi_args)
        gl.store(c_ptr + mindex * SC + nindex, y.to(out), mask=(mindex < M) & (nindex < N))


@gluon.jit
def _chunked_epilogue(acc, pid_m, pid_n, rows, chunks, c_ptr, EPILOGUE: gl.constexpr, epi_args, WHICH: gl.constexpr,
                      M: gl.constexpr, N: gl.constexpr, SC: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, CHUNK: gl.constexpr):
    """The epilogue of a whole tile in chunks of rows: the product rounded to the operands'
    dtype (the graph's own product is) into this consumer's rows of shared memory, then
    ``_store_chunks``."""
    NCH: gl.constexpr = BLOCK_M // CHUNK
    gl.thread_barrier()  # the last tile's chunks are read
    rows.store(acc.to(rows.dtype))
    gl.thread_barrier()
    _store_chunks(chunks, WHICH * NCH, pid_m * BLOCK_M, pid_n, c_ptr, EPILOGUE, epi_args, NCH, M, N, SC, BLOCK_N,
                  CHUNK)


@gluon.jit
def _consumer(c_out, a_smem, b_smem, c_smem, ready, empty, turn, WHICH: gl.constexpr, EPILOGUE: gl.constexpr,
              epi_args, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr, SC: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, TILES_M: gl.constexpr, TILES_N: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, PROGRAMS: gl.constexpr, B_KMAJOR: gl.constexpr,
              CHUNK: gl.constexpr):
    """One warpgroup: the program's tiles WHICH, WHICH + 2, ...: the K loop on the tensor
    cores (``_products``), then the epilogue. In two halves along N (half the epilogue's
    temporaries live at once: in one piece erf's spilled), staged in shared memory and
    stored by TMA (``c_out`` a descriptor); or, where CHUNK, in chunks of rows
    (``_chunked_epilogue``; ``c_out`` the output's pointer)."""
    KT: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=layout)
    if CHUNK:
        staging = c_smem.slice(WHICH * BLOCK_M, BLOCK_M)
        chunks = c_smem._reinterpret(c_smem.dtype, [2 * BLOCK_M // CHUNK, CHUNK, BLOCK_N], c_smem.layout)
    else:
        staging = c_smem.index(WHICH)
    j = WHICH  # the program's j-th tile
    for tile in range(gl.program_id(0) + WHICH * PROGRAMS, TILES_M * TILES_N, 2 * PROGRAMS):
        pid_m, pid_n = _tile(tile, TILES_M, TILES_N, GROUP_M)
        acc = _products(a_smem, b_smem, ready, empty, turn, zero, j, WHICH, KT, STAGES, B_KMAJOR)
        if CHUNK:
            _chunked_epilogue(acc, pid_m, pid_n, staging, chunks, c_out, EPILOGUE, epi_args, WHICH, M, N, SC,
                              BLOCK_M, BLOCK_N, CHUNK)
        else:
            tma.store_wait(0)  # this warpgroup's last tile has left the staging tile
            halves = gl.permute(gl.reshape(acc, [BLOCK_M, 2, BLOCK_N // 2]), (0, 2, 1))
            left, right = gl.split(halves)
            _epilogue(left, pid_m * BLOCK_M, pid_n * BLOCK_N, staging.slice(0, BLOCK_N // 2, dim=1), EPILOGUE,
                      epi_args, M, N, BLOCK_M, BLOCK_N // 2)
            _epilogue(right, pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2,
                      staging.slice(BLOCK_N // 2, BLOCK_N // 2, dim=1), EPILOGUE, epi_args, M, N, BLOCK_M,
                      BLOCK_N // 2)
            fence_async_shared()
            tma.async_copy_shared_to_global(c_out, [pid_m * BLOCK_M, pid_n * BLOCK_N], staging)
        j += 2
    if not CHUNK:
        tma.store_wait(0)


@gluon.jit
def matmul_pingpong(a_ptr, b_ptr, c_ptr, EPILOGUE: gl.constexpr, epi_args,
                    M: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
                    SA: gl.constexpr, SB: gl.constexpr, SC: gl.constexpr, B_KMAJOR: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                    STAGES: gl.constexpr, PROGRAMS: gl.constexpr, CHUNK: gl.constexpr = 0):
    """``C = EPILOGUE(A @ B)`` for A ``[M, K]`` (row stride SA), B ``[K, N]`` (row stride
    SB), or B given as ``[N, K]`` where B_KMAJOR, C ``[M, N]`` (row stride SC); unit inner
    strides, 16-byte aligned addresses and strides. Called by a generated ``@gluon.jit``
    kernel launched on PROGRAMS programs with ``num_warps=4`` and ``maxnreg=MAXNREG``."""
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    out: gl.constexpr = c_ptr.dtype.element_ty
    a_desc, b_desc = _operand_descriptors(a_ptr, b_ptr, M, N, K, SA, SB, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
    TILES_M: gl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
    TILES_N: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    a_smem = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    if CHUNK:  # both consumers' rows, in the operands' dtype; swizzled every 8 rows (CHUNK's multiple)
        c_out = c_ptr
        c_smem = gl.allocate_shared_memory(dtype, [2 * BLOCK_M, BLOCK_N], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
    else:
        c_out = tma.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[SC, 1], block_shape=[BLOCK_M, BLOCK_N],
                                           layout=gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], out))
        c_smem = gl.allocate_shared_memory(out, [2] + c_out.block_type.shape, c_out.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (c_out, a_smem, b_smem, c_smem, ready, empty, turn, 0, EPILOGUE, epi_args, M, N, K, SC, BLOCK_M,
                     BLOCK_N, BLOCK_K, TILES_M, TILES_N, GROUP_M, STAGES, PROGRAMS, B_KMAJOR, CHUNK)),
        (_consumer, (c_out, a_smem, b_smem, c_smem, ready, empty, turn, 1, EPILOGUE, epi_args, M, N, K, SC, BLOCK_M,
                     BLOCK_N, BLOCK_K, TILES_M, TILES_N, GROUP_M, STAGES, PROGRAMS, B_KMAJOR, CHUNK)),
        (_loader, (a_desc, b_desc, a_smem, b_smem, ready, empty, 1, K, BLOCK_M, BLOCK_N, BLOCK_K,
                   TILES_M, TILES_N, GROUP_M, STAGES, PROGRAMS, B_KMAJOR)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# The cooperative template's registers: 12 warps at launch (two MMA warpgroups, and a third
# of the epilogue's warps and the loader's, padded to a warpgroup) x 32 x 168 fit the 64K;
# then the MMA warpgroups take 200 (a 64 x 256 accumulator is 128) and the third 104.
MMA_REGS = gl.constexpr(200)
EPILOGUE_REGS = gl.constexpr(104)


@gluon.jit
def _program_tiles(TILES: gl.constexpr, PROGRAMS: gl.constexpr):
    """How many of TILES output tiles this program runs (tiles pid, pid + PROGRAMS, ...)."""
    return (TILES - gl.program_id(0) + PROGRAMS - 1) // PROGRAMS


@gluon.jit
def _to_staging(acc, rows, acc_free, WHICH: gl.constexpr, t):
    """MMA warpgroup WHICH's product of the program's t-th tile, rounded to the operands'
    dtype, into its rows of the staging tile, once the epilogue has read its last."""
    mbarrier.wait(acc_free.index(WHICH), (t & 1) ^ 1)
    rows.store(acc.to(rows.dtype))
    gl.thread_barrier()  # every thread's rows are in before they are read


@gluon.jit
def _cooperative_mma(a_desc, b_desc, a_smem, b_smem, staging, ready, empty, acc_ready, acc_free, c_ptr,
                     EPILOGUE: gl.constexpr, epi_args, WHICH: gl.constexpr, M: gl.constexpr, N: gl.constexpr,
                     K: gl.constexpr, SC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_K: gl.constexpr, TILES_M: gl.constexpr, TILES_N: gl.constexpr, GROUP_M: gl.constexpr,
                     STAGES: gl.constexpr, PROGRAMS: gl.constexpr, B_KMAJOR: gl.constexpr, LOADER: gl.constexpr,
                     TAIL: gl.constexpr):
    """MMA warpgroup WHICH: rows WHICH of each of the program's tiles, K step by K step on
    the tensor cores (its own A box, the B tile both warpgroups read), each slot given back
    once its product is done; then the product, rounded to the operands' dtype, into its
    rows of the staging tile once the epilogue has read the last one. Without a loader
    warp (LOADER 0), warpgroup 0 issues the ring's fills itself, STAGES - 1 ahead. The
    program's last tile has no K loop to hide its epilogue behind: where TAIL, each MMA
    warpgroup runs it on its own rows (four warps for two epilogue warps' one)."""
    KT: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    CHUNK: gl.constexpr = 16
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=layout)
    rows = staging.slice(WHICH * BLOCK_M, BLOCK_M)
    tiles = _program_tiles(TILES_M * TILES_N, PROGRAMS)
    fills = tiles * KT
    PRODUCER: gl.constexpr = not LOADER and WHICH == 0
    if PRODUCER:
        for p in range(gl.minimum(STAGES - 1, fills)):
            _fill_at(p, a_desc, b_desc, a_smem, b_smem, ready, empty, KT, BLOCK_M, BLOCK_N, BLOCK_K, TILES_M,
                     TILES_N, GROUP_M, STAGES, PROGRAMS, B_KMAJOR)
    for t in range(tiles - TAIL):
        acc = _cooperative_products(a_desc, b_desc, a_smem, b_smem, ready, empty, zero, t, fills, WHICH, KT,
                                    BLOCK_M, BLOCK_N, BLOCK_K, TILES_M, TILES_N, GROUP_M, STAGES, PROGRAMS,
                                    B_KMAJOR, PRODUCER)
        _to_staging(acc, rows, acc_free, WHICH, t)
        mbarrier.arrive(acc_ready.index(WHICH), count=1)
    if TAIL:  # outside the loop: the loop's code stays the K loop's and the hand-over's
        t = tiles - 1
        acc = _cooperative_products(a_desc, b_desc, a_smem, b_smem, ready, empty, zero, t, fills, WHICH, KT,
                                    BLOCK_M, BLOCK_N, BLOCK_K, TILES_M, TILES_N, GROUP_M, STAGES, PROGRAMS,
                                    B_KMAJOR, PRODUCER)
        _to_staging(acc, rows, acc_free, WHICH, t)
        pid_m, pid_n = _tile(gl.program_id(0) + t * PROGRAMS, TILES_M, TILES_N, GROUP_M)
        chunks = rows._reinterpret(rows.dtype, [BLOCK_M // CHUNK, CHUNK, BLOCK_N], rows.layout)
        _store_chunks(chunks, 0, (2 * pid_m + WHICH) * BLOCK_M, pid_n, c_ptr, EPILOGUE, epi_args, BLOCK_M // CHUNK,
                      M, N, SC, BLOCK_N, CHUNK)


@gluon.jit
def _cooperative_products(a_desc, b_desc, a_smem, b_smem, ready, empty, zero, t, fills, WHICH: gl.constexpr,
                          KT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                          TILES_M: gl.constexpr, TILES_N: gl.constexpr, GROUP_M: gl.constexpr,
                          STAGES: gl.constexpr, PROGRAMS: gl.constexpr, B_KMAJOR: gl.constexpr,
                          PRODUCER: gl.constexpr):
    """The K loop of MMA warpgroup WHICH's rows of the program's t-th tile: returns the
    accumulator, every product complete and every slot given back (the producer, fills
    STAGES - 1 ahead of the one it reads)."""
    g = t * KT  # ring fills before this tile's first
    acc = zero
    for kk in range(KT):
        slot = g % STAGES
        mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
        if B_KMAJOR:
            b = b_smem.index(slot).permute((1, 0))
        else:
            b = b_smem.index(slot)
        acc = warpgroup_mma(a_smem.index(2 * slot + WHICH), b, acc, use_acc=kk > 0, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))  # the previous product is done: its slot goes back
        if kk > 0:
            mbarrier.arrive(empty.index((g - 1) % STAGES), count=1)
        if PRODUCER:
            if g + STAGES - 1 < fills:  # into the slot just given back, once the other has too
                _fill_at(g + STAGES - 1, a_desc, b_desc, a_smem, b_smem, ready, empty, KT, BLOCK_M, BLOCK_N,
                         BLOCK_K, TILES_M, TILES_N, GROUP_M, STAGES, PROGRAMS, B_KMAJOR)
        g += 1
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((g - 1) % STAGES), count=1)
    return acc


@gluon.jit
def _fill_at(p, a_desc, b_desc, a_smem, b_smem, ready, empty, KT: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, TILES_M: gl.constexpr, TILES_N: gl.constexpr,
             GROUP_M: gl.constexpr, STAGES: gl.constexpr, PROGRAMS: gl.constexpr, B_KMAJOR: gl.constexpr):
    """The program's ring fill p, of a cooperative tile (two A boxes)."""
    pid_m, pid_n = _tile(gl.program_id(0) + (p // KT) * PROGRAMS, TILES_M, TILES_N, GROUP_M)
    _fill(p, pid_m, pid_n, p % KT, a_desc, b_desc, a_smem, b_smem, ready, empty, 2, BLOCK_M, BLOCK_N, BLOCK_K,
          STAGES, B_KMAJOR)


@gluon.jit
def _cooperative_epilogue(staging, acc_ready, acc_free, c_ptr, EPILOGUE: gl.constexpr, epi_args, M: gl.constexpr,
                          N: gl.constexpr, SC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          TILES_M: gl.constexpr, TILES_N: gl.constexpr, GROUP_M: gl.constexpr,
                          PROGRAMS: gl.constexpr, TAIL: gl.constexpr, CHUNK: gl.constexpr):
    """The epilogue's warps: each tile's two halves from the staging tile, in chunks of
    CHUNK rows (``_store_chunks``), each half given back to its MMA warpgroup once read; where
    TAIL, all but the program's last tile (the MMA warpgroups run that one)."""
    NCH: gl.constexpr = BLOCK_M // CHUNK
    chunks = staging._reinterpret(staging.dtype, [2 * NCH, CHUNK, BLOCK_N], staging.layout)
    tiles = _program_tiles(TILES_M * TILES_N, PROGRAMS)
    for t in range(tiles - TAIL):
        pid_m, pid_n = _tile(gl.program_id(0) + t * PROGRAMS, TILES_M, TILES_N, GROUP_M)
        for half in gl.static_range(2):
            mbarrier.wait(acc_ready.index(half), t & 1)
            _store_chunks(chunks, half * NCH, (2 * pid_m + half) * BLOCK_M, pid_n, c_ptr, EPILOGUE, epi_args, NCH,
                          M, N, SC, BLOCK_N, CHUNK)
            gl.thread_barrier()  # every warp has read the half
            mbarrier.arrive(acc_free.index(half), count=1)


@gluon.jit
def matmul_cooperative(a_ptr, b_ptr, c_ptr, EPILOGUE: gl.constexpr, epi_args,
                       M: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
                       SA: gl.constexpr, SB: gl.constexpr, SC: gl.constexpr, B_KMAJOR: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                       STAGES: gl.constexpr, PROGRAMS: gl.constexpr, LOADER: gl.constexpr,
                       TAIL: gl.constexpr = 1):
    """``C = EPILOGUE(A @ B)`` as matmul_pingpong's, in tiles of 2 BLOCK_M x BLOCK_N that two
    MMA warpgroups share (BLOCK_M rows each; one B tile for both, so fewer bytes from L2 a
    product than two ping-pong tiles), the epilogue run by warps of its own from a staging
    copy of the product while the next tile's K loop runs. The ring is filled by a loader
    warp beside two epilogue warps (LOADER 1), or by the first MMA warpgroup beside four
    epilogue warps (LOADER 0: more hands for a costly epilogue). Launched with
    ``num_warps=4`` and ``maxnreg=MAXNREG``."""
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    # 16 elements a thread of the epilogue's warps a chunk: at 32 the loop's code was twice
    # the size and gelu's erf form ran 1-4% slower at 8192 x 4096 x 4096 (level at K = 768)
    EPI_ROWS: gl.constexpr = 2 * (2 if LOADER else 4)
    a_desc, b_desc = _operand_descriptors(a_ptr, b_ptr, M, N, K, SA, SB, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
    TILES_M: gl.constexpr = (M + 2 * BLOCK_M - 1) // (2 * BLOCK_M)
    TILES_N: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    a_smem = gl.allocate_shared_memory(dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    # both warpgroups' rows, in the operands' dtype; swizzled every 8 rows, or every chunk
    # where a chunk is fewer (a chunk's view must start where the pattern does)
    PHASES: gl.constexpr = EPI_ROWS if EPI_ROWS < 8 else 8
    staging = gl.allocate_shared_memory(dtype, [2 * BLOCK_M, BLOCK_N], gl.SwizzledSharedLayout(8, 1, PHASES, [1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    acc_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    acc_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both MMA warpgroups read each slot
    for i in gl.static_range(2):
        mbarrier.init(acc_ready.index(i), count=1)
        mbarrier.init(acc_free.index(i), count=1)
    if LOADER:
        gl.warp_specialize([
            (_cooperative_mma, (a_desc, b_desc, a_smem, b_smem, staging, ready, empty, acc_ready, acc_free, c_ptr,
                                EPILOGUE, epi_args, 0, M, N, K, SC, BLOCK_M, BLOCK_N, BLOCK_K, TILES_M, TILES_N,
                                GROUP_M, STAGES, PROGRAMS, B_KMAJOR, 1, TAIL)),
            (_cooperative_mma, (a_desc, b_desc, a_smem, b_smem, staging, ready, empty, acc_ready, acc_free, c_ptr,
                                EPILOGUE, epi_args, 1, M, N, K, SC, BLOCK_M, BLOCK_N, BLOCK_K, TILES_M, TILES_N,
                                GROUP_M, STAGES, PROGRAMS, B_KMAJOR, 1, TAIL)),
            (_cooperative_epilogue, (staging, acc_ready, acc_free, c_ptr, EPILOGUE, epi_args, M, N, SC, BLOCK_M,
                                     BLOCK_N, TILES_M, TILES_N, GROUP_M, PROGRAMS, TAIL, EPI_ROWS)),
            (_loader, (a_desc, b_desc, a_smem, b_smem, ready, empty, 2, K, BLOCK_M, BLOCK_N, BLOCK_K, TILES_M,
                       TILES_N, GROUP_M, STAGES, PROGRAMS, B_KMAJOR)),
        ], [4, 2, 1], [MMA_REGS, EPILOGUE_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_cooperative_mma, (a_desc, b_desc, a_smem, b_smem, staging, ready, empty, acc_ready, acc_free, c_ptr,
                                EPILOGUE, epi_args, 0, M, N, K, SC, BLOCK_M, BLOCK_N, BLOCK_K, TILES_M, TILES_N,
                                GROUP_M, STAGES, PROGRAMS, B_KMAJOR, 0, TAIL)),
            (_cooperative_mma, (a_desc, b_desc, a_smem, b_smem, staging, ready, empty, acc_ready, acc_free, c_ptr,
                                EPILOGUE, epi_args, 1, M, N, K, SC, BLOCK_M, BLOCK_N, BLOCK_K, TILES_M, TILES_N,
                                GROUP_M, STAGES, PROGRAMS, B_KMAJOR, 0, TAIL)),
            (_cooperative_epilogue, (staging, acc_ready, acc_free, c_ptr, EPILOGUE, epi_args, M, N, SC, BLOCK_M,
                                     BLOCK_N, TILES_M, TILES_N, GROUP_M, PROGRAMS, TAIL, EPI_ROWS)),
        ], [4, 4], [MMA_REGS, EPILOGUE_REGS])


# Triton merges a callee's global constexprs (CONSUMER_REGS...) into its caller's cache key
# before it computes the callee's own key: the first kernel to call matmul_pingpong would be
# keyed without them, later ones with them, and a compile worker (which sees one kernel)
# would disagree with the JIT of the process that sent it (the pool then reported "compiled
# under another key"). Computed here, at import, every caller's key is the same.
CACHE_KEYS = (matmul_pingpong.cache_key, matmul_cooperative.cache_key, sigmoid.cache_key)
