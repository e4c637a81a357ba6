"""Every example against eager PyTorch on the Triton interpreter: three dtypes, a
power-of-two and odd widths, non-contiguous and zero-size inputs, and kernel counts."""

import pytest
import torch
from conftest import DEVICE, assert_matches

import eqfuse
from eqfuse.examples import EXAMPLES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(4, 16), (3, 1000), (2, 1)]


def compiled_and_checked(ex, inputs):
    """Compile an example for ``inputs`` and check one call against eager."""
    compiled = eqfuse.compile(ex.fn, inputs)
    assert_matches(compiled(*inputs), ex.fn(*inputs))
    return compiled


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_matches_eager(name, shape, dtype):
    ex = EXAMPLES[name]
    torch.manual_seed(0)
    inputs = ex.make_inputs(*shape, dtype, DEVICE)
    compiled = compiled_and_checked(ex, inputs)
    assert len(compiled.kernels) == ex.kernels, compiled.explain()
    assert compiled.fallbacks == []


@pytest.mark.parametrize("name", ["softmax", "rmsnorm", "residual_layernorm", "log_softmax", "swiglu"])
def test_width_1536_is_one_kernel(name):
    ex = EXAMPLES[name]
    inputs = ex.make_inputs(2, 1536, torch.float16, DEVICE)
    compiled = compiled_and_checked(ex, inputs)
    assert len(compiled.kernels) == 1
    k = compiled.kernels[0]
    if k.schedule.kind == "reduction":  # the whole row in one block, masked to 1536
        assert k.constexprs["BLOCK_C"] == 2048 and "cmask = cindex < C" in k.source


@pytest.mark.parametrize("name", ["softmax", "rmsnorm", "residual_layernorm", "mul_relu", "gelu"])
def test_transposed_inputs(name):
    ex = EXAMPLES[name]
    inputs = ex.make_inputs(12, 8, torch.float32, DEVICE)
    inputs = tuple(x.t().contiguous().t() if x.dim() == 2 else x for x in inputs)  # column-major
    assert not inputs[0].is_contiguous()
    compiled = compiled_and_checked(ex, inputs)
    assert len(compiled.kernels) == ex.kernels


@pytest.mark.parametrize("name", ["softmax", "rmsnorm", "vector_add", "swiglu"])
def test_sliced_inputs(name):
    ex = EXAMPLES[name]
    big = ex.make_inputs(10, 40, torch.float32, DEVICE)
    inputs = tuple(x[1:9:2, 3:35] if x.dim() == 2 else x[3:35] for x in big)
    compiled_and_checked(ex, inputs)


@pytest.mark.parametrize("name", ["softmax", "rmsnorm", "vector_add", "residual_layernorm", "gelu"])
def test_zero_rows(name):
    ex = EXAMPLES[name]
    inputs = ex.make_inputs(0, 16, torch.float32, DEVICE)
    compiled_and_checked(ex, inputs)


def test_causal_softmax_masks_upper_triangle():
    ex = EXAMPLES["causal_softmax"]
    (x,) = ex.make_inputs(1, 17, torch.float32, DEVICE)
    compiled = eqfuse.compile(ex.fn, (x,))
    out = compiled(x)
    assert_matches(out, ex.fn(x))
    assert torch.all(out.triu(1) == 0)
    assert len(compiled.kernels) == 1
    assert "tl.load" in compiled.source and compiled.source.count("tl.load(") == 1  # mask built from indices


def test_looped_reduction_for_wide_rows():
    ex = EXAMPLES["softmax"]
    (x,) = ex.make_inputs(2, 20000, torch.float32, DEVICE)
    compiled = eqfuse.compile(ex.fn, (x,))
    assert_matches(compiled(x), ex.fn(x))
    assert len(compiled.kernels) == 1
    assert not compiled.kernels[0].schedule.persistent
    assert "for c0 in range(0, C, BLOCK_C):" in compiled.source
