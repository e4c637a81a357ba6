"""Rewrites of AOTAutograd's joint graph before partitioning (frontend/joint.py)."""

import torch
import torch.nn.functional as F
from functorch.compile import default_partition, make_boxed_func
from torch._functorch.aot_autograd import aot_function

import eqfuse.backend


def _split(fn, *args, partition=None):
    """The forward and backward graphs AOTAutograd makes of ``fn`` with the backend's
    partitioner (or ``partition``), and ``fn``'s outputs and gradients run through them."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)
    inputs = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
    partition = partition or eqfuse.backend.partitioner()
    out = aot_function(fn, fw_compiler=keep, bw_compiler=keep, partition_fn=partition)(*inputs)
    out.backward()
    return graphs, out, [a.grad for a in inputs if a.requires_grad]


def test_cross_entropy_saves_row_statistics_not_a_float32_copy_of_the_logits():
    """The log-softmax's output (float32, the logits' size) is not saved for the backward:
    the backward recomputes it from the bf16 logits and two numbers per row."""
    logits = torch.randn(8, 3000, dtype=torch.bfloat16) * 3
    target = torch.randint(0, 3000, (8,))
    target[2] = -100

    def loss(logits, target):
        return F.cross_entropy(logits.float().view(8, 3000), target)
    (forward, backward), got, (grad,) = _split(loss, logits, target)
    x = logits.detach().requires_grad_()
    want = loss(x, target)
    want.backward()
    # The same values up to the order of float32 operations (about one draw in fifteen
    # rounds the loss an ulp apart, and the bf16 gradient with it), as the graph traced
    # without the rewrite does against eager too
    _, traced, (traced_grad,) = _split(loss, logits, target, partition=default_partition)
    for a, b in ((got, want), (got, traced)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    for a, b in ((grad, x.grad), (grad, traced_grad)):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-9)
    saved = [n.meta["val"] for n in forward.graph.output_node().args[0][1:]]
    assert all(t.numel() < logits.numel() or t.dtype == torch.bfloat16 for t in saved), \
        [(t.shape, t.dtype) for t in saved]
    assert any(n.target is torch.ops.aten._log_softmax_backward_data.default for n in backward.graph.nodes)
