"""Arithmetic written in other ops: round to decimals, angle, addbmm, dist, pow of tensors,
ldexp, frexp, cdist, pdist."""

from __future__ import annotations

import math

import torch

from . import bounds

aten = torch.ops.aten


def _round_decimals(x, *, decimals):
    """``round(x, decimals=d)`` as ATen computes it: by the power of ten in ``x``'s dtype,
    multiplied (d > 0) or divided (d < 0), rounded half to even, then undone (float32:
    narrower dtypes round there in their own width)."""
    if x.dtype != torch.float32:
        return NotImplemented
    scale = float(torch.tensor(10.0 ** abs(decimals), dtype=torch.float32))
    return torch.round(x / scale) * scale if decimals < 0 else torch.round(x * scale) / scale


def _angle(x):
    """``angle`` of real numbers: pi below zero (not at -0.0), NaN at NaN, else 0."""
    if x.is_complex():
        return NotImplemented
    real = x if x.is_floating_point() else x.to(torch.get_default_dtype())
    pi = torch.where(real < 0, math.pi, 0.0).to(real.dtype)
    return torch.where(real.isnan(), real, pi)


def _addbmm(x, batch1, batch2, *, beta=1, alpha=1):
    """``addbmm``: the sum of the batch's products is one product over the batch and the
    shared dim together; ``beta * x`` added (nothing of ``x``, NaN included, where beta is 0)."""
    if not x.is_floating_point():
        return NotImplemented
    product = batch1.transpose(0, 1).reshape(batch1.shape[1], -1) @ batch2.reshape(-1, batch2.shape[2])
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return (x * beta if beta != 1 else x) + product


def _dist(x, other, p=2):
    """``dist``: the p-norm of the difference (torch's vector norm, decomposed)."""
    return torch.linalg.vector_norm(x - other, p)


def _pow_tensors(x, y):
    """``pow`` of a tensor to a tensor power with a float result, as C's pow (eager's):
    the magnitude exp2(y log2|x|), within a few ulps of powf (the product's rounding times
    the result's exponent); negative where x is negative (or -0.0) and y an odd integer;
    NaN where a finite negative x meets a finite y that is no integer; 1 where y is 0 or x
    is 1 (NaN included) and where |x| is 1 and y infinite. Computed in float32 (float64
    for float64) and rounded once to the result's dtype."""
    dtype = torch.result_type(x, y)
    if not dtype.is_floating_point:
        return NotImplemented
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    x, y = x.to(wide), y.to(wide)
    size = x.abs()
    magnitude = torch.exp2(y * torch.log2(size))
    integer = torch.trunc(y) == y
    odd = integer & (y - 2 * torch.floor(y * 0.5) == 1)
    out = torch.where(torch.signbit(x) & odd, -magnitude, magnitude)
    out = torch.where((x < 0) & torch.isfinite(x) & torch.isfinite(y) & ~integer, math.nan, out)
    return torch.where((y == 0) | (x == 1) | ((size == 1) & torch.isinf(y)), 1.0, out).to(dtype)


def _ldexp(x, other):
    """``ldexp`` of a float32 or half-precision ``x`` by integer exponents, exact as eager's
    (a true ldexp, not ``x * 2.0 ** other``: ldexp(0, 140) is 0, ldexp(1e-40, 140) finite,
    ldexp(inf, -200) inf): in float32, ``x`` times three powers of two that are each a
    normal float (the exponent clamped to +-300, past which every result is an infinity,
    a zero, or x's infinity or NaN as at +-300), rounded once to x's dtype."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or other.is_floating_point() \
            or other.dtype == torch.bool or torch.result_type(x, other) != x.dtype:
        return NotImplemented
    e = other.clamp(-300, 300)
    a = torch.div(e, 3, rounding_mode="trunc")
    b = torch.div(e - a, 2, rounding_mode="trunc")
    out = x.float()
    for part in (a, b, e - a - b):
        out = out * torch.exp2(part.float())
    return out.to(x.dtype)


def _frexp(x):
    """``frexp``: x as a mantissa of magnitude in [0.5, 1), of x's sign, times 2 to an
    int32 exponent; a zero, an infinity or a NaN is its own mantissa, with exponent 0 (as
    C's frexp in glibc, which eager calls). The exponent from log2|x| (within one of the
    true one, a denormal's included), corrected by the exact ldexp of x by its negation."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return NotImplemented
    wide = x.float()
    special = (wide == 0) | ~wide.isfinite()
    e = torch.where(special, 0.0, torch.floor(torch.log2(wide.abs())) + 1).to(torch.int32)
    m = _ldexp(wide, -e)
    e = e + ((m.abs() >= 1).to(torch.int32) - (m.abs() < 0.5).to(torch.int32)) * (~special).to(torch.int32)
    return torch.where(special, wide, _ldexp(wide, -e)).to(x.dtype), e


def _cdist(x1, x2, p, compute_mode=None):
    """``cdist``: the p-norm of each pair's difference (a reduction over the broadcast
    differences, computed directly: eager's products for large Euclidean inputs
    (``compute_mode``) round otherwise, and validation judges them). Pairs times the
    width past bounds.CUMSUM_WORK, and p of 0 or inf (eager's NaN there is its own), stay ATen's."""
    if not x1.is_floating_point() or not 0 < p < math.inf or x1.shape[-2] * x2.shape[-2] * x1.shape[-1] * math.prod(
            torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])) > bounds.CUMSUM_WORK:
        return NotImplemented
    return torch.linalg.vector_norm(x1.unsqueeze(-2) - x2.unsqueeze(-3), p, dim=-1)


def _pdist(x, p=2.0):
    """``pdist``: each pair i < j of the rows' distance, in order (the pairs read from the
    square of distances, an indexed read)."""
    made = _cdist(x, x, p)
    if made is NotImplemented:
        return made
    n = x.shape[0]
    pairs = torch.tensor([i * n + j for i in range(n) for j in range(i + 1, n)], dtype=torch.int64, device=x.device)
    return made.reshape(-1)[pairs]
