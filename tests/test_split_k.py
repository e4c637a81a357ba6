"""Split-K (eqfuse/codegen/splitk.py): a matmul with too few output tiles to fill the GPU
runs as two kernels, a batched product over chunks of K into float32 partials, then
their sum and the kernel's epilogue.

Small shapes split only where a test forces a chunk count (``FORCE_CHUNKS``); the model's
own choice is checked on plan kernels built by hand at GPT-2's sizes, without running them."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, assert_matches

import eqfuse
from eqfuse.codegen import schedules, split, splitk
from eqfuse.schema.plan import Buffer, KernelSpec, Plan, PNode

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def chunks(monkeypatch):
    """Every matmul that may split does, in three chunks."""
    monkeypatch.setattr(splitk, "FORCE_CHUNKS", 3)
    monkeypatch.delenv(splitk.ENV, raising=False)
    return 3


def _launches(compiled) -> list[str]:
    """The kernels the generated ``call`` launches, in order."""
    body = compiled.source.split("\ndef call(")[1]
    return [line.strip().split("_launch(")[0] for line in body.splitlines() if "_launch(" in line]


def _split_pair(compiled, chunks: int):
    """(stage 1, stage 2) of a graph compiled to one split matmul, checked for their form."""
    first, second = compiled.kernels
    assert first.name == second.name + splitk.STAGE1_SUFFIX
    assert _launches(compiled) == [first.name, second.name]
    s1, s2 = first.schedule, second.schedule
    assert s1.kind == "matmul" and s1.batch == (chunks,)
    assert s2.kind == "reduction" and s2.cols == chunks and s2.rows == s1.m * s1.n
    (partials,) = [b for b in compiled.plan.buffers.values() if b.name.endswith(splitk.STAGE1_SUFFIX)]
    assert partials.dtype == "float32" and partials.shape == (chunks, s1.m, s1.n)
    return first, second


def _weight_grad_gelu(x, dy, b):
    return F.gelu(x.t() @ dy + b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, n, k", [(17, 40, 600), (100, 33, 301)])
def test_weight_gradient_with_bias_and_gelu(chunks, m, n, k, dtype):
    """x.T @ dy (operands read transposed) + bias, gelu: K 600 splits evenly (no padding,
    the operands stay plain reads), K 301 is padded to 303 with zeros."""
    torch.manual_seed(0)
    x, dy, b = torch.randn(k, m, dtype=dtype), torch.randn(k, n, dtype=dtype), torch.randn(n, dtype=dtype)
    compiled = eqfuse.compile(_weight_grad_gelu, [x, dy, b])
    assert_matches(compiled(x, dy, b), _weight_grad_gelu(x, dy, b), contraction=True)
    first, second = _split_pair(compiled, chunks)
    assert first.schedule.k == -(-k // chunks)
    # stage 1 reads the operands, stage 2 the partials and the bias: the epilogue runs after the sum
    assert {"in0", "in1"} <= set(first.params) and "in2" not in first.params
    assert "in2" in second.params and "in0" not in second.params and "tl.erf" in second.source
    padded = k % chunks != 0
    assert ("tl.where" in first.source) == padded


def _residual(a, b, r):
    return a @ b + r


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_residual_add_after_the_sum(chunks, dtype):
    torch.manual_seed(0)
    a, b, r = torch.randn(33, 900, dtype=dtype), torch.randn(900, 65, dtype=dtype), torch.randn(33, 65, dtype=dtype)
    compiled = eqfuse.compile(_residual, [a, b, r])
    assert_matches(compiled(a, b, r), _residual(a, b, r), contraction=True)
    _split_pair(compiled, chunks)


def test_plain_product_in_float32(chunks):
    torch.manual_seed(0)
    x, y = torch.randn(1000, 50), torch.randn(1000, 71)

    def fn(p, q):
        return p.t() @ q
    compiled = eqfuse.compile(fn, [x, y])
    assert_matches(compiled(x, y), fn(x, y), contraction=True)
    _split_pair(compiled, chunks)


def test_switch_off_keeps_one_kernel(chunks, monkeypatch):
    monkeypatch.setenv(splitk.ENV, "0")
    x, y = torch.randn(600, 17), torch.randn(600, 40)
    compiled = eqfuse.compile(_residual, [x.t(), y, torch.randn(17, 40)])
    (kernel,) = compiled.kernels
    assert kernel.schedule.kind == "matmul" and _launches(compiled) == [kernel.name]


def test_batched_and_paired_products_stay_whole(chunks):
    """Forced, still not split: a product batched to begin with, and two products in one K
    loop (SwiGLU's pair)."""
    torch.manual_seed(0)
    a, b = torch.randn(2, 20, 300), torch.randn(2, 300, 24)
    x, w1, w3 = torch.randn(20, 300), torch.randn(300, 24), torch.randn(300, 24)

    def batched(p, q):
        return p @ q

    def paired(p, u, v):
        return F.silu(p @ u) * (p @ v)
    for fn, inputs in ((batched, [a, b]), (paired, [x, w1, w3])):
        compiled = eqfuse.compile(fn, inputs)
        assert_matches(compiled(*inputs), fn(*inputs), contraction=True)
        assert not any(k.name.endswith(splitk.STAGE1_SUFFIX) for k in compiled.kernels), fn.__name__


def test_small_products_are_not_split_by_default(monkeypatch):
    """Without forcing, K = 600 is short (and the grid is all there is to fill)."""
    monkeypatch.delenv(splitk.ENV, raising=False)
    x, y = torch.randn(600, 17), torch.randn(600, 40)
    compiled = eqfuse.compile(lambda p, q: p.t() @ q, [x, y])
    assert len(compiled.kernels) == 1
    assert not any(b.endswith(splitk.STAGE1_SUFFIX) for b in compiled.plan.buffers)


# --- the model's choice, on plan kernels at GPT-2's sizes (no kernel is run) -----------------

def _weight_grad_spec(m, n, tokens=8192, dtype="float16"):
    """``x.T @ dy`` with x [tokens, m] and dy [tokens, n], as extraction states it."""
    x = PNode("load", ("x", (1, m), 0), (), (m, tokens), dtype)
    dy = PNode("load", ("dy", (n, 1), 0), (), (tokens, n), dtype)
    product = PNode("dot", (), (x, dy), (m, n), dtype)
    buffers = {"x": Buffer("x", (tokens, m), dtype, "input"), "dy": Buffer("dy", (tokens, n), dtype, "input"),
               "out": Buffer("out", (m, n), dtype, "output")}
    return KernelSpec("k0_mm", [(product, "out")], ["mm"]), buffers


def test_gpt2_attention_projection_gradient_splits_k_evenly():
    spec, buffers = _weight_grad_spec(768, 768)
    tiles = splitk.output_tiles(schedules.schedule_of(spec))
    assert tiles < splitk.tma.sm_count()
    first, second, partials = splitk.split_kernel(spec, buffers)
    s1, s2 = schedules.schedule_of(first), schedules.schedule_of(second)
    chunks = s1.batch[0]
    assert 8192 % chunks == 0 and s1.k * chunks == 8192 and s1.k >= splitk.MIN_CHUNK
    assert tiles * chunks <= splitk.MAX_WAVES * splitk.tma.sm_count()
    assert s2.cols == chunks and s2.rows == 768 * 768
    assert partials.shape == (chunks, 768, 768) and partials.dtype == "float32"
    # Stage 1's operands stay plain reads: no padding
    assert not any(n.op == "cat" for n in first.walk())


@pytest.mark.parametrize("m, n, tokens", [
    (3072, 768, 8192),  # 72 tiles of 128 x 256: measured no faster split (splitk's docstring)
    (768, 768, 1024),  # K short
    (4096, 4096, 8192),  # the grid full already
])
def test_products_the_model_leaves_whole(m, n, tokens):
    spec, buffers = _weight_grad_spec(m, n, tokens)
    assert splitk.split_kernel(spec, buffers) is None


def test_splitting_a_plan_twice_changes_nothing_and_split_reductions_leave_stage_2(monkeypatch):
    """Stage 2 is a reduction over S partials: split reductions, even with thresholds
    that split anything, leave it (and stage 1) alone."""
    monkeypatch.setattr(split, "SPLIT_MIN_ELEMENTS", 1)
    monkeypatch.setattr(split, "SPLIT_MIN_CHUNK", 1)
    spec, buffers = _weight_grad_spec(768, 768)
    plan = Plan([buffers["x"], buffers["dy"]], dict(buffers), [spec], [("buffer", "out")])
    splitk.split_matmuls(plan)
    once = [(k.name, [b for _, b in k.roots]) for k in plan.kernels]
    assert len(once) == 2
    splitk.split_matmuls(plan)
    split.split_reductions(plan)
    assert [(k.name, [b for _, b in k.roots]) for k in plan.kernels] == once


def test_plan_cache_key_holds_the_switch(monkeypatch):
    from eqfuse.runtime import plan_cache
    monkeypatch.delenv(splitk.ENV, raising=False)
    on = plan_cache._device_parts(torch.device("cpu"))
    monkeypatch.setenv(splitk.ENV, "0")
    assert plan_cache._device_parts(torch.device("cpu")) != on


# --- int4 weights: an operand computed as it loads ----------------------------------------

def _int4_plan(tokens: int):
    from eqfuse.examples import MATMUL_EXAMPLES
    ex = MATMUL_EXAMPLES["int4_matmul"]
    # on the suite's device: CPU tensors on a GPU machine (no interpreter) would run in eager
    return eqfuse.compile(ex.fn, ex.make_inputs(tokens, 4096, 4096, torch.float16, DEVICE), validate=False,
                          autotune=False)


@pytest.mark.parametrize("tokens", [16, 128])
def test_int4_weights_at_decoding_sizes_unpack_in_a_split_product(monkeypatch, tokens):
    """16 and 128 tokens: the weights are unpacked as the product loads them (a quarter of
    the bytes of a dequantised copy), K split so that SMs hold several programs, each with
    one stage (its loads are computed in registers, not pipelined). At 128 tokens this
    needs the split's partials costed once (stage 1's store, then stage 2's read) and the
    unpacking's work costed once (by the tile model, not again as pointwise work)."""
    monkeypatch.delenv(splitk.ENV, raising=False)
    compiled = _int4_plan(tokens)
    first, second = compiled.kernels
    assert first.name == second.name + splitk.STAGE1_SUFFIX
    s1 = first.schedule
    assert s1.gathered_sides == (1,) and s1.batch[0] >= 4
    assert first.launch["num_stages"] == 1


def test_int4_weights_at_prompt_sizes_are_dequantised_once():
    """4096 tokens: unpacked in the product, each weight tile would be computed again for
    every 128 rows; dequantised into its own buffer, once, before a plain product."""
    compiled = _int4_plan(4096)
    dequant, product = compiled.kernels
    assert dequant.schedule.kind == "pointwise"
    assert product.schedule.kind == "matmul" and product.schedule.gathered_sides == ()


def test_computed_operands_take_one_stage_tiles():
    spec, _ = _weight_grad_spec(768, 768)
    sched = schedules.schedule_of(spec)
    plain = splitk.tiles.candidates(sched)
    computed = splitk.tiles.candidates(replace(sched, gathered=2, gathered_sides=(1,)))
    assert any(c["num_stages"] > 1 for c in plain)
    assert computed and all(c["num_stages"] == 1 for c in computed)
