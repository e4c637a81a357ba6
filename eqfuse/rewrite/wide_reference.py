"""The ops that cannot run a graph widened to float64, made to, for validation's reference.

Validation judges a plan computed from half-precision values against the graph run with
its float inputs in float64 (``validate._wide_outputs``): in half precision a gradient
that is zero in exact arithmetic is rounding noise in eager and in the plan alike, two
noises of one size, so their relative difference is about sqrt(2) (a key projection's
bias gradient: softmax ignores a shift of a row's scores). Where one op of the graph could
not run widened, there was no reference, and a plan as good as eager fell back to eager
(ViT's training backward on an H200). Within ``WideReference``, ``STAND_INS`` run them:

- The fused attention kernels of a GPU graph (cuDNN's, flash, memory-efficient, with their
  backwards) take half precision only: they compute as math in their inputs' dtype
  (scores, softmax, the weighted sum, and the backward from those, recomputed rather than
  read from the narrow forward's log-sum-exp). Dropout has no exact counterpart (the
  kernel's random draws): such a call raises ``NoStandIn``, and no reference is made.
- ``_grouped_mm`` (a mixture of experts' experts) takes bfloat16 only: a product per group.
- Softmax's backwards name the forward input's dtype (half) and CUDA's kernel then wants a
  float32 gradient: they are told the dtype their widened gradient has.
- The graph's own casts (to half precision, or a norm's to float32) round the value there,
  and the result comes back widened, so that no op meets operands of two dtypes.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten

# Elements of one block of scores: queries are taken in blocks of rows so that a long
# sequence's float64 scores (batch 8 x 32 heads x 2048 x 2048 is 8 GiB) never exist whole
SCORE_ELEMENTS = 1 << 24


class NoStandIn(RuntimeError):
    """The call has no exact stand-in (dropout)."""


def _scores(q, k, bias, causal: bool, scale: float, rows: slice):
    """Softmax of the scores of query rows ``rows`` (0 where a row has no key left)."""
    s = (q[..., rows, :] @ k.transpose(-2, -1)) * scale
    if bias is not None:
        b = bias[..., rows, :] if bias.dim() >= 2 and bias.shape[-2] != 1 else bias
        s = s.masked_fill(~b, float("-inf")) if b.dtype == torch.bool else s + b.to(s.dtype)
    if causal:  # SDPA's is_causal: query i sees keys 0..i, aligned at the top left
        i = torch.arange(rows.start, rows.stop, device=s.device).unsqueeze(-1)
        s = s.masked_fill(torch.arange(s.shape[-1], device=s.device) > i, float("-inf"))
    empty = torch.isneginf(s.amax(-1, keepdim=True))
    return torch.where(empty, 0.0, torch.softmax(s, -1))


def _grouped(q, k, v):
    """``k`` and ``v`` repeated to ``q``'s heads (grouped-query attention), and the group size."""
    group = q.shape[-3] // k.shape[-3]
    if group == 1:
        return k, v, 1
    return k.repeat_interleave(group, -3), v.repeat_interleave(group, -3), group


