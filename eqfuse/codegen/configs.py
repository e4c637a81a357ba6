"""A kernel's tile configuration: the default for its schedule, the candidates the
autotuner times, and whether a configuration fits the schedule."""

from __future__ import annotations

from ..rewrite.cost import device_model
from . import matmul_templates, pointwise, tiles
from .schedules import Schedule, next_pow2

LOOP_BLOCK = 2048  # a looped reduction's chunk of the reduced axis
COLUMN_TILE = 2048  # elements of a column reduction's tile: BLOCK_R rows x BLOCK_C of the reduced axis
LAUNCH_OPTIONS = ("num_warps", "num_stages")  # config keys passed at launch, not as constexprs
MATMUL_FINALISTS = 6  # tile configurations the GPU autotuner times, best modelled first
MATMUL_FINALISTS_TMA = 8  # the same where each tile shape comes in two forms


def default_config(sched: Schedule) -> dict:
    """Block sizes and warps for the shapes this kernel was compiled for."""
    if sched.kind == "matmul":
        return tiles.ranked(sched)[0]
    if sched.kind == "attention":
        from . import attention
        return attention.candidates(sched)[0]
    if sched.kind == "pointwise" and sched.inner:
        return pointwise.default_config(sched.numel, sched.inner)
    if sched.kind == "pointwise":
        xblock = min(1024, max(16, next_pow2(sched.numel)))
        return {"XBLOCK": xblock, "num_warps": max(1, min(4, xblock // 256))}
    if sched.columns:
        return column_config(sched.rows)
    if sched.persistent:
        block_c = max(1, next_pow2(sched.cols))
        block_r = max(1, min(next_pow2(sched.rows), 2048 // block_c))
    else:
        block_c, block_r = LOOP_BLOCK, 1
    warps = max(1, min(16, block_r * block_c // 512))
    return {"BLOCK_R": block_r, "BLOCK_C": block_c, "num_warps": warps}


def column_config(rows: int, block_r: int | None = None, warps: int = 4) -> dict:
    """A column reduction's tile: rows wide enough for whole 32-byte sectors (16 of 2-byte
    elements at least) and, of 64, 32 and 16, the widest that still gives every SM a program."""
    if block_r is None:
        sms = device_model().sms
        block_r = next((b for b in (64, 32) if rows // b >= sms), 16)
    block_r = min(block_r, max(1, next_pow2(rows)))
    return {"BLOCK_R": block_r, "BLOCK_C": COLUMN_TILE // block_r, "num_warps": warps}


def fits(sched: Schedule, cfg: dict) -> bool:
    """Whether a configuration is one this schedule can run with (a tuned config read back
    from a cache is checked, never trusted)."""
    if sched.kind == "matmul" and "TEMPLATE" in cfg:
        return matmul_templates.runnable(cfg, sched)
    if sched.kind == "matmul":
        return tiles.runnable(cfg, sched)
    if sched.kind == "attention":
        from . import attention
        return attention.runnable(cfg)
    if sched.kind == "pointwise":
        return set(cfg) == ({"YBLOCK", "XBLOCK", "num_warps"} if sched.inner else {"XBLOCK", "num_warps"})
    if set(cfg) != {"BLOCK_R", "BLOCK_C", "num_warps"}:
        return False
    if sched.persistent:
        return cfg["BLOCK_C"] >= sched.cols
    return cfg["BLOCK_C"] == LOOP_BLOCK or cfg["BLOCK_C"] < sched.cols


def tuning_candidates(sched: Schedule) -> list[dict]:
    """Alternatives the GPU autotuner times (the default first)."""
    if sched.kind == "matmul":
        ranked = tiles.ranked(sched)
        both = any("PROGRAMS" in c for c in ranked)
        return ranked[:MATMUL_FINALISTS_TMA if both else MATMUL_FINALISTS] + matmul_templates.candidates(sched)
    if sched.kind == "attention":
        from . import attention
        return attention.candidates(sched)
    if sched.kind == "pointwise" and sched.inner:
        return pointwise.tuning_candidates(sched.numel, sched.inner)
    base = default_config(sched)
    cands = [base]
    if sched.kind == "reduction" and sched.columns:
        cands += [column_config(sched.rows, b, w) for b in (16, 32, 64) for w in (4, 8)]
    elif sched.kind == "pointwise":
        for xb, w in ((1024, 4), (2048, 8), (4096, 8), (512, 4)):
            if xb <= max(16, next_pow2(sched.numel)):
                cands.append({"XBLOCK": xb, "num_warps": w})
    else:
        for br in (1, 2, 4, 8):
            for w in (4, 8, 16):
                if br <= next_pow2(sched.rows) and br * base["BLOCK_C"] <= 32768:
                    cands.append({"BLOCK_R": br, "BLOCK_C": base["BLOCK_C"], "num_warps": w})
    unique = []
    for c in cands:
        if c not in unique:
            unique.append(c)
    return unique


def fallback_candidates(sched: Schedule) -> list[dict]:
    """Every configuration, the model's first choice first: what an untimed build walks
    until one compiles on the device."""
    if sched.kind == "matmul":
        return matmul_templates.first_choice(sched) + tiles.ranked(sched)  # a Hopper template where it won throughout
    return tuning_candidates(sched)


def unaligned_config(sched: Schedule, cfg: dict) -> dict:
    """The configuration of the form a TMA kernel's launcher runs where an address is not
    16-byte aligned: the same tiles one program per tile, or for the flash template the
    portable kernel's first choice (also what a kernel the template cannot be generated
    for runs)."""
    if cfg.get("FLASH"):
        from . import attention
        return next(c for c in attention.candidates(sched) if "FLASH" not in c)
    if cfg.get("TEMPLATE"):
        return matmul_templates.pointer_config(cfg)
    return {k: v for k, v in cfg.items() if k != "PROGRAMS"}


def single_stage(configs: list[dict]) -> list[dict]:
    """The pipelined configurations among ``configs`` with one stage instead, each once."""
    out = []
    for cfg in configs:
        one = {**cfg, "num_stages": 1}
        if cfg.get("num_stages", 1) > 1 and "PROGRAMS" not in cfg and one not in configs and one not in out:
            out.append(one)
    return out
