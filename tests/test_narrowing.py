"""Buffers stored in the dtype their readers cast them to (eqfuse/codegen/narrowing.py):
the writer casts before its store, the readers load the narrow values, and every output
is the same, bit for bit, on ordinary and special values."""

import copy

import pytest
import torch

from eqfuse.codegen import library
from eqfuse.codegen.narrowing import narrow_stores
from eqfuse.rewrite.validate import evaluate
from eqfuse.schema.plan import Buffer, KernelSpec, Plan, PNode, contiguous_strides

M, K, N = 8, 16, 8  # rows whole multiples of 16 bytes, as cuBLAS takes them


def _load(name, shape, dtype):
    return PNode("load", (name, contiguous_strides(shape), 0), (), shape, dtype)


def _cast(node, dtype):
    return PNode("cast", (dtype,), (node,), node.shape, dtype)


def _plan(second_reader_casts: bool = True, returned: bool = False) -> Plan:
    """g = x * sigmoid(y) in float32, stored; out1 = bf16(g) @ w; out2 = bf16(g)^T @ v (or
    g^T itself, widened products aside, where the second reader does not cast)."""
    x, y = _load("x", (M, K), "bfloat16"), _load("y", (M, K), "bfloat16")
    g = PNode("binary", ("mul",), (_cast(x, "float32"),
                                   PNode("unary", ("sigmoid",), (_cast(y, "float32"),), (M, K), "float32")),
              (M, K), "float32")
    w, v = _load("w", (K, N), "bfloat16"), _load("v", (M, N), "bfloat16")
    stored = _load("g", (M, K), "float32")
    first = PNode("dot", (), (_cast(stored, "bfloat16"), w), (M, N), "bfloat16")
    left = _cast(stored, "bfloat16") if second_reader_casts else stored
    transposed = PNode("permute", ((1, 0),), (left,), (K, M), left.dtype)
    second = PNode("dot", (), (transposed, v if second_reader_casts else _cast(v, "float32")), (K, N), left.dtype)
    buffers = {name: Buffer(name, shape, dtype, kind) for name, shape, dtype, kind in [
        ("x", (M, K), "bfloat16", "input"), ("y", (M, K), "bfloat16", "input"),
        ("w", (K, N), "bfloat16", "input"), ("v", (M, N), "bfloat16", "input"),
        ("g", (M, K), "float32", "temp"), ("o1", (M, N), "bfloat16", "temp"), ("o2", (K, N), left.dtype, "temp")]}
    outputs = [("buffer", "o1"), ("buffer", "o2")] + ([("buffer", "g")] if returned else [])
    steps = [KernelSpec("k0", [(g, "g")]), KernelSpec("k1", [(first, "o1")]), KernelSpec("k2", [(second, "o2")])]
    return Plan([buffers[n] for n in "xywv"], buffers, steps, outputs)


def _inputs():
    torch.manual_seed(0)
    x = torch.randn(M, K).bfloat16()
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.0e38])
    return [x, torch.randn(M, K).bfloat16(), torch.randn(K, N).bfloat16(), torch.randn(M, N).bfloat16()]


def test_a_buffer_every_reader_casts_is_stored_narrow():
    plan = _plan()
    before = evaluate(copy.deepcopy(plan), _inputs(), None)
    narrow_stores(plan)
    assert plan.buffers["g"].dtype == "bfloat16"
    writer, *readers = plan.kernels
    assert writer.roots[0][0].op == "cast" and writer.roots[0][0].dtype == "bfloat16"
    for spec in readers:
        loads = [n for n in spec.walk() if n.op == "load" and n.attrs[0] == "g"]
        assert loads and all(n.dtype == "bfloat16" for n in loads)
        assert not any(n.op == "cast" and n.args[0].op == "load" and n.args[0].attrs[0] == "g" for n in spec.walk())
    after = evaluate(plan, _inputs(), None)
    for got, expected in zip(after, before):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    narrow_stores(plan)  # again: nothing left to narrow
    assert plan.buffers["g"].dtype == "bfloat16" and plan.kernels[0].roots[0][0].args[0].op != "cast"


@pytest.mark.parametrize("how", ["a reader takes the float32 value", "the buffer is returned"])
def test_a_buffer_wanted_wide_keeps_its_dtype(how):
    plan = _plan(second_reader_casts=how != "a reader takes the float32 value",
                 returned=how == "the buffer is returned")
    narrow_stores(plan)
    assert plan.buffers["g"].dtype == "float32"
    assert plan.kernels[0].roots[0][0].op == "binary"


def test_narrowed_operands_make_plain_products_cublas_calls(monkeypatch):
    """The products read the narrowed buffer as stored: both become library calls."""
    monkeypatch.setattr(library, "FORCE", True)
    plan = _plan()
    narrow_stores(plan)
    library.library_products(plan)
    assert [type(s).__name__ for s in plan.steps] == ["KernelSpec", "LibraryCall", "LibraryCall"]


def test_a_widened_value_is_stored_as_it_was():
    """A kernel storing float32(bf16 value) that every reader casts back stores the value."""
    plan = _plan()
    x = _load("x", (M, K), "bfloat16")
    plan.kernels[0].roots = [(_cast(PNode("unary", ("neg",), (x,), (M, K), "bfloat16"), "float32"), "g")]
    narrow_stores(plan)
    root = plan.kernels[0].roots[0][0]
    assert root.op == "unary" and root.dtype == "bfloat16"
