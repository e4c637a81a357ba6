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


def _matmul_with_impossible_first_choice(monkeypatch, also_rest: bool):
    """The tile model's first choice (and, with ``also_rest``, every choice) needs more
    shared memory than any GPU has: Triton refuses it only when it compiles."""
    from eqfuse.codegen import tiles
    huge = {"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 512, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    real = tiles.ranked
    monkeypatch.setattr(tiles, "ranked", lambda sched, *a: [huge] + ([] if also_rest else real(sched, *a)))
    x = torch.randn(256, 512, device="cuda", dtype=torch.float16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.float16)
    fn = lambda x, w: torch.relu(x @ w)  # noqa: E731
    return fn, (x, w), huge


def test_untimed_build_skips_a_config_that_does_not_compile(monkeypatch):
    fn, inputs, huge = _matmul_with_impossible_first_choice(monkeypatch, also_rest=False)
    compiled = eqfuse.compile(fn, inputs, autotune=False)
    assert_matches(compiled(*inputs), fn(*inputs), contraction=True)
    (k,) = compiled.kernels
    assert k.constexprs["BLOCK_K"] != huge["BLOCK_K"]
    assert not compiled.fallbacks


def test_kernel_without_a_runnable_config_runs_in_eager_with_the_reason(monkeypatch):
    fn, inputs, _ = _matmul_with_impossible_first_choice(monkeypatch, also_rest=True)
    compiled = eqfuse.compile(fn, inputs, autotune=False)
    assert_matches(compiled(*inputs), fn(*inputs), contraction=True)
    (fallback,) = compiled.fallbacks
    assert "runs with none of its 1 configurations" in fallback.reason
    assert "OutOfResources" in fallback.reason
