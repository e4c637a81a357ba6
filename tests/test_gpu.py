"""The examples on a CUDA GPU at realistic widths (skipped without CUDA)."""

import pytest
import torch
from conftest import assert_matches

import eqfuse
from eqfuse.examples import EXAMPLES

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [1536, 1000, 20000])
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_on_gpu(name, cols, dtype):
    ex = EXAMPLES[name]
    torch.manual_seed(0)
    inputs = ex.make_inputs(64, cols if name != "causal_softmax" else 300, dtype, "cuda")
    compiled = eqfuse.compile(ex.fn, inputs, autotune=False)
    assert_matches(compiled(*inputs), ex.fn(*inputs))
    if cols <= 16384:  # wider rows are looped: the cost model may then store a shared value
        assert len(compiled.kernels) == ex.kernels
