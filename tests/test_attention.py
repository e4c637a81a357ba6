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


def key_loops(source: str) -> list[str]:
    """The bodies of the kernel's loops over key tiles, each with its ``for`` line."""
    return ["for n0 in range(" + part.split("\n    empty =")[0] for part in source.split("for n0 in range(")[1:]]


MASK_CODE = ("mindex)", "nmask", "jmask", "-float(\"inf\"))")  # index comparison, bounds, select


@pytest.mark.parametrize("name", ["causal_attention", "causal_attention_where", "causal_attention_bias",
                                  "gqa_attention", "sdpa_causal"])
def test_causal_mask_only_on_the_tiles_the_diagonal_crosses(name):
    """Below the diagonal every key is visible to every row of the block: that loop has no
    mask code at all (nor bounds masks: it stops at a whole tile); the mask is applied on
    the tiles from ``mid`` to the diagonal."""
    ex = ATTENTION_EXAMPLES[name]
    torch.manual_seed(0)
    c = one_streamed_kernel(ex.fn, ex.make_inputs(1, 2, 100, 16, torch.float16, DEVICE))
    (k,) = c.kernels
    assert "mid = tl.minimum(hi, pid_m * BLOCK_M + 1) // BLOCK_N * BLOCK_N" in k.source
    inner, edge = key_loops(k.source)
    assert inner.startswith("for n0 in range(lo, mid, BLOCK_N):")
    assert edge.startswith("for n0 in range(mid, hi, BLOCK_N):")
    assert not [code for code in MASK_CODE if code in inner], inner
    assert "mindex" in edge and "nmask" in edge, edge


@pytest.mark.parametrize("name", ["attention", "causal_attention"])
def test_scale_and_log2e_are_one_fma(name):
    """1/sqrt(d) and log2(e) are one constant c; the row max is taken of the raw products
    and scaled once per row, and each score is scaled and shifted in one FMA, in both
    loops (a causal mask keeps -inf, which c > 0 leaves -inf)."""
    ex = ATTENTION_EXAMPLES[name]
    c = one_streamed_kernel(ex.fn, ex.make_inputs(1, 2, 64, 16, torch.float16, DEVICE))
    scale = repr(0.25 / math.log(2))
    loops = key_loops(c.kernels[0].source)
    assert len(loops) == (2 if name == "causal_attention" else 1)
    for loop in loops:
        lines = loop.splitlines()
        assert not [line for line in lines if "qk" in line and " * " in line], loop
        assert f"m_new = tl.maximum(m_run, tl.max(s_tile, 1) * {scale})" in loop, loop
        assert f"p = tl.exp2(s_tile * {scale} - m_ref[:, None])" in loop, loop


def test_key_tiles_are_read_at_offsets_computed_once():
    """K and V tiles move with the keys at a fixed stride: their offset tiles are computed
    before the loops and each tile is read at n0 * stride past them."""
    ex = ATTENTION_EXAMPLES["causal_attention"]
    c = one_streamed_kernel(ex.fn, ex.make_inputs(1, 2, 64, 16, torch.float16, DEVICE))
    source = c.kernels[0].source
    for loop in key_loops(source):
        loads = [line for line in loop.splitlines() if "tl.load(" in line]
        assert len(loads) == 2 and all("n0 * 16 + offs" in line for line in loads), loop
    assert source.count("offs") >= 2 + 2 * 2  # two offset tiles made once, used by both loops


def test_padding_and_windows_keep_one_masked_loop():
    """A mask read from memory, or a band with a lower edge, is applied on every tile."""
    ex = ATTENTION_EXAMPLES["padded_attention"]
    c = one_streamed_kernel(ex.fn, ex.make_inputs(1, 2, 100, 16, torch.float16, DEVICE))
    (loop,) = key_loops(c.kernels[0].source)
    assert "in3" in loop


