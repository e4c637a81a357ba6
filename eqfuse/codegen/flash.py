"""When an attention kernel may run as the Hopper flash template (codegen/flash_hopper.py),
and the template's constexprs for it.

The rules and the attention schedule produce the kernel from whatever spelling the user
wrote; this module only asks whether what they produced is the plain form the template
computes: one softmax product and its sum over scores ``dot(q, k^T) * c`` (casts that
change nothing aside), masked at most by a causal band (``codegen/attention.py`` finds
it), with one output ``expdot / expsum`` in the operands' dtype; q, k and v read as
stored (through index maps only, one buffer or several) with a unit stride along the head
dim (k may instead be stored transposed, the keys contiguous: the layout in which
Llama's plan writes k after its rotary embedding), at most two batch dims (batch,
heads), strides and offsets TMA can take; k and v may hold fewer heads, each read by a group of
q's heads in a row (grouped-query attention). Anything else (a bias, a padding mask, a
log-sum-exp output, a prologue on an operand) keeps the portable kernel.

The template is one autotuning candidate among the portable kernel's, offered on Hopper
(compute capability 9.0, compiled) at head dims 16 to 256.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

from ..schema import ops
from ..schema.plan import KernelSpec, PNode
from . import access

# The template's configurations the autotuner is offered: (FLASH, tile widths along the
# head dim (``padded``), BLOCK_M, BLOCK_N, K/V ring depth as num_stages), two consumer
# warpgroups of BLOCK_M / 2 rows each. FLASH = 1: one program per query block; 2:
# persistent programs (where ``persistent_fits``). On an H200
# (benchmarks/flash_hopper_probe.py, S=2048 fp16): at D=128 one program per block ran
# 536-557 us, persistent 494, the portable kernel 637, SDPA 516 (causal: 349-369, 289,
# 373, 313); at D=64 one program per block lost to the portable kernel (405-449 against
# 336 us), persistent tied it (337; causal 189 against 200). At head dims 129 to 256 (tiles
# 256 wide: q's 64 KiB and two slots of K and V at 64 keys fill 192 KiB of shared memory),
# B=4 H=8 bf16: S=1024 causal 75 us against SDPA's 57 (in Gemma-2's plan 57, where the
# portable kernel had taken 620-660), full 67 against 62, S=2048 causal 157 against 147;
# keys 32 at a time in 3 slots ran 78, 84 and 203.
TILES = [(2, (64, 128), 128, 128, 2), (1, (128,), 128, 128, 3), (1, (128,), 128, 128, 2),
         (1, (256,), 128, 64, 2)]
ALIGN = 16  # bytes: TMA base addresses and strides
L2_SHARE = 0.5  # of the L2 cache: the K and V of the heads a persistent program set runs at once


@dataclass(frozen=True)
class Operand:
    """A [*batch, rows, D] operand read from ``buf``: element (b..., i, d) at
    ``offset + sum(b * batch_strides) + i * row_stride + d``."""
    buf: str
    offset: int
    batch_strides: tuple
    row_stride: int
    group: int = 1  # head h reads stored head h // group (grouped-query attention's k and v)


@dataclass(frozen=True)
class Form:
    q: Operand
    k: Operand
    v: Operand
    out: str  # the output buffer
    scale: float  # the scores in log2 units are dot(q, k^T) * scale
    band_hi: int | None  # causal: row i sees keys j <= i + band_hi
    collapsible: bool  # q, k, v are [heads x rows, D] boxes: batch, head and row strides compose
    # k stored transposed ([..., D, N], the keys contiguous): k's rows are its D rows
    k_transposed: bool = False


@functools.cache
def device_supports() -> bool:
    """A CUDA GPU of compute capability 9.0 (wgmma needs sm_90a), compiled: Triton's CPU
    interpreter does not run Gluon."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    try:
        import torch
        return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    except Exception:  # noqa: BLE001 - no usable CUDA: no template
        return False


def padded(d: int) -> int:
    """The template's tile width along a head dim of ``d``: the power of two at or above it."""
    return 1 << (d - 1).bit_length()


def persistent_fits(f: Form, sched, block_m: int, block_n: int) -> bool:
    """Whether the persistent form can run: heads and rows collapse, no tile is ragged, and
    a box of k^T (k stored transposed) is one head's D rows."""
    return (f.collapsible and sched.m % block_m == 0 and sched.n % block_n == 0
            and not (f.k_transposed and padded(sched.d) != sched.d))


