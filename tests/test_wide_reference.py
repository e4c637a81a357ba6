"""Validation's stand-ins for ops that cannot run widened (rewrite/wide_reference.py): each fused attention
op, called with its own arguments under ``WideReference``, gives what autograd through
plain float64 attention gives, in blocks of query rows too; dropout has none. And a graph
of such ops (no CPU kernel, no float64 one) has a float64 reference for validation."""

import pytest
import torch
import torch.nn.functional as F

from eqfuse.rewrite import validate, wide_reference
from eqfuse.rewrite.wide_reference import NoStandIn, WideReference

aten = torch.ops.aten
B, HQ, L, S, E = 2, 4, 7, 9, 8


def _case(heads_kv=HQ, bias=None, causal=False):
    g = torch.Generator().manual_seed(3)  # on the CPU: the stand-ins' math is the same everywhere
    q = torch.randn(B, HQ, L, E, generator=g, dtype=torch.float64, device="cpu")
    k, v = (torch.randn(B, heads_kv, S, E, generator=g, dtype=torch.float64, device="cpu") for _ in range(2))
    grad = torch.randn(B, HQ, L, E, generator=g, dtype=torch.float64, device="cpu")
    mask = {None: None, "float": torch.randn(B, 1, L, S, generator=g, dtype=torch.float64, device="cpu"),
            "bool": torch.rand(L, S, generator=g, device="cpu") > 0.3}[bias]
    return q, k, v, grad, mask


def _autograd(q, k, v, grad, mask, causal, scale=None):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return (out.detach(), *torch.autograd.grad(out, leaves, grad))


CASES = {"plain": {}, "causal": {"causal": True}, "float bias": {"bias": "float"}, "bool mask": {"bias": "bool"},
         "grouped query": {"heads_kv": 2}}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block", [None, 2 * S])  # whole, and two query rows at a time
def test_stand_in_math_is_autograd_through_plain_attention(case, block, monkeypatch):
    if block:
        monkeypatch.setattr(wide_reference, "SCORE_ELEMENTS", B * HQ * block)
    spec = CASES[case]
    q, k, v, grad, mask = _case(spec.get("heads_kv", HQ), spec.get("bias"))
    causal = spec.get("causal", False)
    want = _autograd(q, k, v, grad, mask, causal, scale=0.3)
    out, _ = wide_reference.attention(q, k, v, mask, causal, 0.3)
    got = (out, *wide_reference.attention_backward(grad, q, k, v, mask, causal, 0.3))
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{case} {n}: {m}")


def _ops_called(q, k, v, grad, bias, causal):
    """Each fused op and its backward, called as AOTAutograd's graphs call them, on the CPU
    (under the mode the stand-in answers before any kernel is looked for)."""
    empty = q.new_empty(0)
    yield "cudnn", aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, causal, False)[0], \
        aten._scaled_dot_product_cudnn_attention_backward(grad, q, k, v, empty, empty, empty, empty,
                                                          bias if bias is not None else empty, empty, empty,
                                                          L, S, 0.0, causal)
    if bias is None:
        yield "flash", aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[0], \
            aten._scaled_dot_product_flash_attention_backward(grad, q, k, v, empty, empty, empty, empty, L, S, 0.0,
                                                              causal, empty, empty)
    eff_bias = bias if bias is not None else None
    yield "efficient", aten._scaled_dot_product_efficient_attention(q, k, v, eff_bias, True, 0.0, causal)[0], \
        aten._scaled_dot_product_efficient_attention_backward(grad, q, k, v, bias if bias is not None else empty,
                                                              empty, empty, empty, empty, 0.0,
                                                              [True, True, True, False], causal)[:3]
    yield "cpu flash", aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)[0], \
        aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, empty, empty, 0.0, causal,
                                                                  attn_mask=bias)


@pytest.mark.parametrize("case", ["plain", "causal", "float bias"])
def test_each_fused_op_and_its_backward_computes_exact_attention_under_the_mode(case):
    spec = CASES[case]
    q, k, v, grad, mask = _case(spec.get("heads_kv", HQ), spec.get("bias"))
    causal = spec.get("causal", False)
    want = _autograd(q, k, v, grad, mask, causal)
    with WideReference(torch.float64):
        called = list(_ops_called(q, k, v, grad, mask, causal))
    assert len(called) == (4 if mask is None else 3)
    for op, out, grads in called:
        for name, g, w in zip(("output", "dq", "dk", "dv"), (out, *grads), want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m, o=op, n=name: f"{o} {n}: {m}")


def test_the_stand_in_agrees_with_the_cpu_kernel_in_float64():
    """The CPU's own fused kernel takes float64: the stand-in gives its values, a row with
    every key masked included (0, as the fused kernels give, not softmax's NaN)."""
    q, k, v, grad, keep = _case(bias="bool")
    keep[2] = False
    # the kernel takes a mask of query's dtype
    mask = torch.zeros(L, S, dtype=q.dtype, device="cpu").masked_fill(~keep, float("-inf"))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)
    want = (out, *aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, False,
                                                                            attn_mask=mask))
    with WideReference(torch.float64):
        got_out, _ = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)
        got = (got_out, *aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0,
                                                                                   False, attn_mask=mask))
    assert torch.equal(got[0][:, :, 2], torch.zeros_like(got[0][:, :, 2]))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_dropout_has_no_stand_in():
    q, k, v, grad, _ = _case()
    with WideReference(torch.float64), pytest.raises(NoStandIn, match="dropout"):
        aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.1)


