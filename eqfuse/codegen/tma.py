"""Tensor-descriptor (TMA) tiles for matmul kernels on Hopper and later GPUs.

The TMA form of a matmul: operand tiles fetched by the TMA unit, a persistent loop over
output tiles (one program per SM; ``tl.range(..., flatten=True)`` lets the pipeliner fetch
the next tile's operands during this tile's epilogue), the output tile stored by TMA in
two halves. Measured on H100s (benchmarks/matmul_tma_probe.py and the autotuner's trials in
benchmarks/results/), against one program per tile with pointer loads, same tiles: for
gelu(x@W+b) at 8192x4096x4096 fp16, 10%, 3% and 1.6% faster in three separate GPU
sessions and even (466.3 against 466.1 us) in a fourth; for plain square fp16/bf16
matmuls within +-2.5% either way; for two products in one loop 32% slower (not offered).
The autotuner times both forms and keeps the faster. The same persistent loop with
pointer loads was 2.4x slower.

A descriptor describes a 2-D box of a buffer: ``shape`` (outer, inner), the outer stride,
the inner stride 1. The TMA unit wants the base address and the outer stride in multiples
of 16 bytes; reads past the box's edges come back as zeros and writes past them are
dropped, so ragged M, N and K need no masks. An operand qualifies when it is a plain read
of a buffer (no prologue; index maps only) whose tile index is affine in the kernel's row
and K indices, with one of the two strides 1. The base address is only known at launch:
the launcher checks it and runs the one-program-per-tile kernel where it is not aligned.

A batched product's operands and output are 3-D boxes ``[batch, outer, inner]`` with a
block of one matrix along the batch: every dim is bounded on its own, so a ragged tile
reads zeros past its own matrix's edge, never the next matrix's rows (a 2-D box of
``[batch * rows, inner]`` would, wherever the rows are not a multiple of the block). The
batch dims must fold into one index (their strides compose, as for a contiguous
``[b, h]``), at a stride of 16 bytes' multiple; an operand the batch does not move (a
weight broadcast over it) stays a 2-D box. Measured on an H100 (256 x [2048 x 128] @
[128 x 2048] fp16, Llama's attention scores with a causal where/scale epilogue computed
from the indices): the generated kernel in the model's first choice (128 x 256 x 64 tiles)
916 us, the same tiles one program per tile 1510, the best such config 1228, cuBLAS's
product alone 887; at K = 2048 (P @ V) the form was 1-5% slower than one program per tile.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ALIGN = 16  # bytes: TMA base addresses and outer strides


@dataclass(frozen=True)
class Box:
    """A buffer seen as a 2-D row-major box for a descriptor."""
    buf: str
    offset: int  # elements from the buffer's start
    shape: tuple  # (outer, inner) extents
    stride: int  # outer stride in elements (the inner one is 1)
    inner: str  # the kernel index running along the contiguous dim, e.g. "kindex_a"
    batch: tuple | None = None  # (stride, extent) of the batch index, where the box is 3-D


def atom_strides(env, strides, shape) -> dict | None:
    """{kernel index: (element stride, extent)} where the offset of the point ``env`` in a
    tensor of ``shape`` laid out with ``strides`` is affine in each kernel index (the sum
    of index * stride); None where it is not, or where the environment cannot tell."""
    if env.groups is None or env.guard is not None:
        return None
    digits: dict = {}
    for group, stride, size in zip(env.groups, strides, shape):
        if size == 1 or stride == 0:  # the address does not move along it (a batch broadcast)
            continue
        scale = 1
        for d in reversed(group):  # inner digit first
            digits.setdefault(d.atom.expr, []).append((d.lo, d.size, stride * scale, d.extent))
            scale *= d.size
    out = {}
    for atom, parts in digits.items():
        parts.sort()
        lo, first = 1, parts[0][2]
        for dlo, size, stride, _ in parts:
            # digit (atom // lo) % size at stride lo * first: together, atom * first
            if dlo != lo or stride != first * lo:
                return None
            lo *= size
        if lo != parts[0][3] or first == 0:
            return None
        out[atom] = (first, lo)
    return out


def box(buf: str, itemsize: int, offset: int, affine: dict | None, outer: str, inner_k: str,
        batch: str | None = None) -> Box | None:
    """The box through which a tile indexed by ``outer`` (a row index) and ``inner_k`` (the
    other index), in the matrix ``batch`` (a batch index, if any) picks, reads or writes
    ``buf``, if TMA can: exactly those indices (the batch one may be missing: a matrix
    shared by the batch), one of the two tile indices at stride 1, every other stride and
    the offset multiples of 16 bytes."""
    if affine is None or not {outer, inner_k} <= set(affine) <= {outer, inner_k, batch}:
        return None
    (s_row, n_row), (s_k, n_k) = affine[outer], affine[inner_k]
    if s_k == 1:
        b = Box(buf, offset, (n_row, n_k), s_row, inner_k, affine.get(batch))
    elif s_row == 1:
        b = Box(buf, offset, (n_k, n_row), s_k, outer, affine.get(batch))
    else:
        return None
    strides = (b.stride,) + ((b.batch[0],) if b.batch else ())
    if any((st * itemsize) % ALIGN for st in strides) or (offset * itemsize) % ALIGN or b.stride < b.shape[1]:
        return None
    return b


def sm_count() -> int:
    """Streaming multiprocessors of the current GPU (the model's figure without one)."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    except Exception:  # noqa: BLE001 - no usable CUDA
        pass
    from ..rewrite.cost import device_model
    return device_model().sms


def device_supports() -> bool:
    """Whether generated matmuls may take the TMA form here: a CUDA GPU of compute
    capability 9.0 or more, compiled (not Triton's CPU interpreter, which runs the form
    too but is where the one-program-per-tile kernel is the reference)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    try:
        import torch
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    except Exception:  # noqa: BLE001 - no usable CUDA: no TMA
        return False