def _row_blocks(q, k):
    per_row = max(1, q[..., 0, 0].numel() * k.shape[-2])
    step = max(1, SCORE_ELEMENTS // per_row)
    return [slice(r, min(r + step, q.shape[-2])) for r in range(0, q.shape[-2], step)]


def _scale(q, scale):
    return scale if scale is not None else q.shape[-1] ** -0.5


def attention(q, k, v, bias=None, causal=False, scale=None, dropout_p=0.0):
    """The output and the log-sum-exp's stand-in (zeros: no backward here reads it)."""
    if dropout_p:
        raise NoStandIn("attention with dropout")
    k, v, _ = _grouped(q, k, v)
    out = torch.cat([_scores(q, k, bias, causal, _scale(q, scale), rows) @ v for rows in _row_blocks(q, k)], -2)
    return out, q.new_zeros(q.shape[:-1])


def attention_backward(grad, q, k, v, bias=None, causal=False, scale=None, dropout_p=0.0):
    """The gradients of ``attention`` with respect to q, k and v, at output gradient ``grad``."""
    if dropout_p:
        raise NoStandIn("attention with dropout")
    kk, vv, group = _grouped(q, k, v)
    scale = _scale(q, scale)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(kk), torch.zeros_like(vv)
    for rows in _row_blocks(q, kk):
        p = _scores(q, kk, bias, causal, scale, rows)
        g = grad[..., rows, :]
        dp = g @ vv.transpose(-2, -1)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # softmax's backward, row by row
        dq[..., rows, :] = ds @ kk * scale
        dk += ds.transpose(-2, -1) @ q[..., rows, :] * scale
        dv += p.transpose(-2, -1) @ g
    if group > 1:  # each kv head's gradient sums its query heads'
        dk, dv = (t.unflatten(-3, (k.shape[-3], group)).sum(-3) for t in (dk, dv))
    return dq, dk, dv


def _named(func, args, kwargs) -> dict:
    """The call's arguments by their schema names (defaults filled in)."""
    named = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            named[a.name] = args[i]
        elif a.name in kwargs:
            named[a.name] = kwargs[a.name]
        elif a.has_default_value():
            named[a.name] = a.default_value
    return named


def _bias(a):
    """The call's additive bias or mask (``attn_bias``, the CPU kernel's ``attn_mask``),
    None where it has none (a backward passes an empty tensor)."""
    bias = a.get("attn_bias", a.get("attn_mask"))
    return bias if bias is not None and bias.numel() else None


# op -> its stand-in on the named arguments, returning what the op returns
def _attention(a):
    return attention(a["query"], a["key"], a["value"], _bias(a), a["is_causal"], a["scale"], a["dropout_p"])


def _cudnn_or_flash(a):
    out, lse = _attention(a)
    empty = out.new_empty(0)
    return out, lse, empty, empty, 0, 0, empty, empty, empty


def _efficient(a):
    out, lse = _attention(a)
    empty = out.new_empty(0)
    return out, lse, empty, empty


def _backward(a):
    grad = a["grad_out"] if "grad_out" in a else a["grad_out_"]
    return attention_backward(grad, a["query"], a["key"], a["value"], _bias(a), a["is_causal"], a["scale"],
                              a["dropout_p"])


def _efficient_backward(a):
    dq, dk, dv = _backward(a)
    if a["grad_input_mask"][3]:
        raise NoStandIn("the gradient of an attention bias")
    return dq, dk, dv, None


def _softmax_backward(op):
    def run(a):
        return op(a["grad_output"], a["output"], a["dim"], a["grad_output"].dtype)
    return run


def _grouped_mm(a):
    """``_grouped_mm`` (a mixture of experts' experts; CUDA's kernel takes bfloat16 only) as
    one product per group: a 2-D operand's rows (its columns, against a 2-D right operand:
    the weight gradient) cut at ``offs``, each group's ends; rows past the last are zero."""
    x, w, offs, bias = a["self"], a["mat2"], a["offs"], a["bias"]
    if offs is None:
        out = x @ w  # 3-D by 3-D: a batch
    else:
        ends = offs.tolist()
        groups = list(zip([0, *ends[:-1]], ends))
        if x.dim() == 2 and w.dim() == 3:
            out = x.new_zeros(x.shape[0], w.shape[-1])
            for g, (start, end) in enumerate(groups):
                out[start:end] = x[start:end] @ w[g]
        elif x.dim() == 2 and w.dim() == 2:
            out = torch.stack([x[:, start:end] @ w[start:end] for start, end in groups])
        else:
            raise NoStandIn(f"_grouped_mm of {x.dim()}-D by {w.dim()}-D operands")
    return out if bias is None else out + bias


STAND_INS = {
    aten._grouped_mm.default: _grouped_mm,
    aten._scaled_dot_product_cudnn_attention.default: _cudnn_or_flash,
    aten._scaled_dot_product_cudnn_attention_backward.default: _backward,
    aten._scaled_dot_product_flash_attention.default: _cudnn_or_flash,
    aten._scaled_dot_product_flash_attention_backward.default: _backward,
    aten._scaled_dot_product_efficient_attention.default: _efficient,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _backward,
    aten._softmax_backward_data.default: _softmax_backward(aten._softmax_backward_data.default),
    aten._log_softmax_backward_data.default: _softmax_backward(aten._log_softmax_backward_data.default),
}


def _laid_out_as_the_kernel(func, args, kwargs, out):
    """A stand-in's results in the strides the kernel gives its own (found on meta tensors
    of the narrow dtype the kernel takes): the graph's views after the call were traced on
    those (cuDNN attention's output, heads inside rows, viewed as [batch, sequence, width])."""
    def meta(t):
        dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")
    try:
        meta_args, meta_kwargs = tree_map_only(torch.Tensor, meta, (args, kwargs))
        like = func(*meta_args, **meta_kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel: the stand-in's own layout
        return out
    flat_out, flat_like = ((x,) if isinstance(x, torch.Tensor) else tuple(x) for x in (out, like))

    def laid(o, k):
        if not (isinstance(o, torch.Tensor) and isinstance(k, torch.Tensor)) or o.shape != k.shape \
                or o.stride() == k.stride() or o.numel() == 0:
            return o
        return torch.empty_strided(k.shape, k.stride(), dtype=o.dtype, device=o.device).copy_(o)
    laid_out = [laid(o, k) for o, k in zip(flat_out, flat_like)] + list(flat_out[len(flat_like):])
    return laid_out[0] if isinstance(out, torch.Tensor) else type(out)(laid_out)


class WideReference(TorchDispatchMode):
    """Within it, the ops of ``STAND_INS`` run by their stand-ins, and every op's float
    outputs of another dtype than ``dtype`` come back in ``dtype``: where the graph casts
    to half precision or float32 (a norm's upcast, a loss's), the value is rounded there
    as the graph rounds it, and the ops after see ``dtype`` again (a product of a cast
    value and a widened weight would otherwise have operands of two dtypes)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stand_in = STAND_INS.get(func)
        if stand_in is None:
            out = func(*args, **(kwargs or {}))
        else:
            out = _laid_out_as_the_kernel(func, args, kwargs or {}, stand_in(_named(func, args, kwargs or {})))
        return tree_map_only(torch.Tensor, self._widened, out)

    def _widened(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.is_floating_point() and t.dtype != self.dtype else t