def candidates(sched) -> list[dict]:
    """The template's configurations for an attention schedule that has the plain form
    (``sched.flash``; the persistent ones where ``persistent_fits``), by the head dim its
    tiles are (``padded``)."""
    f = sched.flash
    if f is None or not device_supports():
        return []
    out = []
    for form_, dims, bm, bn, stages in TILES:
        if padded(sched.d) in dims and (form_ == 1 or persistent_fits(f, sched, bm, bn)):
            out.append({"FLASH": form_, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": stages})
    return out


def collapses(op: Operand, batch: tuple, rows: int) -> bool:
    """Whether the operand's (batch, head, row) strides compose into one row stride."""
    stride, size = op.row_stride, rows
    for s, n in zip(reversed(op.batch_strides), reversed(batch)):
        if s != stride * size:
            return False
        stride, size = s, n
    return True


def form(spec: KernelSpec, band, m: int) -> Form | None:
    """The template's view of an attention kernel, or None where it is not the plain form."""
    from .attention import _cast_is_free, _scaled, log2_scaled, streams, unmasked_scores

    flows = streams(spec)
    if sorted(f.op for f in flows) != ["expdot", "expsum"] or len(spec.roots) != 1:
        return None
    expdot = next(f for f in flows if f.op == "expdot")
    expsum = next(f for f in flows if f.op == "expsum")
    scores = expdot.args[0]
    # masked: the scores where every row sees its keys whole (None for a window's lower edge)
    tree = scores if band is None else unmasked_scores(scores, band)
    if tree is None:
        return None
    x, scale = _scaled(log2_scaled(tree))
    while x.op == "cast" and _cast_is_free(x):
        x = x.args[0]
    if x.op != "dot" or scale is None:
        return None
    root, out = spec.roots[0]
    if band is not None and band[1] >= 0:  # every row sees key 0: no row is empty
        root = _without_empty_row_guard(root, scores)
    if not _is_normalised(root, expdot, expsum) or root.dtype != expdot.args[1].dtype:
        return None
    # A constant factor on q or k (the scale written on an operand) joins the scale.
    (q_node, q_factor), (k_node, k_factor) = (_factored(n) for n in x.args)
    scale *= q_factor * k_factor
    q, v = _operand(q_node, contiguous=-1), _operand(expdot.args[1], contiguous=-1)
    # k^T with D contiguous (K's rows as stored), or stored transposed with the keys contiguous
    kt, k_transposed = _operand(k_node, contiguous=-2), False
    if kt is None:
        kt, k_transposed = _operand(k_node, contiguous=-1), True
    if None in (q, kt, v) or out in (q.buf, kt.buf, v.buf) or q.group != 1 or kt.group != v.group:
        return None
    d, e = expdot.args[1].shape[-1], x.args[0].shape[-1]
    if d != e or d % 16 or not 16 <= d <= 256 or len(root.shape) > 4:
        return None
    if x.args[0].dtype not in ("float16", "bfloat16") or len({x.args[0].dtype, x.args[1].dtype, root.dtype}) != 1:
        return None
    batch = tuple(root.shape[:-2])
    if v.group > 1 and (len(batch) < 1 or batch[-1] % v.group):
        return None
    kv_batch = (*batch[:-1], batch[-1] // v.group) if batch else batch  # the stored heads of k and v
    m, n = x.shape[-2:]
    collapsible = (collapses(q, batch, m) and collapses(kt, kv_batch, d if k_transposed else n)
                   and collapses(v, kv_batch, n))
    return Form(q, kt, v, out, scale, band[1] if band is not None else None, collapsible, k_transposed)


def _strip(node: PNode, ops_: tuple) -> PNode:
    while node.op in ops_:
        node = node.args[0]
    return node


def _is_normalised(root: PNode, expdot: PNode, expsum: PNode) -> bool:
    """``root`` is ``expdot / expsum`` under casts (the softmax's division, then a cast to
    the output's dtype)."""
    div = _strip(root, ("cast",))
    if div.op != "binary" or div.attrs[0] != "div":
        return False
    return _strip(div.args[0], ("cast",)) is expdot and _strip(div.args[1], ("cast", "broadcast")) is expsum


def _without_empty_row_guard(root: PNode, scores: PNode) -> PNode:
    """``x`` where ``root`` is ``where(rowmax(scores) == -inf, 0, x)`` (under casts): a
    masked attention's output for rows the mask leaves no key (capture._sdpa_math), moot
    where the band gives every row a key; ``root`` otherwise."""
    node = _strip(root, ("cast",))
    if node.op != "where":
        return root
    zero = _strip(node.args[1], ("broadcast", "cast"))
    if zero.op != "const" or float(zero.attrs[0]) != 0:
        return root
    test = _strip(node.args[0], ("broadcast",))
    if test.op != "binary" or test.attrs[0] != "eq":
        return root
    inf = _strip(test.args[1], ("broadcast", "cast"))
    if inf.op != "const" or float(inf.attrs[0]) != float("-inf"):
        return root
    top = _strip(test.args[0], ("cast", "broadcast"))
    if top.op != "reduce" or top.attrs[0] != "max" or _strip(top.args[0], ("cast",)) is not _strip(scores, ("cast",)):
        return root
    return node.args[2]


def _factored(node: PNode) -> tuple[PNode, float]:
    """``(x, c)`` where ``node`` is ``x * c`` for a constant ``c > 0`` (``(node, 1)``
    otherwise): a product's operand scaled before it."""
    if node.op == "binary" and node.attrs[0] == "mul":
        for x, c in (node.args, node.args[::-1]):
            c = _strip(c, ("broadcast",))
            if c.op == "const" and 0 < float(c.attrs[0]) < math.inf and x.shape == node.shape:
                return x, float(c.attrs[0])
    return node, 1.0


def _operand(node: PNode, contiguous: int) -> Operand | None:
    """An operand read as stored (through index maps only: a projection's output split
    into heads, transposed, sliced), with a unit stride along ``contiguous`` (-1: rows of
    D, or k^T stored as such; -2: k^T, whose D runs down its columns). Its rows are the
    other axis."""
    view = access.grouped_view(node) if len(node.shape) <= 4 else None
    if view is None:
        return None
    buf, t, group = view
    strides, offset = t.stride(), t.storage_offset()
    if strides[contiguous] != 1:
        return None
    row = strides[-2] if contiguous == -1 else strides[-1]
    item = ops.itemsize(node.dtype)
    batch = strides[:-2]
    if any((s * item) % ALIGN for s in (row, offset, *batch)):
        return None
    return Operand(buf, offset, batch, row, group)


def constexprs(f: Form, sched, buffers: dict, cfg: dict) -> dict | None:
    """The template's constexprs for ``cfg``, or None where the output buffer is not one TMA
    can write (a unit stride along D, 16-byte strides)."""
    from . import flash_hopper

    out = buffers[f.out]
    strides = tuple(out.layout)
    item = ops.itemsize(out.dtype)
    if strides[-1] != 1 or any((s * item) % ALIGN for s in strides[:-1]):
        return None
    o = Operand(f.out, 0, strides[:-2], strides[-2])
    batch = tuple(sched.batch)
    persistent = cfg["FLASH"] == 2
    if persistent and not (persistent_fits(f, sched, cfg["BLOCK_M"], cfg["BLOCK_N"]) and collapses(o, batch, sched.m)):
        return None
    heads = batch[-1] if batch else 1
    values = {"H": heads, "M": sched.m, "N": sched.n, "D": sched.d, "DP": padded(sched.d)}
    for name, op in (("Q", f.q), ("K", f.k), ("V", f.v), ("O", o)):
        b_stride, h_stride = _batch_strides(op.batch_strides, len(batch))
        row = "M" if name in "QO" else "N"
        values.update({f"O{name}": op.offset, f"S{name}B": b_stride, f"S{name}H": h_stride,
                       f"S{name}{row}": op.row_stride})
    values.update(SCALE=f.scale, CAUSAL=f.band_hi is not None, BAND_HI=f.band_hi or 0, KT=f.k_transposed,
                  GROUP=f.v.group,
                  BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["num_stages"],
                  CONSUMER_REGS=flash_hopper.CONSUMER_REGS, BH=math.prod(batch), PROGRAMS=0, CHUNK=0)
    if persistent:
        values["PROGRAMS"], values["CHUNK"] = persistent_programs(math.prod(batch), sched.m, sched.n, sched.d,
                                                                  item, cfg["BLOCK_M"])
    return values


def persistent_programs(heads: int, m: int, n: int, d: int, itemsize: int, block_m: int) -> tuple[int, int]:
    """(programs, heads per L2 chunk) of the persistent form on this GPU for ``heads``
    (batch x heads) of [m, d] queries over [n, d] keys: a program per SM (one fits, by
    shared memory) or per query block where there are fewer, and as many heads at once as
    keep their K and V in L2_SHARE of the L2 cache."""
    import torch
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    items = heads * -(-m // block_m)
    per_head = 2 * n * d * itemsize
    return min(props.multi_processor_count, items), max(1, int(props.L2_cache_size * L2_SHARE) // per_head)


def _batch_strides(strides: tuple, dims: int) -> tuple:
    """(batch stride, head stride) of an operand over ``dims`` batch dims (0, 1 or 2)."""
    if dims == 0:
        return 0, 0
    if dims == 1:
        return 0, strides[0]
    return strides[0], strides[1]


def generate(spec: KernelSpec, sched, buffers: dict, cfg: dict, runtime: frozenset):
    """The kernel as the template (``kernel.Generated``), or None where it cannot be: sizes
    taken at launch (a sized module), or not the plain form."""
    from . import flash_hopper
    from .kernel import Generated

    f = sched.flash
    values = constexprs(f, sched, buffers, cfg) if f is not None and not runtime else None
    if values is None:
        return None
    params = [f.q.buf, f.k.buf, f.v.buf, f.out]
    doc = ", ".join(spec.fx_nodes) or "(no FX node)"
    text = (f"# {spec.name}: the Hopper flash-attention template (eqfuse/codegen/flash_hopper.py); FX nodes: {doc}\n"
            f"from eqfuse.codegen.flash_hopper import flash_attention_hopper as {spec.name}\n")
    grid = (values["PROGRAMS"],) if values["PROGRAMS"] else None
    form_ = "persistent" if values["PROGRAMS"] else "a program per query block"
    return Generated(text, sched, cfg, params, params, constexprs=values,
                     launch={"num_warps": 4, "maxnreg": flash_hopper.MAXNREG}, grid=grid,
                     template=f"the Hopper flash template, {form_}")
