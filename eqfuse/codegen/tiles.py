"""Tile shapes for matmul kernels, ranked by a model of one program's work.

A program computes one ``BLOCK_M x BLOCK_N`` output tile, walking K in ``BLOCK_K``
steps. Per step it moves ``(BLOCK_M + dots * BLOCK_N) * BLOCK_K`` operand elements into
shared memory (from L2 mostly, thanks to the grouped tile order) and issues
``2 * BLOCK_M * BLOCK_N * BLOCK_K`` flops per product on the tensor cores; whichever takes
longer sets the step's time. Products that are only added up (``summed``) share one
accumulator and walk K one after the other: a step then stages one product's operands.
Programs run in waves of one per SM, so a grid that leaves
the last wave half empty pays for a full one. The model only ranks: the GPU autotuner
times the first few and keeps the fastest.

Where the matmul can take the TMA form (codegen/tma.py: Hopper or later, one product,
operands plain reads in layouts a descriptor describes), each tile shape is offered in
both forms. The
TMA form is a persistent loop over tiles: the next tile's operands are fetched while this
tile's epilogue runs, which the model counts as a smaller cost per tile; its output tile
is staged in shared memory for the TMA store, which counts against the stages.

An operand gathered from several reads (a concatenation fused into the product, each
element selected from one of its parts) goes through registers: its loads are not
pipelined, so a step takes the loads' time plus the products'. Measured on an H100
(GPT-2's backward, the q/k/v gradients concatenated): [2304 x 8192] @ [8192 x 768] 143 us
gathered, about 45 for cuBLAS over the stored concatenation.

Batched products take the TMA form only where it pays, as measured on an H100: where the
output tile's store takes longer than its K loop (attention scores, K = 128: 919 us
against 1228 for one program per tile), and where the epilogue reads no M x N tile
through pointers (the same scores with a boolean mask loaded: 1758 us against 1450; the
load is not pipelined and, one program per SM, nothing hides it). At K = 2048 (P @ V) the
TMA form was 1-5% slower.
"""

from __future__ import annotations

import math

from ..rewrite.cost import Device, device_model
from ..schema import ops
from . import tma

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the shapes Triton's Hopper and Ampere
# matmuls are known to run well with, large to small.
TILES = [
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 128, 32, 4, 4),
    (64, 64, 64, 4, 4),
    (64, 64, 32, 4, 4),
    (32, 64, 64, 4, 4),
    (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 3),
]
GROUP_M = 8
MIN_BLOCK = 16  # tl.dot's smallest tile side
SHARED_MEMORY = 220 * 1024  # bytes a program may stage (H100/H200: 227 KB per SM)
MAX_ACCUMULATOR = 128 * 256  # float32 accumulator elements per program, over all products
REGISTER_ACCUMULATORS = 2 * MAX_ACCUMULATOR  # what an SM's registers hold, over its programs
STEP_OVERHEAD_US = 0.02
TILE_OVERHEAD_US = 0.3
PERSISTENT_TILE_OVERHEAD_US = 0.1  # the TMA form: the next tile's loads overlap this one's epilogue
STORE_ITEMSIZE = 4  # bytes per output element the TMA form's store buffer is budgeted for (the widest)


def _clamp(block: int, size: int) -> int:
    return max(MIN_BLOCK, min(block, 1 << max(0, (int(size) - 1).bit_length())))


