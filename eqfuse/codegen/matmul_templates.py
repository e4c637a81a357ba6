"""When a matmul kernel may run as a Hopper matmul template (codegen/matmul_hopper.py:
ping-pong or cooperative), and its source: the template called with the kernel's own
epilogue.

A template computes one product of two half-precision operands read as stored (A with K
contiguous; B with N or K contiguous; strides and offsets TMA takes) into one output of a
16-bit dtype (TMA reads the operands; the output is stored by TMA or, from a chunked
epilogue, by pointer); whatever the plan computes from the accumulator (a bias, an
activation, a residual, a cast) is its epilogue. That epilogue is the one the Triton kernel
would run: ``KernelWriter`` writes it, and its lines are spelled in Gluon, whose operators
have the same names (``gl.load``, ``gl.erf``...) and semantics. An epilogue that uses
anything else (a constant tile, a reduction, an operator Gluon lacks), a batch, a second
product or a second output keeps the Triton kernel. The cooperative template's epilogue
always reads the product rounded to the operands' dtype, so it is offered only where the
graph's product is in that dtype (``Schedule.rounded``; F.linear's bias is added to the
unrounded product).

The templates are autotuning candidates among the Triton kernel's, on Hopper (compute
capability 9.0, compiled; ``EQFUSE_PINGPONG=0`` turns both off): they hide the epilogue
behind the next tile's K loop. On an H100 the autotuner took the ping-pong one for
gelu(x@W+b) at 8192 x 4096 x 4096 in some runs and the cooperative one in others (within
1%), the cooperative one for GPT-2's q/k/v projection and MLP product (the block forward
299.6 us against 306.9 without it; benchmarks/models_template_ab.py), and kept the Triton
kernel for GPT-2's MLP output product (K = 3072, N = 768: three 256-column tiles across N).
A ping-pong epilogue that computes a special function (erf, exp, tanh...) runs in chunks
of rows (``CHUNK``: 16 or 8, both timed), so that each consumer's copy of its code is one
chunk's: unrolled over the tile, two copies of erf's overflowed the instruction cache, and
in GPT-2's block the MLP product with tanh-form gelu ran 87-88 us against the Triton
kernel's 82, though 75 against 84 alone. Chunked, on an H100
(benchmarks/matmul_pingpong_block.py): 73.9 in the block against 81.5.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from ..schema import ops
from ..schema.plan import KernelSpec
from . import tma

# The templates (codegen/matmul_hopper.py): name -> the kernel, and (BLOCK_M, BLOCK_N,
# BLOCK_K, STAGES) of its output tile and ring. Either way an MMA warpgroup holds 128 float32
# accumulator registers a thread: a ping-pong consumer one 128 x 128 tile, a cooperative
# warpgroup 64 rows of a 128 x 256 tile (whose K loop moves fewer bytes a product: at
# 8192 x 4096 x 4096 on an H100 it ran at cuBLAS's time, the ping-pong one 1.05-1.07x).
TEMPLATES = {
    "pingpong": ("matmul_pingpong", (128, 128, 64, 4)),
    "cooperative": ("matmul_cooperative", (128, 256, 64, 3)),
}
GROUP_M = 8
# An untimed build takes the cooperative template first for a light epilogue over this
# many tiles an SM or more (first_choice)
WAVES = 6
# Rows of a chunk where the epilogue computes a special function: its code is one chunk's
# (matmul_hopper._chunked_epilogue), not the whole tile's twice over. 16 rows are 16
# elements a thread; 8, half the code, ran gelu's erf form 1.4-4.8% faster at 8192 x 4096
# x 4096 and 3% slower at GPT-2's MLP shape and SwiGLU's gate product (H100), so the
# autotuner times both and an untuned build takes 16.
CHUNKS = (16, 8)
# Triton operators that Gluon has under the same name and with the same semantics; and
# those written otherwise
SAME_IN_GLUON = {"load", "where", "maximum", "minimum", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "erf",
                 "abs", "floor", "ceil", "sin", "cos", "fma", "cast", "float16", "bfloat16", "float32", "float64",
                 "int1", "int8", "int16", "int32", "int64", "uint8"}
OWN = {"sigmoid": "pingpong_sigmoid"}
ENV = "EQFUSE_PINGPONG"  # 0: the template is never offered
INDEX_NAMES = {"mindex", "nindex", "mmask", "nmask", "M", "N"}


@dataclass(frozen=True)
class Form:
    a: tma.Box  # [M, K], K contiguous
    b: tma.Box  # [K, N] (inner "nindex") or [N, K] (inner "kindex_b")
    out: tma.Box  # [M, N], N contiguous
    acc: str  # the accumulator's name in the epilogue's lines
    lines: tuple  # the epilogue in Gluon, ending in ``return``
    args: tuple  # buffers the epilogue reads


def offered() -> bool:
    """Whether the template is switched on (``EQFUSE_PINGPONG``, on unless 0)."""
    from ..runtime.cache import switched_on
    return switched_on(ENV)


def eligible(sched) -> bool:
    """The schedule's side of the template's conditions (the rest needs the buffers):
    one unbatched half-precision product whose operands TMA can read."""
    return sched.kind == "matmul" and sched.dots == 1 and not sched.batch and sched.tma and \
        sched.dot_dtype in ("float16", "bfloat16") and not sched.gathered


def form(spec: KernelSpec, sched, buffers: dict) -> Form | None:
    """The template's view of a matmul kernel, or None where the template cannot run it."""
    from .kernel import KernelWriter
    from .schedules import _operand_sides, operand_box

    if not eligible(sched) or len(spec.roots) != 1:
        return None
    dot = next(n for n in spec.walk() if n.op == "dot")
    (_, a_env, a_atoms), (_, b_env, b_atoms) = _operand_sides(sched)
    a, b = operand_box(dot.args[0], a_env, a_atoms), operand_box(dot.args[1], b_env, b_atoms)
    if a is None or b is None or a.inner != "kindex_a" or a.batch or b.batch:
        return None
    if sched.special and not sched.rounded:  # a chunked epilogue reads the product rounded to the operands' dtype
        return None
    root, buf = spec.roots[0]
    out_buf = buffers[buf]
    if ops.itemsize(out_buf.dtype) != 2 or out_buf.kind == "input":
        return None
    w = KernelWriter(spec, buffers, sched)
    if w.index_dtype_cast:  # the template's indices are 32-bit
        return None
    env = w.root_env(root)
    affine = tma.atom_strides(env, out_buf.layout, root.shape)
    out = tma.box(buf, 2, 0, affine, "mindex", "nindex")
    if out is None or out.inner != "nindex":
        return None
    bm, bn, bk, _ = TEMPLATES["pingpong"][1]  # the epilogue's lines do not depend on them (BLOCK_* refused)
    w.matmul_head({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": GROUP_M})
    w.emit_dots()
    start = len(w.lines)
    value = w.emit(root, env)
    if value.axes != frozenset("mn"):
        return None
    lines = w.lines[start:] + [f"return ({value.expr}).to(gl.{out_buf.dtype})"]
    accs = set(re.findall(r"\bacc\d+\b", "\n".join(lines)))
    if len(accs) != 1:
        return None
    acc = accs.pop()
    gluon = _in_gluon(lines, acc, set(buffers))
    if gluon is None:
        return None
    lines, args = gluon
    return Form(a, b, out, acc, tuple(lines), tuple(args))


def _in_gluon(lines: list, acc: str, buffers: set) -> tuple | None:
    """(the lines spelled in Gluon, the buffers they read), or None where a line uses an
    operator Gluon lacks, or a name the epilogue does not define (a value of the K loop)."""
    out = []
    for line in lines:
        for name in re.findall(r"\btl\.(\w+)", line):
            if name not in SAME_IN_GLUON and name not in OWN:
                return None
        line = re.sub(r"\btl\.(\w+)", lambda m: OWN.get(m.group(1), f"gl.{m.group(1)}"), line)
        out.append(line)
    try:
        tree = ast.parse("def epilogue():\n" + "\n".join("    " + line for line in out))
    except SyntaxError:
        return None
    defined = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
               if isinstance(t, ast.Name)}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    args = sorted(used & buffers)
    unknown = used - defined - set(args) - INDEX_NAMES - {acc, "gl", "pingpong_sigmoid", "float"}
    return (out, args) if not unknown else None


def _config(template: str, programs: int, loader: int = 1, chunk: int = 0) -> dict:
    """A template's configuration, on ``programs`` persistent programs; for the cooperative
    one, how its ring is filled (``LOADER``); for a ping-pong epilogue with a special
    function, its chunk's rows (``CHUNK``)."""
    bm, bn, bk, stages = TEMPLATES[template][1]
    cfg = {"TEMPLATE": template, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": GROUP_M, "num_warps": 4,
           "num_stages": stages, "PROGRAMS": programs}
    if template == "cooperative":
        cfg["LOADER"] = loader
    elif chunk:
        cfg["CHUNK"] = chunk
    return cfg


def _tiles(template: str, sched) -> int:
    """The template's output tiles over the product."""
    bm, bn = TEMPLATES[template][1][:2]
    return -(-sched.m // bm) * -(-sched.n // bn)


def _programs(template: str, sched) -> int:
    return min(tma.sm_count(), _tiles(template, sched))


def candidates(sched) -> list[dict]:
    """The templates' configurations for a schedule they may run (``eligible``) on this GPU.
    The cooperative one only where the product is in its operands' dtype (its epilogue
    reads a staging copy), its ring filled by a loader warp beside two epilogue warps; for
    an epilogue with a special function, also by an MMA warpgroup beside four epilogue
    warps, which keep up where the K loop is short (H100, gelu's erf form: 87.6 us against
    117.1 at GPT-2's MLP shape, K = 768; 447.9 against 441.0 at K = 4096)."""
    from .flash import device_supports

    if not eligible(sched) or not offered() or not device_supports():
        return []
    programs = _programs("pingpong", sched)
    out = [_config("pingpong", programs, chunk=chunk) for chunk in (CHUNKS if sched.special else (0,))]
    if sched.rounded:
        programs = _programs("cooperative", sched)
        out += [_config("cooperative", programs, loader) for loader in ((1, 0) if sched.special else (1,))]
    return out


def first_choice(sched) -> list[dict]:
    """The template an untimed build tries before the Triton kernels, if any: the ping-pong
    one where the epilogue computes a special function (it ran faster than the best Triton
    kernel at every such product measured: gelu(x@W+b) at GPT-2's, BERT's and the issue's
    shapes, SwiGLU's gate product, inside GPT-2's and BERT's blocks too); the cooperative
    one for a light epilogue over at least WAVES tiles an SM (H100: x@W+r at 8192 x 4096 x
    4096, 7.8 tiles an SM, 424.5 us against 440.6-463.0 for the best Triton kernel; GPT-2's
    q/k/v projection, 4.4 an SM, level in its block, 48.1 against 48.0; GPT-2's MLP output,
    1.5 an SM, the Triton kernel's 76.2 against 82-85)."""
    offered = candidates(sched)
    if sched.special:
        return [c for c in offered if c["TEMPLATE"] == "pingpong" and c["CHUNK"] == CHUNKS[0]]
    if _tiles("cooperative", sched) < WAVES * tma.sm_count():
        return []
    return [c for c in offered if c["TEMPLATE"] == "cooperative" and c["LOADER"] == 1]


def runnable(cfg: dict, sched) -> bool:
    """Whether ``cfg`` (from a cache, or a user) is a template's, for a schedule it may
    run and is offered for (either way of filling the cooperative one's ring runs any
    epilogue)."""
    template, programs = cfg.get("TEMPLATE"), cfg.get("PROGRAMS")
    if sched is None or not eligible(sched) or not offered() or template not in TEMPLATES or \
            not isinstance(programs, int) or programs < 1 or (template == "cooperative" and not sched.rounded):
        return False
    chunk = cfg.get("CHUNK", 0)
    if template == "pingpong" and (chunk in CHUNKS) != bool(sched.special):
        return False  # a chunked epilogue is one with a special function
    return cfg == _config(template, programs, cfg.get("LOADER", 1), chunk) and cfg.get("LOADER", 1) in (0, 1)


def pointer_config(cfg: dict) -> dict:
    """The Triton kernel that runs in the template's place where an address is not
    16-byte aligned, or where the template cannot be generated: the same tiles, one
    program per tile."""
    return {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
            "GROUP_M": cfg["GROUP_M"], "num_warps": 8, "num_stages": 3}


def generate(spec: KernelSpec, sched, buffers: dict, cfg: dict, runtime: frozenset):
    """The kernel as a template (``kernel.Generated``), or None where it cannot be: sizes
    taken at launch (a sized module), or not the template's form."""
    from . import matmul_hopper
    from .kernel import Generated

    f = form(spec, sched, buffers) if not runtime else None
    if f is None:
        return None
    template = cfg["TEMPLATE"]
    cooperative = template == "cooperative"
    kernel = TEMPLATES[template][0]
    params = list(dict.fromkeys([f.a.buf, f.b.buf, f.out.buf, *f.args]))
    name = spec.name
    doc = ", ".join(spec.fx_nodes) or "(no FX node)"
    epi = [f"def {name}_epilogue({f.acc}, mindex, nindex, M: gl.constexpr, N: gl.constexpr"
           + "".join(f", {a}" for a in f.args) + "):"]
    epi += ["    mmask = mindex < M", "    nmask = nindex < N"]
    epi += ["    " + line for line in f.lines]
    offsets = [f"{p} + {box.offset}" if box.offset else p for p, box in ((f.a.buf, f.a), (f.b.buf, f.b))]
    epi_args = "".join(f"{a}, " for a in f.args)
    # the template's constexprs, in its order: the wrapper takes them and hands them on
    values = {"M": sched.m, "N": sched.n, "K": sched.k, "SA": f.a.stride, "SB": f.b.stride, "SC": f.out.stride,
              "B_KMAJOR": f.b.inner == "kindex_b",
              "BLOCK_M": cfg["BLOCK_M"] // 2 if cooperative else cfg["BLOCK_M"],  # a warpgroup's rows
              "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"], "GROUP_M": cfg["GROUP_M"],
              "STAGES": cfg["num_stages"], "PROGRAMS": cfg["PROGRAMS"]}
    if cooperative:
        values["LOADER"] = cfg["LOADER"]
    else:
        values["CHUNK"] = cfg.get("CHUNK", 0)
    what = f"the Hopper {'cooperative' if cooperative else 'ping-pong'} matmul template"
    text = "\n".join([
        f"# {name}: {what} (eqfuse/codegen/matmul_hopper.py) with this kernel's",
        f"# epilogue; FX nodes: {doc}",
        "from triton.experimental import gluon",
        "from triton.experimental.gluon import language as gl",
        f"from eqfuse.codegen.matmul_hopper import {kernel}",
        "from eqfuse.codegen.matmul_hopper import sigmoid as pingpong_sigmoid",
        "",
        "",
        "@gluon.jit",
        *epi,
        "",
        "",
        "@gluon.jit",
        f"def {name}({', '.join(params + [f'{k}: gl.constexpr' for k in values])}):",
        f'    """FX nodes: {doc}"""',
        f"    {kernel}({offsets[0]}, {offsets[1]}, {f.out.buf}, {name}_epilogue, ({epi_args}), "
        f"{', '.join(values)})",
        ""])
    return Generated(text, sched, cfg, params, [f.a.buf, f.b.buf, f.out.buf], constexprs=values,
                     launch={"num_warps": 4, "maxnreg": matmul_hopper.MAXNREG}, grid=(cfg["PROGRAMS"], 1),
                     template=what)
