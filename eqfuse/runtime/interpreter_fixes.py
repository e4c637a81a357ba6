"""Corrections to Triton's CPU interpreter, applied when eqfuse runs kernels in it.

The generated source is the same on the CPU and the GPU; where the interpreter computes
something the GPU does not, it is corrected here rather than worked around in the source.

* triton 3.6: the interpreter keeps bfloat16 values as their raw 16 bits (uint16), and
  - ``tl.dot`` multiplies those bits as integers. A bfloat16 operand is widened to float32
    first (exact), which is what the tensor cores compute with;
  - a cast between bfloat16 and anything but float32 converts the bits as a number. Such a
    cast goes through float32 (exact for bfloat16, and how the GPU rounds);
  - a cast from float32 to bfloat16 truncates the mantissa, where the GPU (and torch)
    round to nearest even. Truncation always errs towards zero, so its errors add up
    instead of cancelling (bf16 gradients of a BERT layer came out 2-6x less accurate than
    eager's on the CPU only). The cast rounds here as on the GPU;
  - a cast from bfloat16 to float32 renormalises a denormal's mantissa into an exponent
    below the range and clamps it (-3.03e-39 became -3.67e-40; the random-graph fuzzer's
    special values found it). It is the bits moved up 16 places, exact, as on the GPU.
* triton 3.6: a scalar computed with ``tl.minimum`` / ``tl.maximum`` is a one-element array
  that ``range`` cannot take as a bound (attention's loop over the columns a causal mask
  leaves). Such a scalar converts to an index through its one element.
"""

from __future__ import annotations

_applied = False


def _round_to_bfloat16(values):
    """float32 array -> bfloat16 bits (uint16), rounded to nearest, ties to even; NaN stays NaN."""
    import numpy as np
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    half_up = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = ((bits + half_up) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), out)


def apply() -> None:
    global _applied
    if _applied:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            bits = (h.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(bits, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot

    cast = builder.cast_impl
    f32 = tl.float32

    def cast_impl(self, src, dst_type):
        a, b = src.dtype.scalar, dst_type.scalar
        if a == f32 and b == tl.bfloat16:
            return interpreter.TensorHandle(_round_to_bfloat16(src.data), tl.bfloat16)
        if a == tl.bfloat16 and b == f32:
            return widen(src)
        if tl.bfloat16 in (a, b) and f32 not in (a, b) and a != b:
            return cast(self, cast(self, src, f32), dst_type)
        return cast(self, src, dst_type)

    builder.cast_impl = cast_impl

    patch_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor
    _applied = True