def banded(offset):
    """Column j is visible to row i iff j <= i + offset(m, n): causal aligned top-left (0),
    bottom-right (n - m), or strictly below the diagonal (-2: the first rows see nothing;
    with tiles of 16 the edge is then one column short of a tile boundary)."""
    def f(q, k, v):
        m, n = q.shape[-2], k.shape[-2]
        i = torch.arange(m, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(j > i + offset(m, n), float("-inf"))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v
    return f


@pytest.mark.parametrize("offset", [lambda m, n: 0, lambda m, n: n - m, lambda m, n: -2],
                         ids=["top-left", "bottom-right", "below"])
@pytest.mark.parametrize("m, n", [(1, 1), (17, 17), (64, 64), (65, 65), (100, 100), (130, 130), (40, 100), (100, 40)])
def test_split_loop_at_every_position_of_the_diagonal(m, n, offset):
    """Small tiles put the diagonal at tile edges and inside tiles, with ragged last tiles,
    square blocks and not; each configuration computes what eager does."""
    from eqfuse.codegen.module import generate_module
    from eqfuse.runtime.cache import cache_key, load_module
    torch.manual_seed(0)
    q = torch.randn(1, 2, m, 16, dtype=torch.float16, device=DEVICE)
    k, v = (torch.randn(1, 2, n, 16, dtype=torch.float16, device=DEVICE) for _ in range(2))
    fn = banded(offset)
    compiled = one_streamed_kernel(fn, (q, k, v))
    (kern,) = compiled.kernels
    assert len(key_loops(kern.source)) == (2 if kern.schedule.band else 1)
    for bm, bn in [(16, 16), (32, 16), (16, 32)]:
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 2}
        source, _ = generate_module(compiled.plan, "tiles", "test", {kern.name: cfg})
        module = load_module(cache_key(source), source, interpret=DEVICE == "cpu")
        (out,) = module.call(q.device, [], q, k, v)
        assert_matches(out, fn(q, k, v), contraction=True)


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
    assert len(key_loops(kern.source)) == 1  # the mask's two edges: one masked loop


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


def test_sdpa_with_dropout_draws_its_mask_in_eager_and_the_rest_compiles():
    """Dropout is random: on the CPU torch lowers it to an in-place draw (bernoulli_), which
    traced through functionalisation is an eager step in its place; the products and the
    softmax around it are kernels. A seed gives eager's numbers."""
    q, k, v = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(3))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    c = eqfuse.compile(f, (q, k, v))
    drawn = {fb.op for fb in c.fallbacks}
    assert "bernoulli" in drawn or any("scaled_dot_product" in op for op in drawn), c.explain()
    if str(DEVICE) == "cpu":  # torch's math path (a GPU's fused op draws inside itself, whole)
        assert c.kernels and "bernoulli" in drawn, c.explain()
    torch.manual_seed(3)
    got = c(q, k, v)
    torch.manual_seed(3)
    assert_matches(got, f(q, k, v))


def test_softmax_alone_stays_a_row_reduction():
    """The softmax rules rewrite its sum as an ExpSum; without a product to stream it is
    spelled out again for the row-reduction schedule (one pass, whole rows)."""
    x = torch.randn(8, 64, device=DEVICE)
    c = eqfuse.compile(lambda x: torch.softmax(x, -1), (x,))
    assert_matches(c(x), torch.softmax(x, -1))
    assert [k.schedule.kind for k in c.kernels] == ["reduction"]



def test_the_mask_analysis_runs_torch_on_one_thread_and_gives_the_count_back(monkeypatch):
    """The analysis evaluates masks on the CPU while the compile pool starts on every core;
    over torch's whole thread pool each small op waited for busy threads (codegen/attention.py)."""
    from eqfuse.codegen import attention
    seen = []
    analyse = attention._masked_band

    def recording(s):
        seen.append(torch.get_num_threads())
        return analyse(s)

    monkeypatch.setattr(attention, "_masked_band", recording)
    monkeypatch.setattr(attention, "_bands", {})
    before = max(2, torch.get_num_threads())
    torch.set_num_threads(before)
    try:
        ex = ATTENTION_EXAMPLES["causal_attention"]
        inputs = ex.make_inputs(1, 2, 24, 16, torch.float32, DEVICE)
        compiled = eqfuse.compile(ex.fn, inputs, autotune=False)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == before
        assert compiled.kernels[0].schedule.band == (-23, 0)  # the analysis still finds the causal band
    finally:
        torch.set_num_threads(before)


