"""Tile shapes for matmul kernels, ranked by a model of their work on the SMs.

A program computes one ``BLOCK_M x BLOCK_N`` output tile, walking K in ``BLOCK_K``
steps. Per step it stages ``(BLOCK_M + dots * BLOCK_N) * BLOCK_K`` operand elements in
shared memory (from L2 mostly, thanks to the grouped tile order) and issues
``2 * BLOCK_M * BLOCK_N * BLOCK_K`` flops per product on the tensor cores. A step takes
the longer of its products and its loads. The loads arrive at the SM's operand feed, or
slower where too few are in flight to cover their latency (Little's law: ``num_stages -
1`` stages per program, of every program the SM holds at once). Products that are only
added up (``summed``) share one accumulator and walk K one after the other: a step then
stages one product's operands. The device's tensor-core figure holds with every SM busy
at the power cap; SMs with fewer busy neighbours clock higher (MAX_BOOST).

Each tile also costs its epilogue (the accumulator converted and laid out for the store;
a tile read after the loop, a residual, waits for its latency), its first loads and its
output's store. How much of that the SM hides depends on the form:

* one program per tile, one at a time on an SM: nothing hidden; the busiest SM walks
  ``ceil(tiles / SMs)`` tiles, each after the other; a store from registers is slower
  than the TMA form's bulk store (POINTER_STORE).
* one program per tile, two or more at once on an SM (their staged operands and
  accumulators fit): one program's loads, epilogue and store overlap the others' loops,
  but programs sharing the tensor cores run their loops slower (CONTENTION).
* the TMA form (codegen/tma.py: Hopper or later, one product, operands plain reads in
  layouts a descriptor describes): a persistent loop over tiles, one program per SM,
  ``PROGRAMS`` of them; the next tile's loads are fetched while this tile's epilogue runs
  and its store drains during the next loop, so only the first loads and the last store
  are exposed; the epilogue is not hidden, each tile's turn of the loop costs
  TMA_TILE_US, and each program makes its descriptors first (TMA_SETUP_US). Its output
  tile is staged in shared memory for the TMA store, which counts against the stages.

The model only ranks (the GPU autotuner times the first few and keeps the fastest; with
autotuning off its first choice runs), and the extraction's cost model and split-K read
its time of a matmul kernel. Its figures were fitted to benchmarks/matmul_tile_sweep.py:
every candidate timed on an H100 for the products of GPT-2 and BERT training (hidden
768, MLP 3072, with their epilogues) and three Llama-sized products
(benchmarks/results/matmul-tile-sweep_*.json), checked against the attention scores'
measurements below and the earlier square products of matmul_*.json. The contrasts that
set them:

* LOAD_LATENCY_US, OPERAND_FEED: 128 x 128 x 64 tiles in the TMA form (one program per
  SM) with 3, 4 and 5 stages: 1075, 796, 809 us on [16384 x 4096] @ [4096 x 4096]; 91.7,
  77.3, 74.0 on GPT-2's [8192 x 3072] @ [3072 x 768] + residual. Two 128 x 128 programs
  on one SM stream ~96 KB/us of operands, more than the device's L2 figure spread over
  the SMs gives; 64 x 128 tiles, whose loads outweigh their products, lose on every
  product measured.
* CONTENTION: the same tiles one program per tile, 3 stages (two programs an SM) against
  4 (one): 941 against 883 us, 91.7 against 81.8 (long loops); 91.8 against 107.3 on
  gelu(x @ W + b) at K = 768, where the overlapped epilogues win.
* TMA_SETUP_US: where every SM gets at most one tile, the TMA form gains nothing and is
  slower: [2304 x 8192] @ [8192 x 768], 108 tiles, 52.9 us against 48.9; 1024^3, 14.0
  against 10.5.
* TMA_TILE_US, POINTER_STORE: attention scores 256 x [2048 x 128] @ [128 x 2048], almost
  all store: TMA form 128 x 256 tiles 919 us, 128 x 128 1086, one program per tile 1228.
* MAX_BOOST: [3072 x 8192] @ [8192 x 768] in 72 tiles of 128 x 256 ran at 6.5 TFLOP/s an
  SM, Llama's products on every SM at 5.85 (1.98 GHz boost against ~1.6 at the cap).
* PRODUCTS_SIDE_BY_SIDE: SwiGLU's silu(x @ W1) * (x @ W3) at [8192 x 4096] @ [4096 x
  11008] as one kernel of two products (one program per tile, 128 x 128, the only form it
  takes) ran 2356 us, 56 a tile, where the two products apart in the TMA form ran 967 and
  1046 (46 and 50 a 128 x 256 tile of the same flops; an earlier run on another H100).
  Timed beside eager's two cuBLAS products and the pointwise kernel, the single kernel
  took 1.15x eager's time, the two 0.96x. Without this figure the model ties the two
  plans at Llama's 16384 tokens and extraction may fuse them.
* EPILOGUE_US_PER_ELEMENT is what a plain epilogue costs. The schedule does not count an
  epilogue's arithmetic: a tanh-gelu costs ~3 us more per 128 x 256 tile (GPT-2's
  gelu(x @ W + b) at K = 768, 768 tiles in 6 rounds of the TMA form: 85.8 us, 14.3 a
  round; its q/k/v product with a bias alone, 576 tiles in 5 rounds: 57.7, 11.5 a round),
  which favours two programs an SM; the model does not see it.

An operand computed from several reads (int4 weights unpacked and scaled as they load, a
concatenation fused into the product, each element selected from one of its parts) goes
through registers: its loads are not pipelined, so each K step waits for them, unless
other programs on the SM take their turns meanwhile, and computes every element of the
tile, once per output tile that needs it. Such kernels take one stage (GATHERED_TILES) and
are split along K more readily (codegen/splitk.py), so that an SM holds several programs.
Measured on an H100 (benchmarks/results/matmul-int4-sweep_*.json), int4 weights [4096 x
4096] at 16 tokens: 38 us in one program per SM, 16 us with K in 8 chunks and four
programs an SM; GPT-2's backward with the q/k/v gradients concatenated, [2304 x 8192] @
[8192 x 768]: 143 us gathered, about 45 for cuBLAS over the stored concatenation.

Batched products take the TMA form only where it pays, as measured on an H100: where the
output tile's store takes longer than its K loop (attention scores, K = 128: 919 us
against 1228 for one program per tile), and where the epilogue reads no M x N tile
through pointers (the same scores with a boolean mask loaded: 1758 us against 1450; the
load is not pipelined and, one program per SM, nothing hides it). At K = 2048 (P @ V) the
TMA form was 1-5% slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..rewrite.cost import Device, device_model
from ..schema import ops
from . import tma

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the shapes Triton's Hopper and Ampere
# matmuls are known to run well with, large to small; where the model ties two, the one
# listed first wins. 128 x 256 with 4 stages before 3: one program an SM either way, the
# deeper pipeline measured as fast or faster on every product of the sweep. 128 x 128 in
# three depths: 5 stages for the TMA form (one program per SM), 3 so that an SM holds two
# programs. 128 x 128 x 32 is gone: never within 5% of the best on the sweep.
TILES = [
    (128, 256, 64, 8, 4),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 8, 5),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 3),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3),
    (64, 64, 64, 4, 4),
    (64, 64, 32, 4, 4),
    (32, 64, 64, 4, 4),
    (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 3),
]
# Tiles for a matmul whose operand is computed from several reads in registers (int4 weights
# unpacked and scaled, a concatenation's parts): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps), one
# stage each. Those loads are not pipelined, so stages only take shared memory that would
# hold other programs, whose turns cover each step's wait. The best of a sweep on an H100
# (benchmarks/results/matmul-int4-sweep_*.json: int4 weights [4096 x 4096], 16 and 128 rows,
# K split 1 to 16 ways), large to small.
GATHERED_TILES = [
    (128, 128, 64, 8),
    (128, 64, 128, 4),
    (128, 32, 128, 8),
    (64, 128, 128, 8),
    (64, 64, 256, 4),
    (16, 256, 64, 4),
    (16, 128, 256, 4),
    (16, 128, 64, 2),
    (16, 64, 256, 2),
    (16, 32, 256, 2),
    (16, 32, 128, 2),
]
GROUP_M = 8
MIN_BLOCK = 16  # tl.dot's smallest tile side
SHARED_MEMORY = 220 * 1024  # bytes a program may stage (H100/H200: 227 KB per SM)
MAX_ACCUMULATOR = 128 * 256  # float32 accumulator elements per program, over all products
REGISTER_ACCUMULATORS = 2 * MAX_ACCUMULATOR  # what an SM's registers hold, over its programs
# float32 accumulator registers a thread may hold: SwiGLU's two 128 x 128 products on 4 warps
# (256 a thread) spilled and ran 4.1x slower than on 8 (H100, [8192 x 4096] @ [4096 x 11008]:
# 9644 us against 2356)
MAX_THREAD_ACCUMULATORS = 128
STORE_ITEMSIZE = 4  # bytes per output element the TMA form's store buffer is budgeted for (the widest)
MIN_TMA_STAGES = 3  # 2 stages in the TMA form ran 1.4-2x slower than 3 on every product of the sweep

# The model's figures (module docstring: the measurements that set them)
STEP_OVERHEAD_US = 0.035  # a K step's own cost: its barrier, the issue of its loads and products
LOAD_LATENCY_US = 1.35  # an operand load's latency under load: the bytes in flight over it bound the feed
OPERAND_FEED = 1.4  # operand bytes an SM stages per us, over the device's L2 bandwidth / SMs
FILL_US = 0.35  # a program's first loads, before its first product
TILE_OVERHEAD_US = 0.12  # a program's start and end, one program per tile
EPILOGUE_US_PER_ELEMENT = 1e-5  # per output element: the accumulator converted, laid out for the store
READ_LATENCY_US = 0.85  # a tile read after the K loop (a residual): not pipelined
POINTER_STORE = 1.45  # a store from registers (one program per tile) against the TMA form's bulk store
CONTENTION = 1.2  # programs sharing an SM's tensor cores: each K loop this much longer
# A K step of a computed operand (GATHERED_TILES' sweep, fitted to 28 of its configurations
# within 20% rms): a program alone waits for the operand's loads, then computes each element;
# programs sharing an SM overlap each other's waits, down to the SM's rate of computing them.
GATHER_WAIT_US = 0.4  # a step's wait for the computed operand's loads
GATHER_US_PER_ELEMENT_ALONE = 1.5e-4  # an element's indices, loads and arithmetic, for a program alone
GATHER_US_PER_ELEMENT = 1.2e-4  # the same at the SM's rate, programs sharing it
TMA_SETUP_US = 3.0  # the TMA form: a program's descriptors, made on the device before its first tile
TMA_TILE_US = 0.3  # the TMA form: each tile's turn of the persistent loop (indices, the store's wait)
PRODUCTS_SIDE_BY_SIDE = 1.15  # a K step of two products sharing A (SwiGLU), against one of twice the tile
MAX_BOOST = 1.24  # an SM's clock alone against all SMs at the power cap: 1.98 GHz against ~1.6
# Tensor-core rate of a tile under 256 columns against one of 256: each product instruction
# (m64nNk16) reads its A tile from shared memory again, for half the work at N = 128. An
# H100, [16384 x 4096] @ [4096 x 4096] fp16, TMA form: 128 x 256 tiles 734 us, 128 x 128
# 796-810, 256 x 128 877; Llama's weight gradient [11008 x 16384] @ [16384 x 4096]: 128 x
# 256 about 1990 us, 128 x 128 (5 stages) about 2500 (models benchmark, two runs).
NARROW_MMA_RATE = 0.92


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
    table = [(*tile, 1) for tile in GATHERED_TILES] if sched.gathered_sides else TILES
    out = []
    for bm, bn, bk, warps, stages in table:
        if item == 4:
            bk = max(MIN_BLOCK, bk // 2)  # the same staging bytes at twice the element size
        cfg = {"BLOCK_M": _clamp(bm, sched.m), "BLOCK_N": _clamp(bn, sched.n), "BLOCK_K": _clamp(bk, sched.k),
               "GROUP_M": GROUP_M, "num_warps": warps, "num_stages": stages}
        accumulators = cfg["BLOCK_M"] * cfg["BLOCK_N"] * _accumulators(sched)
        if accumulators > MAX_ACCUMULATOR or accumulators > MAX_THREAD_ACCUMULATORS * 32 * warps:
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
            if fit >= MIN_TMA_STAGES and persistent not in out:
                out.append(persistent)
    return out


def _tma_pays(sched, cfg: dict, device: Device) -> bool:
    """Whether the TMA form of this tile is worth offering: always for a single matrix; for
    a batch, only where the tile's store outlasts its K loop and no M x N tile is read after
    the loop (module docstring: measured)."""
    if not sched.batch:
        return True
    tile = _tile_us(sched, cfg, device, together=1, active=programs(sched, cfg), streaming=True)
    return tile.store > tile.loop and not sched.tile_reads


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


def output_tiles(sched, cfg: dict) -> int:
    """Output tiles, of every matrix of the batch."""
    return math.ceil(sched.m / cfg["BLOCK_M"]) * math.ceil(sched.n / cfg["BLOCK_N"]) * math.prod(sched.batch)


def programs(sched, cfg: dict) -> int:
    """Persistent programs: one per SM, or one per tile where there are fewer tiles."""
    return max(1, min(output_tiles(sched, cfg), tma.sm_count()))


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


@dataclass(frozen=True)
class TileTime:
    """One tile's parts, in microseconds on one SM."""
    loop: float  # the K loop
    epilogue: float  # after the loop: the epilogue's work and the tile reads it waits for
    store: float  # the output tile's bytes at the SM's share of the memory bandwidth