class _Captured:
    """What ``validate._wide_outputs`` reads of a capture: the original function."""

    def __init__(self, fn, num_user_inputs):
        self.fn, self.num_user_inputs = fn, num_user_inputs

    def reference_outputs(self, inputs):
        return list(self.fn(*inputs))


def _cudnn_step(q, k, v, grad):
    """A training graph's attention as a GPU graph holds it: cuDNN's fused forward and
    backward (no CPU kernel, and on a GPU no float64 one)."""
    out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)
    no_bias = q.new_empty(0)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(grad, q, k, v, out, lse, seed, offset, no_bias,
                                                                   cq, ck, mq, mk, 0.0, False)
    return out, dk.sum((0, 2)), dv


def test_validation_has_a_float64_reference_for_graphs_of_fused_attention_kernels():
    """A bf16 key gradient summed over positions (a key bias's gradient) is zero in exact
    arithmetic: the reference that judges it is the graph in float64, which a graph of
    half-precision-only kernels had none of (ViT's training step on an H200 fell back to
    eager: relative error 1.4, two noises)."""
    q, k, v, grad, _ = _case()
    narrow = [t.to(torch.bfloat16) for t in (q, k, v, grad)]
    exact = validate._wide_outputs(_Captured(_cudnn_step, 4), narrow)
    assert exact is not None and all(t.dtype == torch.float64 for t in exact)
    wide = [t.double() for t in narrow]
    out, _, dk, dv = _autograd(*wide, None, False)
    for g, w in zip(exact, (out, dk.sum((0, 2)), dv)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    assert exact[1].abs().max() < 1e-12  # the bias gradient, exactly zero


@pytest.mark.parametrize("op, forward", [(aten._softmax_backward_data.default, torch.softmax),
                                         (aten._log_softmax_backward_data.default, torch.log_softmax)])
def test_softmax_backward_naming_a_half_input_runs_at_its_widened_gradients_dtype(op, forward, monkeypatch):
    """The graph names the forward input's dtype (bf16); CUDA's kernel then wants a float32
    gradient, and a float64 one stopped the reference (ViT's classifier loss on an H200)."""
    g = torch.Generator().manual_seed(0)
    grad, x = (torch.randn(3, 5, generator=g, dtype=torch.float64, device="cpu") for _ in range(2))
    out = forward(x, -1)
    called = []
    run = wide_reference.STAND_INS[op]
    monkeypatch.setitem(wide_reference.STAND_INS, op, lambda a: called.append(a["dim"]) or run(a))
    with WideReference(torch.float64):
        got = op(grad, out, -1, torch.bfloat16)
    assert called == [-1] and got.dtype == torch.float64
    assert torch.equal(got, op(grad, out, -1, torch.float64))


def test_a_graphs_own_casts_round_there_and_the_ops_after_see_the_wide_dtype():
    """A cast to bf16 then a product with a widened weight: eager would refuse operands of
    two dtypes (ViT's backward on an H200, and a norm's float32 upcast likewise); the
    reference rounds where the graph rounds and computes on in float64."""
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(4, 4, generator=g, dtype=torch.float64, device="cpu") for _ in range(2))
    with WideReference(torch.float64):
        got = aten.mm(aten._to_copy(x, dtype=torch.bfloat16), w).sum(dtype=torch.float32)
    assert got.dtype == torch.float64
    assert got == (x.to(torch.bfloat16).double() @ w).sum().float().double()


@pytest.mark.parametrize("weight_gradient", [False, True])
def test_grouped_mm_stands_in_for_its_bfloat16_kernel(weight_gradient):
    """A mixture of experts' products: rows (or, by a 2-D weight, columns) in groups cut
    at ``offs``, an empty group among them; the widened result is the kernel's within
    bfloat16's rounding, and rows past the last group are zero."""
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([8, 8, 24], dtype=torch.int32)
    if weight_gradient:
        a, b = torch.randn(16, 32, generator=g), torch.randn(32, 8, generator=g)
        kernel_b = b.bfloat16().t().contiguous().t()  # the kernel's layout
    else:
        a, b = torch.randn(32, 16, generator=g), torch.randn(3, 16, 8, generator=g)
        kernel_b = b.bfloat16()
    want = torch._grouped_mm(a.bfloat16(), kernel_b, offs=offs).double()
    with WideReference(torch.float64):
        got = torch._grouped_mm(a.bfloat16().double(), b.bfloat16().double(), offs=offs)
    assert got.dtype == torch.float64 and got.shape == want.shape
    if not weight_gradient:
        assert not got[24:].any()
        got, want = got[:24], want[:24]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)


def test_a_stand_in_lays_its_result_out_as_the_kernel_does():
    """cuDNN attention of projections viewed as heads returns its output with the heads
    inside the rows, and the graph views it as [batch, sequence, width] on that layout:
    the stand-in's result must allow the same view (Mixtral's training forward had no
    wide reference for it on an H200: 'view size is not compatible')."""
    b, s, h, d = 2, 8, 4, 16
    q, k, v = (torch.randn(b, s, h, d).transpose(1, 2) for _ in range(3))
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention.default
    kernel = cudnn(*(torch.empty_strided(t.shape, t.stride(), dtype=torch.bfloat16, device="meta") for t in (q, k, v)),
                   None, True, 0.0, True, False)[0]
    with WideReference(torch.float64):
        out = cudnn(q.double(), k.double(), v.double(), None, True, 0.0, True, False)[0]
    assert out.stride() == kernel.stride() != q.contiguous().stride()
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(out.transpose(1, 2).view(b, s, h * d), want.transpose(1, 2).reshape(b, s, h * d))
