import os

import pytest
import torch

os.environ.setdefault("EQFUSE_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "eqfuse"))
# Off for the suite: tests compile under monkeypatched internals (a tile model, a code
# writer) that no plan cache key sees. tests/test_plan_cache.py turns it on.
os.environ.setdefault("EQFUSE_PLAN_CACHE", "0")
# Off for the suite too: on a GPU, plain products would run as cuBLAS calls
# (codegen/library.py), and the tests of generated products would test cuBLAS instead.
# tests/test_library.py turns it on.
os.environ.setdefault("EQFUSE_CUBLAS", "0")

# The suite runs where it is started: on a CUDA GPU when there is one (real Triton
# compilation), else on the CPU through the Triton interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.set_default_device(DEVICE)
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton


@torch.library.custom_op("eqfuse_tests::sorted_along", mutates_args=())
def sorted_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The tests' eager step: an op eqfuse has no kernel form for, and never will (a custom
    op, opaque to it), which sorts ``x`` along ``dim``."""
    return torch.sort(x, dim).values.contiguous()


@sorted_along.register_fake
def _(x, dim):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def assert_matches(got, ref, dtype=None, contraction=False):
    """Compiled output against eager: same structure, shapes, dtypes; values within dtype tolerance.

    ``contraction``: the outputs are sums of many products (matmuls), whose rounding error
    scales with the largest output, not with each element: the absolute tolerance is then
    relative to the largest magnitude."""
    from eqfuse.examples import contraction_tolerance, tolerance
    got = got if isinstance(got, (tuple, list)) else (got,)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape, (g.shape, r.shape)
        assert g.dtype == r.dtype, (g.dtype, r.dtype)
        dt = dtype or r.dtype
        rtol, atol = contraction_tolerance(dt, r) if contraction else tolerance(dt)
        torch.testing.assert_close(g, r, rtol=rtol, atol=atol, equal_nan=True)