def test_a_mask_shared_by_candidate_kernels_is_evaluated_once(monkeypatch):
    """Extraction weighs many kernels over the same scores; the mask they share is
    evaluated once per structure, not once per tree (codegen/attention.py)."""
    from eqfuse.codegen import attention
    from eqfuse.schema.plan import PNode

    def mask():  # a new tree each time: rows >= columns over [64 x 64]
        rows = PNode("iota", (0,), (), (64, 1), "int64")
        cols = PNode("iota", (1,), (), (1, 64), "int64")
        return PNode("binary", ("ge",), (rows, cols), (64, 64), "bool")

    calls = []
    evaluate = attention._static
    monkeypatch.setattr(attention, "_static", lambda node: calls.append(node) or evaluate(node))
    monkeypatch.setattr(attention, "_statics", {})
    first, second = attention._static_kept(mask()), attention._static_kept(mask())
    assert [n.op for n in calls] == ["binary", "iota", "iota"] and first is second  # one evaluation
    assert torch.equal(first, torch.arange(64)[:, None] >= torch.arange(64)[None, :])


def _finite_mask_attention(floor: float, scale_after: float = 1.0, first_row_unseen: bool = False):
    """Causal attention with the mask added as a finite constant, as torch's cuDNN
    attention and transformers' half-precision masks write it."""
    def attend(q, k, v):
        n = q.shape[-2]
        i = torch.arange(n, device=q.device)
        keep = i[None, :] <= i[:, None]
        if first_row_unseen:
            keep = keep & (i[:, None] > 0)
        bias = torch.where(keep, 0.0, floor).to(q.dtype)
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias) * scale_after
        return torch.softmax(s.float(), -1).to(q.dtype) @ v
    return attend


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_causal_mask_of_finite_constants_skips_the_tiles_past_the_diagonal(dtype):
    """-65504 (float16's largest magnitude) and below underflow to 0 in exp beside a
    visible key: the tiles past the diagonal add nothing, as with -inf, and are skipped
    (Qwen2 and Mistral through SDPA on a GPU, cuDNN's mask: every key tile was visited)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, 16, dtype=dtype, device=DEVICE) for _ in range(3))
    for floor in (-65504.0, torch.finfo(dtype).min):
        c = one_streamed_kernel(_finite_mask_attention(floor), (q, k, v))
        assert c.kernels[0].schedule.band == (-99, 0), floor


def test_a_finite_mask_that_could_reach_zero_or_leaves_a_row_unseen_is_no_band():
    """Scaled by less than one after it is added, -65504 is no longer certain to vanish;
    a row that sees no key averages the values in eager (with -inf it would be NaN):
    neither skips a tile, and both match eager (to the rounding of scores 65504 away from
    0 in float32: 2^-8)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, device=DEVICE) for _ in range(3))
    for fn in (_finite_mask_attention(-65504.0, scale_after=0.01),
               _finite_mask_attention(-65504.0, first_row_unseen=True)):
        c = eqfuse.compile(fn, (q, k, v))
        assert [k.schedule.kind for k in c.kernels] == ["attention"] and c.kernels[0].schedule.band is None
        torch.testing.assert_close(c(q, k, v), fn(q, k, v), atol=1e-2, rtol=1e-2)


def test_an_unschedulable_attention_kernel_names_where_to_cut_it():
    """A kernel holding attention and a product reading its output (an output projection,
    behind a guard for rows the mask leaves no key) names, for the repair to store, the
    product's operand down to that guard; a product the attention reads names its own
    value. (Left to choose among every value, a repair stored the softmax product under
    the guard, whose row max then needed the scores stored: GPT-2 at 1024 tokens with a
    bool mask ran its scores through memory.)"""
    from eqfuse.codegen.attention import _cut_points
    from eqfuse.schema.plan import PNode

    def node(op, args=(), shape=(4, 8), name=None, attrs=()):
        return PNode(op, attrs, tuple(args), shape, "float32", name)
    q, k, v, w = (node("load", attrs=(n, (8, 1), 0)) for n in "qkvw")
    scores = node("dot", (q, k), (4, 4), "scores")
    flow = node("expdot", (scores, v), name="flow")
    guarded = node("where", (node("const", attrs=(True,)), node("const", attrs=(0.0,)), flow), name="guarded")
    heads = node("reshape", (node("cast", (guarded,), name="cast", attrs=("float32",)),), name="heads")
    projection = node("dot", (heads, w), (4, 8), "projection")
    assert _cut_points([projection], [flow]) == ["heads", "cast", "guarded"]
    upstream = node("dot", (q, w), (4, 8), "qkv")
    row_max = node("reduce", (scores,), (4, 1), "row_max", attrs=("max",))
    assert _cut_points([upstream, row_max, projection], [flow]) == ["qkv", "heads", "cast", "guarded"]


