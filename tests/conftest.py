import os

import pytest
import torch

os.environ.setdefault("EQFUSE_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "eqfuse"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def assert_matches(got, ref, dtype=None):
    """Compiled output against eager: same structure, shapes, dtypes; values within dtype tolerance."""
    from eqfuse.examples import tolerance
    got = got if isinstance(got, (tuple, list)) else (got,)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape, (g.shape, r.shape)
        assert g.dtype == r.dtype, (g.dtype, r.dtype)
        rtol, atol = tolerance(dtype or r.dtype)
        torch.testing.assert_close(g, r, rtol=rtol, atol=atol, equal_nan=True)
