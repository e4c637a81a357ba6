"""Attention against eager PyTorch on the Triton interpreter: every spelling of it in
``ATTENTION_EXAMPLES`` must become one streamed kernel (softmax rules + the attention
schedule), at ragged sequence lengths, several head dims and three dtypes."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, assert_matches

import eqfuse
from eqfuse.examples import ATTENTION_EXAMPLES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def one_streamed_kernel(fn, inputs):
    compiled = eqfuse.compile(fn, inputs)
    assert_matches(compiled(*inputs), fn(*inputs), contraction=True)
    assert compiled.fallbacks == [], compiled.explain()
    assert [k.schedule.kind for k in compiled.kernels] == ["attention"], compiled.explain()
    return compiled


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seq", [1, 17, 100])
@pytest.mark.parametrize("name", list(ATTENTION_EXAMPLES))
def test_attention_spelling_is_one_kernel(name, seq, dtype):
    ex = ATTENTION_EXAMPLES[name]
    torch.manual_seed(0)
    one_streamed_kernel(ex.fn, ex.make_inputs(2, 2, seq, 16, dtype, DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("name", ["attention", "causal_attention", "padded_attention"])
def test_head_dims(name, head_dim, dtype):
    """80 is not a power of two: the head dim is masked in both products."""
    ex = ATTENTION_EXAMPLES[name]
    torch.manual_seed(0)
    one_streamed_kernel(ex.fn, ex.make_inputs(1, 2, 33, head_dim, dtype, DEVICE))


def test_rules_reach_the_streamed_form():
    """No attention pattern is matched whole: the normalisation moves out of the product,
    then exp(s - rowmax s) under the product and under the sum become ExpDot / ExpSum."""
    ex = ATTENTION_EXAMPLES["causal_attention"]
    c = one_streamed_kernel(ex.fn, ex.make_inputs(1, 2, 17, 16, torch.float16, DEVICE))
    fired = c.report["saturation"]["rules_fired"]
    for rule in ("dot-row-div-rounded", "softmax-dot-rounded", "softmax-sum"):
        assert fired.get(rule), (rule, fired)


def test_causal_tiles_past_the_diagonal_are_skipped():
    ex = ATTENTION_EXAMPLES["causal_attention"]
    c = one_streamed_kernel(ex.fn, ex.make_inputs(1, 1, 100, 16, torch.float32, DEVICE))
    (k,) = c.kernels
    assert k.schedule.band == (-99, 0)
    assert "hi = tl.minimum(N, (pid_m + 1) * BLOCK_M + 0)" in k.source
    assert "lo = 0" in k.source


def test_sliding_window_skips_tiles_on_both_sides():
    def window(q, k, v):
        n = q.shape[-2]
        i = torch.arange(n, device=q.device)
        near = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 8)
        s = (q @ k.transpose(-1, -2)).masked_fill(~near, float("-inf"))
        return torch.softmax(s, -1) @ v

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, 16, device=DEVICE) for _ in range(3))
    c = one_streamed_kernel(window, (q, k, v))
    (kern,) = c.kernels
    assert kern.schedule.band == (-7, 0)
    assert "lo = tl.maximum(0, pid_m * BLOCK_M + -7) // BLOCK_N * BLOCK_N" in kern.source


def test_a_row_with_every_key_masked_is_nan_as_in_eager():
    ex = ATTENTION_EXAMPLES["padded_attention"]
    torch.manual_seed(0)
    q, k, v, keep = ex.make_inputs(2, 2, 17, 16, torch.float32, DEVICE)
    keep = keep.clone()
    keep[0] = False
    c = one_streamed_kernel(ex.fn, (q, k, v, keep))
    out = c(q, k, v, keep)
    assert out[0].isnan().all() and not out[1].isnan().any()


def test_scores_returned_beside_the_output_are_stored_by_the_product_kernel():
    """The scores are needed whole (a second output): they are computed once, stored,
    and read by the streamed kernel, which stays one kernel."""
    def f(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return torch.softmax(s, -1) @ v, s

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 17, 16, device=DEVICE) for _ in range(3))
    c = eqfuse.compile(f, (q, k, v))
    assert_matches(c(q, k, v), f(q, k, v), contraction=True)
    assert "attention" in [k.schedule.kind for k in c.kernels]


def test_sdpa_with_dropout_runs_in_eager_with_the_reason():
    """Dropout is random: the op stays whole, and torch lowers it to a random in-place op."""
    q, k, v = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(3))
    c = eqfuse.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5), (q, k, v))
    assert c.kernels == []
    assert any("scaled_dot_product" in f.node or "bernoulli" in f.reason for f in c.fallbacks), c.fallbacks
    assert c(q, k, v).shape == (1, 2, 8, 16)


def test_softmax_alone_stays_a_row_reduction():
    """The softmax rules rewrite its sum as an ExpSum; without a product to stream it is
    spelled out again for the row-reduction schedule (one pass, whole rows)."""
    x = torch.randn(8, 64, device=DEVICE)
    c = eqfuse.compile(lambda x: torch.softmax(x, -1), (x,))
    assert_matches(c(x), torch.softmax(x, -1))
    assert [k.schedule.kind for k in c.kernels] == ["reduction"]
