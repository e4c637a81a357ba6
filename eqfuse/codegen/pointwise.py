"""Pointwise kernels that transpose or join rows: a 2-D iteration instead of a flat one.

A flat pointwise kernel walks its output in row-major order, ``XBLOCK`` consecutive
elements per program. When it reads a tensor whose unit-stride dimension is not the
output's last one (``k.transpose(-1, -2).contiguous()``, rotary embedding written into a
``[batch, heads, dim, seq]`` copy of K), neighbouring lanes read elements thousands apart:
every 2-byte load takes its own 32-byte sector, and the kernel runs at a tenth of the
bandwidth (2150 us instead of ~180 for the Llama layer's rotary at B8 S2048 H4096).

Such a kernel iterates over ``[Y, X]`` instead, where ``X`` is the extent of the output's
innermost digits below the read's unit-stride one: a ``YBLOCK x XBLOCK`` tile then has
consecutive elements along ``x`` for the output (and every read in output order) and
along ``y`` for the transposed read. Triton's coalescing pass gives each access the lane
order of its own contiguous axis and moves values between the two through shared memory.
"""

from __future__ import annotations

from collections import Counter

from ..schema.plan import KernelSpec, PNode
from .access import loads_at, unit_stride_digit
from .indexing import Digit, Env, Idx, env_of, regroup

MIN_SIDE = 16  # a tile side below this is not worth a 2-D iteration

# The flat index and the 2-D iteration's column index are one name: "x" is the axis
# along which the output is contiguous either way.
XINDEX = Idx("xindex", frozenset("x"))
YINDEX = Idx("yindex", frozenset("y"))


def inner_extent(spec: KernelSpec) -> int:
    """``X`` of the 2-D iteration ``[numel / X, X]`` for a pointwise kernel with a read
    across the output's order, or 0 where the flat iteration reads everything in order."""
    starts: Counter = Counter()
    numel = spec.roots[0][0].numel
    for root, _ in spec.roots:
        for load, env in loads_at(root, env_of([(XINDEX, root.numel)], root.shape, XINDEX)):
            digit = unit_stride_digit(load, env)
            if digit is not None and digit.atom == XINDEX and digit.lo > 1:
                starts[digit.lo] += load.numel
    inner = starts.most_common(1)[0][0] if starts else _joined_rows(spec)
    return inner if inner >= MIN_SIDE and numel // inner >= MIN_SIDE else 0


def _joined_rows(spec: KernelSpec) -> int:
    """The row length of a concatenation along the output's rows (GPT-2's backward joins
    the q, k and v gradients into [tokens, 3 x 768]), or 0. Iterated flat, each part's
    read goes through the flat index unravelled per element, and no read is seen to run
    along the lanes (H100: 70 us for 38 MB in and out); over [rows, row length] tiles the
    column is the tile's own index."""
    for root, _ in spec.roots:
        for node in root.walk():
            if node.op == "cat" and node.attrs[0] == len(node.shape) - 1 and node.shape[-1] == root.shape[-1]:
                return node.shape[-1]
    return 0


def tiled_env(root: PNode, inner: int) -> Env:
    """The environment of a root over the 2-D iteration ``[numel / inner, inner]``: its
    dims made of the two indices' digits, or, for a root whose dims do not fall on
    ``inner`` (a second output of another shape), unravelled from the linear index."""
    rows = root.numel // inner
    linear = Idx(f"(yindex * {inner} + xindex)", frozenset("xy"))
    digits = [Digit(YINDEX, rows, 1, rows), Digit(XINDEX, inner, 1, inner)]
    if regroup(digits, root.shape) is None:
        return env_of([(linear, root.numel)], root.shape, linear)
    return env_of([(YINDEX, rows), (XINDEX, inner)], root.shape, linear)


def default_config(numel: int, inner: int) -> dict:
    from .schedules import next_pow2
    return {"YBLOCK": min(64, next_pow2(numel // inner)), "XBLOCK": min(64, next_pow2(inner)), "num_warps": 4}


def tuning_candidates(numel: int, inner: int) -> list[dict]:
    from .schedules import next_pow2
    out = [default_config(numel, inner)]
    for y, x, warps in ((32, 32, 4), (64, 32, 4), (32, 64, 4), (128, 64, 8), (64, 128, 8)):
        cfg = {"YBLOCK": min(y, next_pow2(numel // inner)), "XBLOCK": min(x, next_pow2(inner)), "num_warps": warps}
        if cfg not in out:
            out.append(cfg)
    return out


def head(numel: int, inner: int, cfg: dict, uneven: dict, index_cast: str = "",
         runtime: frozenset = frozenset()) -> list[str]:
    """The kernel's first lines: program -> tile, indices and their masks. ``uneven`` gets
    the masks the tile needs: every one along a side whose size is taken at launch
    (``runtime``: xnumel, X)."""
    rows = numel // inner
    if rows % cfg["YBLOCK"] or "xnumel" in runtime:
        uneven["y"] = "ymask"
    if inner % cfg["XBLOCK"] or "X" in runtime:
        uneven["x"] = "xmask"
    lines = ["tiles_x = tl.cdiv(X, XBLOCK)",
             f"pid = tl.program_id(0){index_cast}",
             "yindex = (pid // tiles_x) * YBLOCK + tl.arange(0, YBLOCK)[:, None]",
             "xindex = (pid % tiles_x) * XBLOCK + tl.arange(0, XBLOCK)[None, :]"]
    if "y" in uneven:
        lines.append("ymask = yindex < xnumel // X")
    if "x" in uneven:
        lines.append("xmask = xindex < X")
    return lines
