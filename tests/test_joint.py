"""Rewrites of AOTAutograd's joint graph before partitioning (frontend/joint.py)."""

import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_function

import eqfuse.backend


def _split(fn, *args):
    """The forward and backward graphs AOTAutograd makes of ``fn`` with the backend's
    partitioner, and ``fn``'s outputs and gradients run through them."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)
    inputs = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
    out = aot_function(fn, fw_compiler=keep, bw_compiler=keep, partition_fn=eqfuse.backend.partitioner())(*inputs)
    out.backward()
    return graphs, out, [a.grad for a in inputs if a.requires_grad]


def test_cross_entropy_saves_row_statistics_not_a_float32_copy_of_the_logits():
    """The log-softmax's output (float32, the logits' size) is not saved for the backward:
    the backward recomputes it from the bf16 logits and two numbers per row, rounding
    as the forward did (the gradient is bit for bit the traced one's)."""
    logits = torch.randn(8, 3000, dtype=torch.bfloat16) * 3
    target = torch.randint(0, 3000, (8,))
    target[2] = -100

    def loss(logits, target):
        return F.cross_entropy(logits.float().view(8, 3000), target)
    (forward, backward), got, (grad,) = _split(loss, logits, target)
    x = logits.detach().requires_grad_()
    want = loss(x, target)
    want.backward()
    assert torch.equal(got, want) and torch.equal(grad, x.grad)
    saved = [n.meta["val"] for n in forward.graph.output_node().args[0][1:]]
    assert all(t.numel() < logits.numel() or t.dtype == torch.bfloat16 for t in saved), \
        [(t.shape, t.dtype) for t in saved]
    assert any(n.target is torch.ops.aten._log_softmax_backward_data.default for n in backward.graph.nodes)