def candidates(sched, with_tma: bool | None = None, device: Device | None = None) -> list[dict]:
    """Every tile configuration this matmul can run with, clamped to its sizes: one
    program per tile, and, where the matmul and the device take it (``with_tma``: by
    default, where tma.device_supports()), the same tile in the TMA form."""
    if with_tma is None:
        # Not for two products in one loop (the SwiGLU MLP's first kernel): on an H100 the
        # TMA form ran it in 1457 us against 1099 for one program per tile
        with_tma = sched.tma and sched.dots == 1 and tma.device_supports()
    device = device or device_model()
    item = ops.itemsize(sched.dot_dtype)
    out = []
    for bm, bn, bk, warps, stages in TILES:
        if item == 4:
            bk = max(MIN_BLOCK, bk // 2)  # the same staging bytes at twice the element size
        cfg = {"BLOCK_M": _clamp(bm, sched.m), "BLOCK_N": _clamp(bn, sched.n), "BLOCK_K": _clamp(bk, sched.k),
               "GROUP_M": GROUP_M, "num_warps": warps, "num_stages": stages}
        if cfg["BLOCK_M"] * cfg["BLOCK_N"] * _accumulators(sched) > MAX_ACCUMULATOR:
            continue
        staged = _operand_rows(sched, cfg) * cfg["BLOCK_K"] * item * stages
        if staged > SHARED_MEMORY:
            continue
        if cfg not in out:
            out.append(cfg)
        if with_tma and _tma_pays(sched, cfg, device):
            # The output half-tile staged for the TMA store takes shared memory too: a stage
            # fewer where it does not fit beside them
            store = cfg["BLOCK_M"] * cfg["BLOCK_N"] // 2 * STORE_ITEMSIZE
            per_stage = staged // stages
            fit = min(stages, (SHARED_MEMORY - store) // per_stage)
            persistent = {**cfg, "num_stages": fit, "PROGRAMS": programs(sched, cfg)}
            if fit >= 2 and persistent not in out:
                out.append(persistent)
    return out


def _tma_pays(sched, cfg: dict, device: Device) -> bool:
    """Whether the TMA form of this tile is worth offering: always for a single matrix; for
    a batch, only where the tile's store outlasts its K loop and no M x N tile is read after
    the loop (module docstring: measured)."""
    if not sched.batch:
        return True
    loop, store = _tile_us(sched, cfg, device)
    return store > loop and not sched.tile_reads


def _accumulators(sched) -> int:
    return 1 if sched.summed else sched.dots


def _operand_rows(sched, cfg: dict) -> int:
    """Operand tile rows one K step stages: A's and B's of the step's product, or, for
    products computed side by side, one A (they share it: SwiGLU's x) and each B."""
    return cfg["BLOCK_M"] + _accumulators(sched) * cfg["BLOCK_N"]


def resident(sched, cfg: dict) -> int:
    """Programs an SM holds at once, as far as their staged operands and accumulators let it."""
    staged = _operand_rows(sched, cfg) * cfg["BLOCK_K"] * ops.itemsize(sched.dot_dtype) * cfg["num_stages"]
    accumulators = cfg["BLOCK_M"] * cfg["BLOCK_N"] * _accumulators(sched)
    return max(1, min(SHARED_MEMORY // staged, REGISTER_ACCUMULATORS // accumulators))


def programs(sched, cfg: dict) -> int:
    """Persistent programs: one per SM, or one per tile (of every matrix of the batch) where
    there are fewer tiles."""
    tiles = math.ceil(sched.m / cfg["BLOCK_M"]) * math.ceil(sched.n / cfg["BLOCK_N"]) * math.prod(sched.batch)
    return max(1, min(tiles, tma.sm_count()))


CONFIG_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}


def well_formed(cfg: dict, keys: set, blocks: tuple) -> bool:
    """A tl.dot kernel's configuration: exactly ``keys``, integers, the ``blocks`` powers of
    two no smaller than tl.dot takes, a warp count Triton launches, at least one stage."""
    if set(cfg) != keys or not all(isinstance(v, int) for v in cfg.values()):
        return False
    pow2 = all(cfg[k] >= MIN_BLOCK and cfg[k] & (cfg[k] - 1) == 0 for k in blocks)
    return pow2 and cfg["num_warps"] in (1, 2, 4, 8, 16) and cfg["num_stages"] >= 1


def runnable(cfg: dict, sched=None) -> bool:
    """Whether a configuration (from a cache, or a user) is one a matmul kernel can run
    with: one program per tile, or, for a matmul that can take it, the TMA form."""
    if "PROGRAMS" in cfg:
        if sched is None or not sched.tma or not isinstance(cfg["PROGRAMS"], int) or cfg["PROGRAMS"] < 1:
            return False
        cfg = {k: v for k, v in cfg.items() if k != "PROGRAMS"}
    return well_formed(cfg, CONFIG_KEYS, ("BLOCK_M", "BLOCK_N", "BLOCK_K")) and cfg["GROUP_M"] >= 1


def _tile_us(sched, cfg: dict, device: Device) -> tuple:
    """(K loop, output store) of one tile in microseconds, on one SM."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    steps = math.ceil(sched.k / bk)
    flops = 2 * bm * bn * bk * sched.dots
    moved = _operand_rows(sched, cfg) * bk * ops.itemsize(sched.dot_dtype)
    per_sm_flops = device.tensor_flops_per_us(sched.dot_dtype) / device.sms
    per_sm_bytes = device.bandwidth_bytes_per_us * device.l2_speedup / device.sms
    if sched.summed:  # a K loop per product, each step one product's
        flops, steps = flops // sched.dots, steps * sched.dots
    if sched.gathered:  # selected element by element in registers: the loads are not pipelined
        step = flops / per_sm_flops + moved / per_sm_bytes + STEP_OVERHEAD_US
    else:
        step = max(flops / per_sm_flops, moved / per_sm_bytes) + STEP_OVERHEAD_US
    store = bm * bn * ops.itemsize(sched.dot_dtype) / (device.bandwidth_bytes_per_us / device.sms)
    return steps * step, store


def modelled_time_us(sched, cfg: dict, device: Device | None = None) -> float:
    device = device or device_model()
    tiles = math.ceil(sched.m / cfg["BLOCK_M"]) * math.ceil(sched.n / cfg["BLOCK_N"]) * math.prod(sched.batch)
    waves = math.ceil(tiles / cfg.get("PROGRAMS", device.sms))
    loop, store = _tile_us(sched, cfg, device)
    per_tile = PERSISTENT_TILE_OVERHEAD_US if "PROGRAMS" in cfg else TILE_OVERHEAD_US
    # The output tile's store: hidden behind another program's loads where the SM holds
    # two or more (or the persistent form fetches the next tile meanwhile), else after the
    # loop. With a short K (q @ k^T at head dim 128) the store is most of the work; a
    # tile's fixed cost is paid either way, so fewer, larger tiles win there (measured on
    # an H100, TMA form: 128 x 256 tiles 919 us, 128 x 128 1086).
    overlapped = "PROGRAMS" in cfg or resident(sched, cfg) > 1
    return waves * ((max(loop, store) if overlapped else loop + store) + per_tile)


def ranked(sched, device: Device | None = None) -> list[dict]:
    """Candidates, fastest modelled first (ties keep the table's order)."""
    device = device or device_model()
    return sorted(candidates(sched, device=device), key=lambda cfg: modelled_time_us(sched, cfg, device))
