"""K-major copies of TF32 right operands: an N-major float32 B is transposed into a buffer
of its own before the product.

Hopper's TF32 tensor-core instruction (wgmma) takes 32-bit operands from shared memory only
K-major. ``a @ b`` with ``b`` [K, N] row-major (N-major: unit stride along N) cannot feed it
as stored, and every kernel Triton made of such a product ran 2.4-4x slower than with the
same B stored K-major (B^T [N, K] contiguous, read through a transpose). Measured on an H100
(benchmarks/matmul_tma_probe.py, benchmarks/results/matmul-tma-probe_*.json and
matmul_*.json, [2048 x 2048] @ [2048 x 2048] fp32 with ``allow_tf32``):

* N-major B: the probe's kernels 207-272 us whatever the tiles or the form (pointers, TMA,
  persistent); eqfuse's own kernel, autotuned, 129.6 us (256 x 128 x 32 tiles);
* K-major B: 53.4 us (TMA persistent 128 x 256 x 32, 8 warps, 3 stages) to 78;
* a Triton transposing copy of B: 16.7 us; cuBLAS, for reference, 51 us.

With this pass (benchmarks/matmul_tf32.py, benchmarks/results/matmul-tf32_*.json, one
H100 run): 132.7 us -> 66.0 a call autotuned (copy 11.8 + product 49.7 us of device time,
the product TMA persistent 128 x 256 x 32), 71.4 with autotune off; cuBLAS 51.4,
torch.compile 51.3.

So, where a matmul kernel's products are float32 under TF32 and each one's right operand
is a plain read (index maps over a load, no broadcast) whose address steps by one along N
and not along K, the kernel becomes:

* ``<kernel>_kmajor`` (a pointwise kernel, one per distinct operand: ``_kmajor1``, ...):
  the operand permuted to [..., N, K] and stored contiguous, a float32 temp buffer. The
  pointwise writer iterates a transposing copy over 2-D tiles (codegen/pointwise.py);
* ``<kernel>``: the same kernel with each such operand read from that buffer through a
  permute, K-major (the TMA form takes it where the device does).

Both are ordinary plan kernels, so the launcher, the autotuner, parallel compilation, the
plan cache and export handle them like any other. The values are the same: the copy
moves float32 elements unchanged, and the product rounds them to TF32 as before.

Only where it pays, by the model: the product's modelled time with B N-major (the tile
model, codegen/tiles.py, with TF32 throughput divided by ``TF32_NMAJOR_SLOWDOWN``: the
tile model itself does not know the layout, and needs not, since after this pass no TF32
product it ranks reads an N-major B unless this pass judged the copy not worth it) against
the K-major product's plus the copies (their bytes read and written at the memory
bandwidth) and a launch each; and never below ``MIN_ELEMENTS`` copied or ``MIN_M`` rows of
the product (few rows: little work per copied element). At 2048^3, on the default device
figures, the model weighs the N-major product at about 150 us against 65 + 13 for the
K-major one and the copy; at 256 x 2048 x 2048 the copy does not pay.

Batched products are included (a copy [*batch, N, K]). Not copied: an operand broadcast
over the batch (a weight shared by it, read with a stride of 0: it would be copied once
per matrix), a computed operand (a prologue: its tile is converted in registers anyway),
an operand with K or N of 1 (both layouts at once), and the operands of fp16/bf16
products (their instruction takes either layout).

Runs before split-K (codegen/splitk.py): a product split over K reads chunks of the
K-major copy. ``EQFUSE_KMAJOR=0`` turns it off (the plan cache key holds this, and
``allow_tf32``); tests set ``FORCE`` to copy every operand that qualifies, whatever the
sizes and the model say.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import Unschedulable
from ..rewrite.cost import Device, device_model, load_footprint
from ..runtime.cache import switched_on
from ..schema.plan import Buffer, KernelSpec, Plan, PNode, contiguous_strides, rewrite_kernels, substitute
from . import access, schedules, tiles
from . import kernel as kgen

SUFFIX = "_kmajor"
ENV = "EQFUSE_KMAJOR"
MIN_ELEMENTS = 1 << 18  # fewer elements copied: the copy's launch is most of what it costs
MIN_M = 256  # fewer rows of the product: too little work per copied element
TF32_NMAJOR_SLOWDOWN = 2.5  # an N-major fp32 B under TF32: the tensor cores' rate divided by this (measured 2.4-4)
FORCE = False  # tests: copy every operand that qualifies, whatever the sizes and the model say


def enabled() -> bool:
    """Unless ``EQFUSE_KMAJOR`` says 0, false, off or no (a plan cache key holds this too)."""
    return switched_on(ENV)


def tf32_allowed() -> bool:
    """Whether float32 products run on TF32 tensor cores (KernelWriter.dot_precision)."""
    import torch
    return bool(torch.backends.cuda.matmul.allow_tf32)


def kmajor_operands(plan: Plan) -> None:
    """Rewrite ``plan`` in place: before each matmul kernel that qualifies (module
    docstring), the copies of its N-major right operands; the kernel reads them. Running it
    again changes nothing (the operands are K-major then)."""
    if not enabled() or not tf32_allowed():
        return

    def stages(kernel, buffers):
        parts = kmajor_kernel(kernel, buffers)
        return parts and (parts[0] + [parts[1]], parts[2])
    rewrite_kernels(plan, stages)


def kmajor_kernel(spec: KernelSpec, buffers: dict) -> tuple | None:
    """([copy kernels], the product reading them, [their Buffers]) for a matmul kernel whose
    TF32 products gain by K-major right operands, else None."""
    try:
        sched = schedules.schedule_of(spec)
    except Unschedulable:
        return None
    if sched.kind != "matmul" or sched.dot_dtype != "float32" or not tf32_allowed():
        return None
    dots = [n for n in spec.walk() if n.op == "dot"]
    rights = list({id(d.args[1]): d.args[1] for d in dots}.values())
    if not all(n_major(b, sched) for b in rights):
        return None  # one N-major product left in the loop would keep the kernel slow
    copied = sum(b.numel for b in rights)
    if not FORCE and (copied < MIN_ELEMENTS or sched.m < MIN_M):
        return None
    copies, product, new_buffers = build(spec, rights, buffers)
    if not FORCE and modelled_gain_us(sched, schedules.schedule_of(product), copied * 4, len(copies)) <= 0:
        return None
    try:  # the writers take them all, or the kernel stays as it was
        known = {**buffers, **{b.name: b for b in new_buffers}}
        for k in copies + [product]:
            kgen.generate_kernel(k, known)
    except Unschedulable:
        return None
    return copies, product, new_buffers


def n_major(node: PNode, sched: schedules.Schedule) -> bool:
    """Whether a right operand is a plain float32 read (index maps over a load) of as many
    elements as it has (a broadcast, a stride of 0 over the batch, would be copied once per
    matrix) whose address steps by one along N and not along K. With K or N of 1 the two
    layouts are one."""
    if sched.k < 2 or sched.n < 2:
        return False
    base = schedules.base_read(node)
    if base.op != "load" or base.dtype != "float32" or load_footprint(base) != node.numel:
        return False
    ((load, env),) = access.loads_at(node, schedules.matmul_envs(sched)[2])
    point = {"bindex": 0, "kindex_b": max(0, sched.k // 2 - 1), "nindex": max(0, sched.n // 2 - 1)}
    along_n = access.address_step(load, env, "nindex", point)
    return along_n == 1 and access.address_step(load, env, "kindex_b", point) != 1


def build(spec: KernelSpec, rights: list, buffers: dict) -> tuple:
    """The copy kernels, the product reading their buffers, and the buffers."""
    copies, new_buffers, reads = [], [], {}
    for i, b in enumerate(rights):
        name = spec.name + SUFFIX + (str(i) if i else "")
        perm = _swap_last(len(b.shape))
        shape = tuple(b.shape[:-2]) + (b.shape[-1], b.shape[-2])  # [..., N, K]
        buf = Buffer(fresh_buffer_name(f"buf_{name}", buffers, new_buffers), shape, "float32", "temp")
        root = PNode("permute", (perm,), (b,), shape, b.dtype)
        copies.append(KernelSpec(name, [(root, buf.name)], list(spec.fx_nodes)))
        new_buffers.append(buf)
        stored = PNode("load", (buf.name, contiguous_strides(shape), 0), (), shape, "float32")
        reads[id(b)] = PNode("permute", (perm,), (stored,), b.shape, b.dtype, b.eclass)
    product = KernelSpec(spec.name, [(substitute(root, reads), out) for root, out in spec.roots],
                         list(spec.fx_nodes))
    return copies, product, new_buffers


def _swap_last(ndim: int) -> tuple:
    """The permutation exchanging the last two dims (its own inverse)."""
    return tuple(range(ndim - 2)) + (ndim - 1, ndim - 2)


def fresh_buffer_name(base: str, buffers: dict, taken: list = ()) -> str:
    """``base``, or ``base_<k>``: a name neither ``buffers`` nor the ``taken`` Buffers have."""
    names = set(buffers) | {b.name for b in taken}
    k, out = 0, base
    while out in names:
        k += 1
        out = f"{base}_{k}"
    return out


def modelled_gain_us(before: schedules.Schedule, after: schedules.Schedule, copied_bytes: int, copies: int,
                     device: Device | None = None) -> float:
    """Modelled microseconds saved: the product with N-major right operands, less the
    product with K-major ones and the copies (read and written at the memory bandwidth,
    one launch each)."""
    device = device or device_model()
    slow = replace(device, tf32_flops_per_us=device.tf32_flops_per_us / TF32_NMAJOR_SLOWDOWN)
    slow_cfgs, cfgs = tiles.ranked(before, slow), tiles.ranked(after, device)
    if not slow_cfgs or not cfgs:
        return 0.0  # no tile fits: nothing to weigh
    n_major_us = tiles.modelled_time_us(before, slow_cfgs[0], slow)
    k_major_us = tiles.modelled_time_us(after, cfgs[0], device)
    copy_us = 2 * copied_bytes / device.bandwidth_bytes_per_us + copies * device.launch_us
    return n_major_us - k_major_us - copy_us
