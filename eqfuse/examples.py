"""The built-in examples: plain PyTorch functions, each with an input factory and the
number of kernels eqfuse should make of it. ``eqfuse demo`` and the tests use them.

``EXAMPLES`` work row by row (inputs made from ``rows, cols``); ``MATMUL_EXAMPLES`` are
matrix products (inputs made from ``m, n, k``); ``ATTENTION_EXAMPLES`` are attention
spelled in the ways people write it (inputs made from ``batch, heads, seq, head_dim``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def vector_add(x, y):
    return x + y


def add_constant(x):
    return x + 3.5


def outer_add(a, b):
    return a[:, None] + b[None, :]


def mul_relu(x, y):
    return torch.relu(x * y)


def softmax(x):
    return torch.softmax(x, dim=-1)


def causal_softmax(scores):
    n = scores.shape[-1]
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool, device=scores.device))
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


def rmsnorm(x, weight):
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return out.to(x.dtype) * weight


def residual_layernorm(x, residual, weight, bias):
    h = x + residual
    return h, F.layer_norm(h, (h.shape[-1],), weight, bias, eps=1e-5)


def swiglu(a, b):
    return F.silu(a) * b


def gelu(x):
    return F.gelu(x)


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def log_softmax(x):
    return torch.log_softmax(x, dim=-1)


def matmul(a, b):
    return a @ b


def linear_gelu(x, w, b):
    return F.gelu(x @ w + b)


def linear_residual(x, w, b, residual):
    return F.linear(x, w, b) + residual


def swiglu_mlp(x, w1, w3, w2):
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def attention_scores(q, k):
    return (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])


INT4_GROUP = 32  # weights per scale and zero point, along K


def int4_matmul(x, packed, scale, zero):
    """x @ W where W [K, N] is stored as 4-bit integers, 8 per int32 along K
    (``packed`` [K/8, N]), with a scale and a zero point per group of 32 rows."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    q = q.reshape(-1, packed.shape[-1]).to(x.dtype)  # [K, N]
    k, n = q.shape
    groups = k // scale.shape[0]

    def per_row(t):
        return t[:, None, :].expand(t.shape[0], groups, n).reshape(k, n)
    return x @ ((q - per_row(zero)) * per_row(scale))


# --- attention, spelled the ways people write it ----------------------------------------------
# q, k, v are [batch, heads, seq, head_dim]; each must become one streamed kernel.

def _causal_mask(s):
    n = s.shape[-1]
    return torch.tril(torch.ones(s.shape[-2], n, dtype=torch.bool, device=s.device))


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def attention_scale_on_q(q, k, v):
    return torch.softmax((q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2), dim=-1) @ v


def attention_scale_split(q, k, v):
    """The scale split between q and k as the square root of it on each."""
    s = q.shape[-1] ** -0.25
    return torch.softmax((q * s) @ (k * s).transpose(-1, -2), dim=-1) @ v


def causal_attention(q, k, v):
    """tril + masked_fill, softmax in float32 and rounded back for the second product."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~_causal_mask(s), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def causal_attention_where(q, k, v):
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    return torch.softmax(torch.where(_causal_mask(s), s, float("-inf")), dim=-1) @ v


def causal_attention_bias(q, k, v):
    """An additive bias of -inf above the diagonal, built by comparing index ranges."""
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    bias = torch.zeros(n, n, dtype=q.dtype, device=q.device).masked_fill(i[None, :] > i[:, None], float("-inf"))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return torch.softmax(s, dim=-1) @ v


def padded_attention(q, k, v, keep):
    """A padding mask given as a tensor: ``keep`` [batch, 1, 1, seq] is False on padding."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1) @ v


