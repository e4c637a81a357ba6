"""torch.compile(..., backend="eqfuse"): forward and backward against eager."""

import torch
import torch.nn as nn

import eqfuse.backend


def _grads(module, x):
    for p in module.parameters():
        p.grad = None
    x.grad = None
    out = module(x)
    out.float().pow(2).sum().backward()
    return out, [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]


def test_backend_is_registered_by_name():
    assert "eqfuse" in torch._dynamo.list_backends(exclude_tags=())


def test_relu_mul_forward_and_backward_are_one_kernel_each():
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    f = lambda x, y: torch.relu(x * y)
    x = torch.randn(8, 32, requires_grad=True)
    y = torch.randn(8, 32, requires_grad=True)
    out = torch.compile(f, backend="eqfuse")(x, y)
    out.sum().backward()
    gx, gy = x.grad.clone(), y.grad.clone()
    x.grad = y.grad = None
    ref = f(x, y)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gy, y.grad)
    forward, backward = eqfuse.backend.history
    assert len(forward.kernels) == 1 and len(backward.kernels) == 1, backward.explain()


def test_module_training_step_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Tanh())
    x = torch.randn(16, 32, requires_grad=True)
    ref_out, ref_grads = _grads(model, x)
    out, grads = _grads(torch.compile(model, backend="eqfuse"), x)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_options_reach_eqfuse():
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    f = lambda x: torch.softmax(x, -1) * 2
    x = torch.randn(4, 16)
    out = torch.compile(f, backend="eqfuse", options={"max_enodes": 5})(x)
    torch.testing.assert_close(out, f(x))
    assert "e-node limit" in eqfuse.backend.history[-1].report["saturation"]["stop_reason"]


def test_backward_of_split_chunk_and_slices_has_no_eager_step():
    """The backward of split / chunk / slicing (rotary embeddings, fused qkv projections) is
    slice_scatter into zeros: it compiles to kernels, and the gradients match eager."""
    torch._dynamo.reset()
    eqfuse.backend.history.clear()

    def f(x, w):
        q, k, v = (x @ w).chunk(3, dim=-1)
        a, b = q.split([3, 5], dim=-1)
        rot = torch.cat([-b, a], dim=-1) * k + x[..., 2:10] * v[..., :8]
        return rot[:, 1:].tanh()

    x = torch.randn(4, 6, 16, requires_grad=True)
    w = torch.randn(16, 24, requires_grad=True)
    out = torch.compile(f, backend="eqfuse")(x, w)
    out.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref = f(x, w)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-4)
    forward, backward = eqfuse.backend.history
    # slice_backward, which capture decomposes into slice_scatter over zeros
    assert any("slice_backward" in str(n.target) for n in backward.fn.graph.nodes), backward.fn.code
    assert backward.fallbacks == [] and forward.fallbacks == [], backward.explain()
