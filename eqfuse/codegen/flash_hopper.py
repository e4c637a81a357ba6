"""Flash attention for Hopper, written in Gluon (Triton's explicit-layout dialect): a
template the attention schedule offers the autotuner where a kernel has its plain form
(codegen/flash.py says when).

The portable attention kernel (codegen/attention.py) is plain Triton: each key tile's
``q @ k^T`` must finish before its softmax starts, and the softmax before ``p @ v``
starts, so the tensor cores idle while the exponentials run. Triton 3.6 gives no way to
change that on Hopper (benchmarks/attention_probe.py tried prefetching the next product,
warp_specialize and persistent programs). Gluon exposes the asynchronous ``wgmma``, its
wait, mbarriers and warp specialisation, so this kernel overlaps the two the way
FlashAttention-3 does. Within a warpgroup, the step for key tile ``j`` issues
``S_j = q @ k_j^T``, then ``O += P_{j-1} @ v_{j-1}``, waits for ``S_j`` only and runs tile
``j``'s softmax while the second product is still on the tensor cores. Across warpgroups,
two consumers of 64 rows each run unsynchronised, fed by a loader warp through rings of
``STAGES`` K and V slots. Persistent programs (PROGRAMS > 0) walk many query blocks each,
so that one block's epilogue and the next one's first loads overlap. Measured on an H200
(benchmarks/attention.py, B=4, H=32): 0.98-1.04x SDPA's time at head dim 128, where the
portable kernel took 1.29-1.31x at S=2048; at head dim 256 (keys 64 at a time, so that
q and two K and V slots fit the shared memory) 1.07-1.3x (codegen/flash.py has the
probe's figures).
This module imports only Triton: the compile pool's workers load it from its file.

What it computes, per batch entry ``b``, head ``h`` and query row ``i``:

    s_ij = (q_i . k_j) * SCALE                  (SCALE in log2 units: 1/sqrt(d) * log2(e))
    s_ij = -inf  where j - i > BAND_HI          (CAUSAL; BAND_HI = 0 is the usual mask)
    out_i = sum_j exp2(s_ij - m_i) v_j / sum_j exp2(s_ij - m_i),   m_i = max_j s_ij

a row with no visible key gives NaN (0 / 0, as eager's softmax does). Operands are
fp16 or bf16 ``[B, H, M or N, D]`` at offsets OQ, OK, OV, OO (elements) from their
pointers, with any batch and head strides and a unit stride along D; where KT, k is
stored transposed instead (``[B, H, D, N]``, a unit stride along the keys: Llama's k
after its rotary embedding) and read as ``[D, BLOCK_N]`` tiles. Offsets, strides and
base addresses must be multiples of 16 bytes (TMA). Tiles are DP wide along the head
dim, the power of two at or above D: where D is less (96, say), TMA fills the columns
past D with zeros as it loads (nothing added to a score, a zero column of the output)
and leaves them out as it stores; k stored transposed then has D rows a head, so its
persistent form, whose boxes would reach into the next head, needs D = DP. The kernel
makes its TMA descriptors on the device (Triton's global scratch): per program for its
head, or once per persistent program over collapsed operands. The sizes and strides are
constexprs: the kernel is compiled for one shape, as eqfuse's generated kernels are.
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

MAXNREG = 168  # registers per thread at launch: 12 warps x 32 x 168 fit the SM's 64K
CONSUMER_REGS = 240  # each consumer warpgroup's after the loader gives back its own (24)


@gluon.jit
def _softmax_step(s, m_run, l_run, n0, rows, SCALE: gl.constexpr, N: gl.constexpr, BAND_HI: gl.constexpr,
                  CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, masked):
    """One key tile's share of the online softmax: the tile's probabilities ``p`` (fp32,
    the scores' layout), the factor ``alpha`` the accumulator is rescaled by, and the new
    running max and sum."""
    if masked:  # a tile the causal edge or the end of the keys crosses
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        keep = cols[None, :] < N
        if CAUSAL:
            keep = keep & (cols[None, :] - rows[:, None] <= BAND_HI)
        s = gl.where(keep, s, -float("inf"))
    m_new = gl.maximum(m_run, gl.max(s, 1) * SCALE)
    # A row that has seen only -inf keeps a finite reference: no NaN from -inf - -inf.
    m_ref = gl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = gl.exp2(m_run - m_ref)
    p = gl.exp2(s * SCALE - m_ref[:, None])
    l_new = l_run * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _item(t, mblk0, bh0, N: gl.constexpr, CAUSAL: gl.constexpr, BAND_HI: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, PROGRAMS: gl.constexpr, MB: gl.constexpr, BH: gl.constexpr, CHUNK: gl.constexpr):
    """Work item ``t``: its (batch x head), first query row, and the key tiles ``[0, tiles)``
    its rows see. One program per item: the program's own. Persistent: heads in chunks of
    CHUNK, whose K and V stay in L2 while their query blocks run, and within a chunk the
    longest query blocks first when causal. The loader and both consumers walk the same."""
    if PROGRAMS:
        chunk = t // (MB * CHUNK)
        width = gl.minimum(CHUNK, BH - chunk * CHUNK)
        r = t - chunk * (MB * CHUNK)
        mblk = r // width
        bh = chunk * CHUNK + r % width
        if CAUSAL:
            mblk = MB - 1 - mblk
    else:
        mblk = mblk0
        bh = bh0
    off_m = mblk * BLOCK_M
    if CAUSAL:
        tiles = gl.cdiv(gl.maximum(gl.minimum(N, off_m + BLOCK_M + BAND_HI), 0), BLOCK_N)
    else:
        tiles = gl.cdiv(N, BLOCK_N)
    return bh, off_m, tiles


@gluon.jit
def _fetch(desc, row, col, g, ready, empty, smem, STAGES: gl.constexpr):
    """The g-th tile of a ring (K's or V's), at ``[row, col]`` of ``desc``, once both
    consumers have released its slot. A fresh mbarrier counts as having completed the
    phase before its first: the first pass through a ring does not wait."""
    slot = g % STAGES
    mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], ready.index(slot), smem.index(slot))


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, work,
            M: gl.constexpr, N: gl.constexpr, D: gl.constexpr, KT: gl.constexpr, GROUP: gl.constexpr,
            CAUSAL: gl.constexpr,
            BAND_HI: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            QBUF: gl.constexpr,
            PROGRAMS: gl.constexpr, MB: gl.constexpr, BH: gl.constexpr, CHUNK: gl.constexpr):
    """One warp: per work item, q's two halves, and K and V tiles into their rings in the
    order the consumers use them (K_i beside V_{i-1}), each as soon as both consumers have
    released its slot. The rings run on across items: the next item's first K tile is
    fetched while the consumers finish this one."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    start, stop, step, mblk0, bh0 = work
    HALF: gl.constexpr = BLOCK_M // 2
    it = 0  # K and V tiles fetched, over all items
    qi = 0  # items begun
    for t in range(start, stop, step):
        bh, off_m, tiles = _item(t, mblk0, bh0, N, CAUSAL, BAND_HI, BLOCK_M, BLOCK_N, PROGRAMS, MB, BH, CHUNK)
        # Persistent programs read collapsed [heads x rows, D] boxes; the others one head's.
        q_row = off_m + (bh * M if PROGRAMS else 0)
        kv = bh // GROUP  # the stored head of k and v
        v_row = kv * N if PROGRAMS else 0
        k_row = (kv * D if KT else kv * N) if PROGRAMS else 0
        qb = qi % QBUF
        for i in range(tiles + 1):
            if i < tiles:
                if KT:  # k^T's [D, BLOCK_N] box of the keys
                    _fetch(k_desc, k_row, i * BLOCK_N, it + i, k_ready, k_empty, k_smem, STAGES)
                else:
                    _fetch(k_desc, k_row + i * BLOCK_N, 0, it + i, k_ready, k_empty, k_smem, STAGES)
            if i == 0:
                mbarrier.wait(q_empty.index(qb), ((qi // QBUF) & 1) ^ 1)
                mbarrier.expect(q_ready.index(qb), 2 * q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_ready.index(qb), q_smem.index(2 * qb))
                tma.async_copy_global_to_shared(q_desc, [q_row + HALF, 0], q_ready.index(qb),
                                                q_smem.index(2 * qb + 1))
            if i > 0:
                _fetch(v_desc, v_row + (i - 1) * BLOCK_N, 0, it + i - 1, v_ready, v_empty, v_smem, STAGES)
        it += tiles
        qi += 1


@gluon.jit
def _kt(k_smem, slot, KT: gl.constexpr):
    """k^T's tile in ring slot ``slot``: as stored where KT, else K's ``[BLOCK_N, D]`` tile
    seen transposed."""
    return k_smem.index(slot) if KT else k_smem.index(slot).permute((1, 0))


@gluon.jit
def _consumer(o_desc, q_smem, o_smem, k_smem, v_smem, bars, work, WHICH: gl.constexpr,
              M: gl.constexpr, N: gl.constexpr, D: gl.constexpr, KT: gl.constexpr, SCALE: gl.constexpr,
              CAUSAL: gl.constexpr, BAND_HI: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, QBUF: gl.constexpr, PROGRAMS: gl.constexpr, MB: gl.constexpr,
              BH: gl.constexpr, CHUNK: gl.constexpr):
    """One warpgroup: per work item, rows ``WHICH * HALF`` on of its query block, over
    every key tile they see, with the next tile's scores overlapping this tile's P @ V."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    start, stop, step, mblk0, bh0 = work
    HALF: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
    o_tile = o_smem.index(WHICH)
    it = 0  # K and V tiles consumed, over all items
    qi = 0  # items begun
    for t in range(start, stop, step):
        bh, off_m, tiles = _item(t, mblk0, bh0, N, CAUSAL, BAND_HI, BLOCK_M, BLOCK_N, PROGRAMS, MB, BH, CHUNK)
        first = off_m + WHICH * HALF
        edge = N // BLOCK_N * BLOCK_N  # key tiles from here on need a mask
        if CAUSAL:
            edge = gl.minimum(edge, gl.maximum(first + BAND_HI + 1, 0) // BLOCK_N * BLOCK_N)
        rows = first + gl.arange(0, HALF, layout=row_layout)
        m_run = gl.full([HALF], -float("inf"), gl.float32, layout=row_layout)
        l_run = gl.zeros([HALF], gl.float32, layout=row_layout)
        acc = gl.zeros([HALF, D], gl.float32, layout=o_layout)
        qb = qi % QBUF
        q = q_smem.index(2 * qb + WHICH)
        mbarrier.wait(q_ready.index(qb), (qi // QBUF) & 1)

        p = gl.zeros([HALF, BLOCK_N], dtype, layout=p_layout)
        if tiles > 0:
            slot = it % STAGES
            mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
            s = warpgroup_mma(q, _kt(k_smem, slot, KT), s_zero, use_acc=False)
            mbarrier.arrive(k_empty.index(slot), count=1)
            p32, alpha, m_run, l_run = _softmax_step(s, m_run, l_run, 0, rows, SCALE, N, BAND_HI, CAUSAL,
                                                     BLOCK_N, edge == 0)
            p = gl.convert_layout(p32.to(dtype), p_layout)
        for j in range(1, tiles):
            g = it + j
            slot = g % STAGES
            prev = (g - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
            s_tok = warpgroup_mma(q, _kt(k_smem, slot, KT), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
            o_tok = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            # The scores are ready once at most one product (P @ V) is in flight.
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            mbarrier.arrive(k_empty.index(slot), count=1)  # this warpgroup is done with K's slot
            n0 = j * BLOCK_N
            p32, alpha, m_run, l_run = _softmax_step(s, m_run, l_run, n0, rows, SCALE, N, BAND_HI, CAUSAL,
                                                     BLOCK_N, n0 >= edge)
            acc = warpgroup_mma_wait(0, deps=(o_tok,))
            mbarrier.arrive(v_empty.index(prev), count=1)  # and with V's
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p = gl.convert_layout(p32.to(dtype), p_layout)
        if tiles > 0:
            g = it + tiles - 1
            last = g % STAGES
            mbarrier.wait(v_ready.index(last), (g // STAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(last), acc)
            mbarrier.arrive(v_empty.index(last), count=1)
        mbarrier.arrive(q_empty.index(qb), count=1)  # its products are done: q's buffer is free

        # out = acc / l; a row with no visible key is 0 / 0.
        l_o = gl.convert_layout(l_run, gl.SliceLayout(1, o_layout))
        out = acc / l_o[:, None]
        if PROGRAMS:
            tma.store_wait(0)  # the last item's output has left this warpgroup's staging tile
        o_tile.store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [first + (bh * M if PROGRAMS else 0), 0], o_tile)
        it += tiles
        qi += 1
    tma.store_wait(0)


@gluon.jit
def flash_attention_hopper(
        q_ptr, k_ptr, v_ptr, o_ptr,
        H: gl.constexpr, M: gl.constexpr, N: gl.constexpr, D: gl.constexpr, DP: gl.constexpr,
        OQ: gl.constexpr, OK: gl.constexpr, OV: gl.constexpr, OO: gl.constexpr,
        SQB: gl.constexpr, SQH: gl.constexpr, SQM: gl.constexpr,
        SKB: gl.constexpr, SKH: gl.constexpr, SKN: gl.constexpr, KT: gl.constexpr, GROUP: gl.constexpr,
        SVB: gl.constexpr, SVH: gl.constexpr, SVN: gl.constexpr,
        SOB: gl.constexpr, SOH: gl.constexpr, SOM: gl.constexpr,
        SCALE: gl.constexpr, CAUSAL: gl.constexpr, BAND_HI: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        BH: gl.constexpr, PROGRAMS: gl.constexpr, CHUNK: gl.constexpr):
    """Query blocks of BLOCK_M rows of one (batch, head), split FlashAttention-3's way: a
    loader warp issues every TMA copy, and two warpgroups of 4 warps (the kernel's
    ``num_warps`` and one worker) each own half of the rows. Each consumer releases a K or
    V slot with its own mbarrier arrival, so the two drift apart and one's softmax runs
    while the other's products hold the tensor cores. SKN is the stride of K's rows, or of
    k^T's (along D) where KT. Launch with ``num_warps=4`` and ``maxnreg=MAXNREG``: 12
    warps' registers at launch, which the loader gives back to the consumers
    (CONSUMER_REGS each).

    PROGRAMS = 0: one program per query block, grid (blocks, BH), descriptors made per
    program for its head. PROGRAMS > 0: that many persistent programs walk the BH x blocks
    work items (``_item``), with descriptors made once over the operands seen as
    [BH x rows, D]: the caller makes sure heads and rows collapse so (their strides
    compose) and that M and N are multiples of BLOCK_M and BLOCK_N, so that no tile
    crosses into the next head. q is double-buffered there, and the output has its own
    staging tiles, so one item's epilogue overlaps the next item's loads. GROUP > 1:
    grouped-query attention, head h reading k's and v's stored head h // GROUP (their
    head strides, and in the persistent form their boxes, count the stored heads)."""
    HALF: gl.constexpr = BLOCK_M // 2
    QBUF: gl.constexpr = 2 if PROGRAMS else 1
    MB: gl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, DP], dtype)
    kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DP], dtype)
    k_box: gl.constexpr = [DP, BLOCK_N] if KT else [BLOCK_N, DP]
    k_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(k_box, dtype)
    k_rows: gl.constexpr = D if KT else N  # rows of a head's K box
    k_cols: gl.constexpr = N if KT else D
    if PROGRAMS:
        work = (gl.program_id(0), BH * MB, PROGRAMS, 0, 0)
        q_desc = tma.make_tensor_descriptor(q_ptr + OQ, shape=[BH * M, D], strides=[SQM, 1],
                                            block_shape=[HALF, DP], layout=q_smem_layout)
        k_desc = tma.make_tensor_descriptor(k_ptr + OK, shape=[BH // GROUP * k_rows, k_cols], strides=[SKN, 1],
                                            block_shape=k_box, layout=k_smem_layout)
        v_desc = tma.make_tensor_descriptor(v_ptr + OV, shape=[BH // GROUP * N, D], strides=[SVN, 1],
                                            block_shape=[BLOCK_N, DP], layout=kv_smem_layout)
        o_desc = tma.make_tensor_descriptor(o_ptr + OO, shape=[BH * M, D], strides=[SOM, 1],
                                            block_shape=[HALF, DP], layout=q_smem_layout)
    else:
        pid = gl.program_id(0)
        if CAUSAL:  # the longest rows first: the last wave is made of short programs
            pid = gl.num_programs(0) - 1 - pid
        bh = gl.program_id(1)
        b = bh // H
        h = bh % H
        work = (0, 1, 1, pid, bh)
        q_desc = tma.make_tensor_descriptor(q_ptr + OQ + b * SQB + h * SQH, shape=[M, D], strides=[SQM, 1],
                                            block_shape=[HALF, DP], layout=q_smem_layout)
        k_desc = tma.make_tensor_descriptor(k_ptr + OK + b * SKB + (h // GROUP) * SKH, shape=[k_rows, k_cols],
                                            strides=[SKN, 1], block_shape=k_box, layout=k_smem_layout)
        v_desc = tma.make_tensor_descriptor(v_ptr + OV + b * SVB + (h // GROUP) * SVH, shape=[N, D], strides=[SVN, 1],
                                            block_shape=[BLOCK_N, DP], layout=kv_smem_layout)
        o_desc = tma.make_tensor_descriptor(o_ptr + OO + b * SOB + h * SOH, shape=[M, D], strides=[SOM, 1],
                                            block_shape=[HALF, DP], layout=q_smem_layout)

    q_smem = gl.allocate_shared_memory(dtype, [2 * QBUF, HALF, DP], q_smem_layout)
    if PROGRAMS:
        o_smem = gl.allocate_shared_memory(dtype, [2, HALF, DP], q_smem_layout)
    else:  # one item: each half of q stages its own output once its last product is done
        o_smem = q_smem
    k_ring: gl.constexpr = [STAGES, DP, BLOCK_N] if KT else [STAGES, BLOCK_N, DP]
    k_smem = gl.allocate_shared_memory(dtype, k_ring, k_smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DP], kv_smem_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(QBUF):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty)

    gl.warp_specialize([
        (_consumer, (o_desc, q_smem, o_smem, k_smem, v_smem, bars, work, 0, M, N, DP, KT, SCALE, CAUSAL, BAND_HI,
                     BLOCK_M, BLOCK_N, STAGES, QBUF, PROGRAMS, MB, BH, CHUNK)),
        (_consumer, (o_desc, q_smem, o_smem, k_smem, v_smem, bars, work, 1, M, N, DP, KT, SCALE, CAUSAL, BAND_HI,
                     BLOCK_M, BLOCK_N, STAGES, QBUF, PROGRAMS, MB, BH, CHUNK)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, work, M, N, D, KT, GROUP, CAUSAL, BAND_HI,
                   BLOCK_M, BLOCK_N, STAGES, QBUF, PROGRAMS, MB, BH, CHUNK)),
    ], [4, 1], [CONSUMER_REGS, 24])