def gqa_attention(q, k, v):
    """Grouped-query attention: k and v have fewer heads, repeated for each group of q's."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v[:, :, None].expand(v.shape[0], v.shape[1], groups, *v.shape[2:]).reshape(k.shape)
    return causal_attention(q, k, v)


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_bool_causal(q, k, v):
    """The causal mask as a bool tensor (transformers passes one under torch.compile)."""
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@dataclass(frozen=True)
class Example:
    name: str
    fn: Callable
    make_inputs: Callable  # (*demo_shape, dtype, device) -> tuple of tensors
    kernels: int  # expected kernel count (at most, for matmul examples)
    demo_shape: tuple = (64, 1000)


def _x(rows, cols, dtype, device):
    return (torch.randn(rows, cols, dtype=dtype, device=device),)


def _xy(rows, cols, dtype, device):
    return tuple(torch.randn(rows, cols, dtype=dtype, device=device) for _ in range(2))


def _square(rows, cols, dtype, device):
    return (torch.randn(cols, cols, dtype=dtype, device=device),)


def _outer(rows, cols, dtype, device):
    return (torch.randn(rows, dtype=dtype, device=device), torch.randn(cols, dtype=dtype, device=device))


def _rms(rows, cols, dtype, device):
    return (torch.randn(rows, cols, dtype=dtype, device=device),
            torch.rand(cols, dtype=dtype, device=device) + 0.5)


def _ln(rows, cols, dtype, device):
    return (torch.randn(rows, cols, dtype=dtype, device=device),
            torch.randn(rows, cols, dtype=dtype, device=device),
            torch.rand(cols, dtype=dtype, device=device) + 0.5,
            torch.randn(cols, dtype=dtype, device=device))


def _weights(k, n, dtype, device):
    return (torch.randn(k, n, device=device) / math.sqrt(max(k, 1))).to(dtype)


def _mm(m, n, k, dtype, device):
    return torch.randn(m, k, dtype=dtype, device=device), _weights(k, n, dtype, device)


def _linear_gelu(m, n, k, dtype, device):
    return (*_mm(m, n, k, dtype, device), torch.randn(n, dtype=dtype, device=device))


def _linear_residual(m, n, k, dtype, device):
    return (torch.randn(m, k, dtype=dtype, device=device), _weights(n, k, dtype, device),
            torch.randn(n, dtype=dtype, device=device), torch.randn(m, n, dtype=dtype, device=device))


def _swiglu_mlp(m, n, k, dtype, device):
    return (torch.randn(m, k, dtype=dtype, device=device), _weights(k, n, dtype, device),
            _weights(k, n, dtype, device), _weights(n, k, dtype, device))


def _scores(m, n, k, dtype, device):
    return (torch.randn(2, 3, m, k, dtype=dtype, device=device), torch.randn(2, 3, n, k, dtype=dtype, device=device))


def _int4(m, n, k, dtype, device):
    """K is rounded up to a whole number of groups."""
    k = max(INT4_GROUP, -(-k // INT4_GROUP) * INT4_GROUP)
    nibbles = torch.randint(0, 16, (k // 8, 8, n), dtype=torch.int32, device=device)
    packed = (nibbles << (4 * torch.arange(8, dtype=torch.int32, device=device))[None, :, None]).sum(1)
    packed = packed.to(torch.int32)
    scale = (torch.rand(k // INT4_GROUP, n, device=device) * 0.02 + 0.01).to(dtype)
    zero = torch.full((k // INT4_GROUP, n), 8.0, device=device).to(dtype)
    return torch.randn(m, k, dtype=dtype, device=device), packed, scale, zero


def _qkv(batch, heads, seq, head_dim, dtype, device, kv_heads=None):
    kv = kv_heads or heads
    return (torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device),
            torch.randn(batch, kv, seq, head_dim, dtype=dtype, device=device),
            torch.randn(batch, kv, seq, head_dim, dtype=dtype, device=device))


def _qkv_padded(batch, heads, seq, head_dim, dtype, device):
    lengths = torch.arange(batch, device=device) * seq // max(batch, 1) + max(1, seq // 2)
    keep = torch.arange(seq, device=device)[None, :] < lengths.clamp(max=seq)[:, None]
    return (*_qkv(batch, heads, seq, head_dim, dtype, device), keep[:, None, None, :])


def _qkv_grouped(batch, heads, seq, head_dim, dtype, device):
    return _qkv(batch, heads, seq, head_dim, dtype, device, kv_heads=max(1, heads // 2))


ATTENTION_EXAMPLES: dict[str, Example] = {e.name: e for e in [
    Example("attention", attention, _qkv, 1, (2, 4, 128, 64)),
    Example("attention_scale_on_q", attention_scale_on_q, _qkv, 1, (2, 4, 128, 64)),
    Example("attention_scale_split", attention_scale_split, _qkv, 1, (2, 4, 128, 64)),
    Example("causal_attention", causal_attention, _qkv, 1, (2, 4, 128, 64)),
    Example("causal_attention_where", causal_attention_where, _qkv, 1, (2, 4, 128, 64)),
    Example("causal_attention_bias", causal_attention_bias, _qkv, 1, (2, 4, 128, 64)),
    Example("padded_attention", padded_attention, _qkv_padded, 1, (2, 4, 128, 64)),
    Example("gqa_attention", gqa_attention, _qkv_grouped, 1, (2, 4, 128, 64)),
    Example("sdpa_causal", sdpa_causal, _qkv, 1, (2, 4, 128, 64)),
    Example("sdpa_bool_causal", sdpa_bool_causal, _qkv, 1, (2, 4, 128, 64)),
]}


MATMUL_EXAMPLES: dict[str, Example] = {e.name: e for e in [
    Example("matmul", matmul, _mm, 1, (256, 256, 256)),
    Example("linear_gelu", linear_gelu, _linear_gelu, 1, (256, 256, 256)),
    Example("linear_residual", linear_residual, _linear_residual, 1, (256, 256, 256)),
    Example("swiglu_mlp", swiglu_mlp, _swiglu_mlp, 2, (128, 352, 128)),
    Example("attention_scores", attention_scores, _scores, 1, (128, 128, 64)),
    Example("int4_matmul", int4_matmul, _int4, 1, (64, 256, 256)),
]}


EXAMPLES: dict[str, Example] = {e.name: e for e in [
    Example("vector_add", vector_add, _xy, 1),
    Example("add_constant", add_constant, _x, 1),
    Example("outer_add", outer_add, _outer, 1),
    Example("mul_relu", mul_relu, _xy, 1),
    Example("softmax", softmax, _x, 1),
    Example("causal_softmax", causal_softmax, _square, 1, (1, 100)),
    Example("rmsnorm", rmsnorm, _rms, 1),
    Example("residual_layernorm", residual_layernorm, _ln, 1),
    Example("swiglu", swiglu, _xy, 1),
    Example("gelu", gelu, _x, 1),
    Example("gelu_tanh", gelu_tanh, _x, 1),
    Example("log_softmax", log_softmax, _x, 1),
]}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing a fused kernel with eager PyTorch."""
    return {torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 1e-2),
            torch.bfloat16: (5e-2, 5e-2), torch.float64: (1e-7, 1e-9)}.get(dtype, (0, 0))


