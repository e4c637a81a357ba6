"""Buffers stored in the order the products reading them want (eqfuse/codegen/store_order.py):
a [B, H, S, D] value that products read as [B * S, H * D] is stored in [B, S, H, D] order,
so that cuBLAS takes them, and every output is the same, bit for bit."""

import copy

import pytest
import torch

from eqfuse.codegen import library
from eqfuse.codegen.module import prepare
from eqfuse.codegen.store_order import order_stores, permuted_strides
from eqfuse.rewrite.validate import evaluate
from eqfuse.schema.plan import Buffer, KernelSpec, LibraryCall, Plan, PNode, contiguous_strides

B, H, S, D, N = 2, 4, 8, 16, 32  # rows whole multiples of 16 bytes, as cuBLAS takes them
HEADS = (B, H, S, D)


def _load(name, shape, dtype="bfloat16"):
    return PNode("load", (name, contiguous_strides(shape), 0), (), shape, dtype)


def _rows(node, perm=(0, 2, 1, 3)):
    """``node`` [B, H, S, D] permuted by ``perm`` and flattened to rows of its last two dims."""
    shape = tuple(node.shape[d] for d in perm)
    permuted = PNode("permute", (perm,), (node,), shape, node.dtype)
    return PNode("reshape", (), (permuted,), (shape[0] * shape[1], shape[2] * shape[3]), node.dtype)


def _plan(returned: bool = False, perm=(0, 2, 1, 3), pointwise_reader: bool = True) -> Plan:
    """g = x * y stored as [B, H, S, D]; o1 = rows(g) @ w (the input's gradient); o2 =
    rows(g)^T @ v (the weight's); o3 = g + 1 read in g's own order."""
    x, y = _load("x", HEADS), _load("y", HEADS)
    g = PNode("binary", ("mul",), (x, y), HEADS, "bfloat16")
    rows = _rows(_load("g", HEADS), perm)
    m, k = rows.shape
    w, v = _load("w", (k, N)), _load("v", (m, N))
    first = PNode("dot", (), (rows, w), (m, N), "bfloat16")
    second = PNode("dot", (), (PNode("permute", ((1, 0),), (rows,), (k, m), "bfloat16"), v), (k, N), "bfloat16")
    one = PNode("broadcast", (), (PNode("const", (1.0,), (), (), "bfloat16"),), HEADS, "bfloat16")
    third = PNode("binary", ("add",), (_load("g", HEADS), one), HEADS, "bfloat16")
    buffers = {name: Buffer(name, shape, "bfloat16", kind) for name, shape, kind in [
        ("x", HEADS, "input"), ("y", HEADS, "input"), ("w", (k, N), "input"), ("v", (m, N), "input"),
        ("g", HEADS, "temp"), ("o1", (m, N), "temp"), ("o2", (k, N), "temp"), ("o3", HEADS, "temp")]}
    outputs = [("buffer", "o1"), ("buffer", "o2")] + [("buffer", "o3")] * pointwise_reader \
        + [("buffer", "g")] * returned
    steps = [KernelSpec("k0", [(g, "g")]), KernelSpec("k1", [(first, "o1")]), KernelSpec("k2", [(second, "o2")])]
    steps += [KernelSpec("k3", [(third, "o3")])] * pointwise_reader
    return Plan([buffers[n] for n in "xywv"], buffers, steps, outputs)


def _inputs(plan):
    torch.manual_seed(0)
    tensors = [torch.randn(b.shape).bfloat16() for b in plan.inputs]
    flat = tensors[0].view(-1)
    flat[:7] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.0e38, 0.0])
    return tensors


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(library, "FORCE", True)


def test_permuted_strides_make_the_permute_contiguous():
    t = torch.empty_strided(HEADS, permuted_strides(HEADS, (0, 2, 1, 3)))
    assert t.permute(0, 2, 1, 3).is_contiguous()


def test_a_buffer_products_read_permuted_is_stored_in_their_order(forced):
    plan = _plan()
    before = evaluate(copy.deepcopy(plan), _inputs(plan), None)
    assert library.library_call(plan.kernels[1], plan.buffers) is None  # [B, H, S, D] read as rows: no strides do
    order_stores(plan)
    assert plan.buffers["g"].strides == permuted_strides(HEADS, (0, 2, 1, 3))
    loads = [n for spec in plan.kernels for n in spec.walk() if n.op == "load" and n.attrs[0] == "g"]
    assert loads and all(n.attrs[1] == plan.buffers["g"].strides for n in loads)
    after = evaluate(copy.deepcopy(plan), _inputs(plan), None)
    for got, expected in zip(after, before):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    library.library_products(plan)
    assert [type(s).__name__ for s in plan.steps] == ["KernelSpec", "LibraryCall", "LibraryCall", "KernelSpec"]
    order_stores(plan)  # again: nothing changes
    assert plan.buffers["g"].strides == permuted_strides(HEADS, (0, 2, 1, 3))


def test_prepare_orders_stores_on_a_gpu_plan_only(forced):
    plan = _plan()
    prepare(plan, library=True, padded=True)
    assert sum(isinstance(s, LibraryCall) for s in plan.steps) == 2
    sized = _plan()  # a sized module's strides follow its sizes: its buffers keep theirs
    prepare(sized, library=True)
    assert sized.buffers["g"].strides is None


@pytest.mark.parametrize("how", ["the buffer is returned", "the permute moves the unit-stride dim",
                                 "the permute gains no library call"])
def test_a_buffer_is_left_in_its_order(forced, how):
    perm = (0, 3, 2, 1) if how == "the permute moves the unit-stride dim" else (0, 2, 1, 3)
    plan = _plan(returned=how == "the buffer is returned", perm=perm)
    if how == "the permute gains no library call":  # products whose other operand is computed stay generated
        for spec in plan.kernels[1:3]:
            root, out = spec.roots[0]
            a, b = root.args
            b = PNode("unary", ("exp",), (b,), b.shape, b.dtype)
            spec.roots = [(PNode("dot", (), (a, b), root.shape, root.dtype), out)]
    roots = [list(spec.roots) for spec in plan.kernels]
    order_stores(plan)
    assert plan.buffers["g"].strides is None
    assert [list(spec.roots) for spec in plan.kernels] == roots