def _tile_us(sched, cfg: dict, device: Device, together: int, active: int,
             streaming: bool = False) -> TileTime:
    """One tile on an SM that runs ``together`` programs at once (their loads in flight
    cover each other's latency; each program's step overhead hides behind the others'),
    ``active`` SMs having work (the fewer, the higher their clock). ``streaming``: the loop
    at the full operand feed, its loads' latency covered (what the TMA form's test for
    batches compares the store with: short loops)."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    item = ops.itemsize(sched.dot_dtype)
    steps = math.ceil(sched.k / bk)
    flops = 2 * bm * bn * bk * sched.dots
    moved = _operand_rows(sched, cfg) * bk * item
    per_sm_flops = device.tensor_flops_per_us(sched.dot_dtype) / device.sms * _boost(active, device)
    if bn < 256:
        per_sm_flops *= NARROW_MMA_RATE
    per_sm_feed = device.bandwidth_bytes_per_us * device.l2_speedup * OPERAND_FEED / device.sms
    per_sm_memory = device.bandwidth_bytes_per_us / device.sms
    if sched.summed:  # a K loop per product, each step one product's
        flops, steps = flops // sched.dots, steps * sched.dots
    if sched.gathered_sides:
        # Computed element by element in registers, its loads not pipelined (the constants'
        # comment); what is staged is the other operand
        rows = (bm, bn)  # of A's tile and B's, each BLOCK_K long
        computed = bk * sum(rows[side] for side in sched.gathered_sides)
        staged = bk * sum(rows[side] for side in (0, 1) if side not in sched.gathered_sides) * item
        wait = max((GATHER_WAIT_US + computed * GATHER_US_PER_ELEMENT_ALONE) / together,
                   computed * GATHER_US_PER_ELEMENT)
        step = flops / per_sm_flops + staged / per_sm_feed + wait
    else:
        # Little's law: the loads in flight over their latency bound the rate operands arrive at
        in_flight = max(1, cfg["num_stages"] - 1) * together * moved
        feed = per_sm_feed if streaming else min(per_sm_feed, in_flight / LOAD_LATENCY_US)
        step = max(flops / per_sm_flops, moved / feed) + STEP_OVERHEAD_US / together
        if sched.dots > 1 and not sched.summed:
            step *= PRODUCTS_SIDE_BY_SIDE
    elements = bm * bn
    reads = sched.tile_reads * (READ_LATENCY_US + elements * item / per_sm_memory)
    return TileTime(loop=steps * step, epilogue=elements * EPILOGUE_US_PER_ELEMENT + reads,
                    store=elements * item / per_sm_memory)


def _boost(active: int, device: Device) -> float:
    """How much faster than the device's figure an SM computes when ``active`` SMs have work:
    the figure is all SMs' at the power cap; fewer draw less power and clock higher (an
    H100: [3072 x 8192] @ [8192 x 768] on 72 SMs ran at 6.5 TFLOP/s an SM, a Llama product
    on all 132 at 5.85)."""
    return 1 + (MAX_BOOST - 1) * max(0.0, 1 - active / device.sms)


def modelled_time_us(sched, cfg: dict, device: Device | None = None) -> float:
    """The matmul's time with this configuration: the busiest SM's tiles (module docstring)."""
    device = device or device_model()
    tiles = output_tiles(sched, cfg)
    if "PROGRAMS" in cfg:
        # The next tile's loads overlap this one's epilogue and its store drains during the
        # next loop: of them, only the first loads and the last store are exposed
        tile = _tile_us(sched, cfg, device, together=1, active=cfg["PROGRAMS"])
        rounds = math.ceil(tiles / cfg["PROGRAMS"])
        per_tile = max(tile.loop, tile.store) + tile.epilogue + TMA_TILE_US
        return TMA_SETUP_US + FILL_US + rounds * per_tile + tile.store
    per_sm = math.ceil(tiles / device.sms)
    together = min(resident(sched, cfg), per_sm)
    tile = _tile_us(sched, cfg, device, together, active=min(tiles, device.sms))
    store = tile.store * POINTER_STORE
    fixed = TILE_OVERHEAD_US + FILL_US + tile.epilogue
    if together > 1:  # one program's loads, epilogue and store overlap the others' loops, which share the SM
        # (a computed operand's loop counts its sharing already)
        contention = 1 if sched.gathered_sides else CONTENTION
        return per_sm * (max(tile.loop * contention, store) + fixed / together)
    return per_sm * (tile.loop + store + fixed)


def ranked(sched, device: Device | None = None) -> list[dict]:
    """Candidates, fastest modelled first (ties keep the table's order)."""
    device = device or device_model()
    return sorted(candidates(sched, device=device), key=lambda cfg: modelled_time_us(sched, cfg, device))