def test_two_attentions_in_one_kernel_name_where_the_second_reads_the_first():
    """A kernel holding two layers' attention (the second's q computed from the first's
    output), or attention whose q is normalised inside its scores: the schedule names the
    second's q, down to its first node of two operands, for the repair to store (left to
    choose among every value, a tiny BERT's extraction weighed about 120 values a round
    for 24 rounds: 7.4 s, 0.8 named)."""
    from eqfuse.codegen.attention import attention_schedule, streams
    from eqfuse.errors import Unschedulable
    from eqfuse.schema.plan import KernelSpec, PNode

    def node(op, args=(), shape=(4, 8), name=None, attrs=()):
        return PNode(op, attrs, tuple(args), shape, "float16", name)
    q, k, v, w = (node("load", attrs=(n, (8, 1), 0)) for n in "qkvw")
    first = node("expdot", (node("dot", (q, k), (4, 4), "scores1"), v), name="flow1")
    q2 = node("reshape", (node("dot", (first, w), name="proj"),), name="q2")
    second = node("expdot", (node("dot", (q2, k), (4, 4), "scores2"), v), name="flow2")
    spec = KernelSpec("k0", [(second, "out")])
    with pytest.raises(Unschedulable, match="softmax products over different scores") as caught:
        attention_schedule(spec, streams(spec))
    assert caught.value.store == ("q2", "proj")

    rows = node("reduce", (q,), (4, 1), "row_sum", attrs=("sum",))
    normed = node("binary", (q, node("broadcast", (rows,), name="rows")), name="normed", attrs=("div",))
    flow = node("expdot", (node("dot", (node("cast", (normed,), name="cast", attrs=("float16",)), k),
                                (4, 4), "scores"), v), name="flow")
    spec = KernelSpec("k0", [(flow, "out")])
    with pytest.raises(Unschedulable, match="a reduce inside attention scores") as caught:
        attention_schedule(spec, streams(spec))
    assert caught.value.store == ("cast", "normed")


def test_a_matmul_kernel_with_a_reduction_names_the_operand_to_store():
    """A product reading a normalised row (RMSNorm before a projection): the matmul
    schedule refuses the reduction and names, beside it, the product's operand down to
    where the reduction joins (storing the statistics alone may not be possible)."""
    from eqfuse.codegen.schedules import schedule_of
    from eqfuse.errors import Unschedulable
    from eqfuse.schema.plan import KernelSpec, PNode

    def node(op, args=(), shape=(4, 8), name=None, attrs=()):
        return PNode(op, attrs, tuple(args), shape, "float32", name)
    x, w = node("load", attrs=("x", (8, 1), 0)), node("load", attrs=("w", (8, 1), 0), shape=(8, 8))
    squares = node("reduce", (node("binary", (x, x), attrs=("mul",)),), (4, 1), "sum_sq", attrs=("sum",))
    scale = node("broadcast", (node("unary", (squares,), (4, 1), "rsqrt", attrs=("rsqrt",)),), name="scale")
    normed = node("binary", (x, scale), name="normed", attrs=("mul",))
    product = node("dot", (node("cast", (normed,), name="cast", attrs=("float32",)), w), (4, 8), "product")
    with pytest.raises(Unschedulable, match="a reduction in a matmul kernel") as caught:
        schedule_of(KernelSpec("k0", [(product, "out")]))
    assert caught.value.store == ("sum_sq", "cast", "normed")