def contraction_tolerance(dtype: torch.dtype, ref: torch.Tensor) -> tuple[float, float]:
    """(rtol, atol) for an output that sums many products (a matmul): its rounding error
    scales with the largest output, not with each element, so atol is relative to that."""
    rtol, atol = tolerance(dtype)
    if ref.numel():
        atol = max(atol, rtol * ref.float().abs().nan_to_num(0, 0, 0).max().item())
    return rtol, atol


def matches(got, ref, contraction: bool = False, dtype: torch.dtype | None = None) -> bool:
    """Compiled outputs against eager's: same shapes, values within the tolerance of
    ``dtype`` (each output's own by default); NaN where eager has NaN."""
    got = got if isinstance(got, tuple) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for g, r in zip(got, ref):
        dt = dtype or r.dtype
        rtol, atol = contraction_tolerance(dt, r) if contraction else tolerance(dt)
        if g.shape != r.shape or not torch.allclose(g.float(), r.float(), rtol=rtol, atol=atol, equal_nan=True):
            return False
    return True


ALL_EXAMPLES: dict[str, Example] = {**EXAMPLES, **MATMUL_EXAMPLES, **ATTENTION_EXAMPLES}

__all__ = ["ALL_EXAMPLES", "ATTENTION_EXAMPLES", "EXAMPLES", "MATMUL_EXAMPLES", "Example", "contraction_tolerance",
           "math", "matches", "tolerance"]
