"""Concatenations written in place (eqfuse/codegen/concat.py): a concatenation's parts
are stored into its buffer, by the kernels that compute them, and no kernel copies them
there; the outputs are eager's, on ordinary and special values."""

import copy

import pytest
import torch

import eqfuse
from eqfuse.codegen import library
from eqfuse.codegen.concat import _joined_products, concat_in_place
from eqfuse.codegen.module import generate_module
from eqfuse.rewrite.validate import evaluate
from eqfuse.schema.plan import Buffer, KernelSpec, Plan, PNode, contiguous_strides

SPECIAL = [float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.0e38]


@pytest.fixture
def cublas(monkeypatch):
    """Plain products as library calls, as on a GPU: the plan then stores the concatenation."""
    monkeypatch.setattr(library, "FORCE", True)
    monkeypatch.delenv(library.ENV, raising=False)


def swiglu_backward(gu, dy, w, x):
    """A fused gate-and-up projection's backward, as a training step computes it: the
    gate's and the up projection's gradients joined for the fused weight, whose input
    gradient (split into two products) and weight gradient read them."""
    g, u = gu.chunk(2, -1)
    s = torch.sigmoid(g)
    grad = torch.cat([dy * u * s * (1 + g * (1 - s)), dy * g * s], -1)
    return grad @ w, grad.t() @ x


def _swiglu_inputs(special: bool = False):
    torch.manual_seed(0)
    m, i, h = 256, 1024, 128
    gu, dy = torch.randn(m, 2 * i), torch.randn(m, i)
    if special:
        gu[0, :6] = torch.tensor(SPECIAL)
        gu[1, i:i + 6] = torch.tensor(SPECIAL)
        dy[2, :6] = torch.tensor(SPECIAL)
    return gu, dy, torch.randn(2 * i, h) / 32, torch.randn(m, h)


def _stored_concatenations(plan) -> list:
    return [out for spec in plan.kernels for root, out in spec.roots if root.op == "cat"]


@pytest.mark.parametrize("special", [False, True], ids=["random", "special values"])
def test_parts_computed_by_another_kernel_are_stored_into_the_concatenation(cublas, special):
    args = _swiglu_inputs(special)
    compiled = eqfuse.compile(swiglu_backward, args)
    views = {b.name: b.view_of for b in compiled.plan.buffers.values() if b.view_of is not None}
    assert len(views) == 2 and len({base for base, _ in views.values()}) == 1, views
    assert _stored_concatenations(compiled.plan) == []
    assert len(compiled.kernels) == 1  # the parts' kernel; the copy into the concatenation is gone
    # the input gradient, split into a product per part, is one product of the concatenation again
    assert [c.description for c in compiled.library_calls] == ["[256 x 2048] @ [2048 x 128] float32",
                                                               "[2048 x 256] @ [256 x 128] float32"]
    for got, want in zip(compiled(*args), swiglu_backward(*args)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("special", [False, True], ids=["random", "special values"])
def test_parts_one_kernel_computes_are_each_computed_once_into_the_concatenation(cublas, special):
    def weight_gradient(gu, dy, w, x):
        g, u = gu.chunk(2, -1)
        s = torch.sigmoid(g)
        return torch.cat([dy * u * s * (1 + g * (1 - s)), dy * g * s], -1).t() @ x

    args = _swiglu_inputs(special)
    compiled = eqfuse.compile(weight_gradient, args)
    (spec,) = compiled.plan.kernels
    assert [compiled.plan.buffers[out].view_of[1] for _, out in spec.roots] == [0, 1024]
    assert "tl.where" not in compiled.source  # each element computes its own part alone
    torch.testing.assert_close(compiled(*args), weight_gradient(*args), rtol=1e-4, atol=1e-4, equal_nan=True)


def test_a_part_the_graph_returns_keeps_its_own_buffer(cublas):
    def f(gu, dy, w, x):
        g, u = gu.chunk(2, -1)
        dg = dy * torch.sigmoid(g) * u
        grad = torch.cat([dg, dy * g], -1)
        return grad @ w, grad.t() @ x, dg

    args = _swiglu_inputs()
    compiled = eqfuse.compile(f, args)
    returned = compiled.plan.outputs[2][1]
    assert compiled.plan.buffers[returned].view_of is None
    for got, want in zip(compiled(*args), f(*args)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _load(name, shape):
    return PNode("load", (name, contiguous_strides(shape), 0), (), shape, "float32")


def _unary(fn, x):
    return PNode("unary", (fn,), (x,), x.shape, x.dtype)


def _cat(*parts, dim=1):
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    node = parts[0]
    for p in parts[1:]:  # nested, as translation builds it
        joined = list(node.shape)
        joined[dim] += p.shape[dim]
        node = PNode("cat", (dim,), (node, p), tuple(joined), "float32")
    assert list(node.shape) == shape
    return node


def _plan(computed_second: bool) -> Plan:
    """k0 stores a = exp(x) and b = sin(x); k1 stores cat(a, b, cos(x)) (or, with
    ``computed_second``, cat(a, tanh(x), cos(x))); k2 reads the concatenation."""
    r, c = 8, 16
    x = _load("x", (r, c))
    a, b = _unary("exp", x), _unary("sin", x)
    second = _unary("tanh", x) if computed_second else _load("b", (r, c))
    joined = _cat(_load("a", (r, c)), second, _unary("cos", x))
    total = PNode("unary", ("neg",), (_load("cat", (r, 3 * c)),), (r, 3 * c), "float32")
    buffers = {name: Buffer(name, shape, "float32", kind) for name, shape, kind in [
        ("x", (r, c), "input"), ("a", (r, c), "temp"), ("b", (r, c), "temp"), ("cat", (r, 3 * c), "temp"),
        ("out", (r, 3 * c), "output")]}
    steps = [KernelSpec("k0", [(a, "a"), (b, "b")]), KernelSpec("k1", [(joined, "cat")]),
             KernelSpec("k2", [(total, "out")])]
    return Plan([buffers["x"]], buffers, steps, [("buffer", "out")])


def _x():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    x[0, :6] = torch.tensor(SPECIAL)
    return x


@pytest.mark.parametrize("computed_second", [False, True], ids=["loaded parts", "a computed part between"])
def test_loaded_parts_become_views_and_computed_ones_roots_of_their_own(computed_second):
    plan = _plan(computed_second)
    want = evaluate(copy.deepcopy(plan), [_x()], None)
    concat_in_place(plan)
    moved = {"a": 0} if computed_second else {"a": 0, "b": 16}
    assert {n: b.view_of for n, b in plan.buffers.items() if b.view_of and n in "ab"} == \
        {n: ("cat", off) for n, off in moved.items()}
    k1 = plan.kernels[1]
    assert _stored_concatenations(plan) == [] and len(k1.roots) == (2 if computed_second else 1)
    assert all(plan.buffers[out].view_of[0] == "cat" for _, out in k1.roots)
    got = evaluate(plan, [_x()], None)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    before = copy.deepcopy(plan)
    concat_in_place(plan)  # again: nothing left to move
    assert [s.roots for s in plan.kernels].__repr__() == [s.roots for s in before.kernels].__repr__()


def test_the_module_allocates_the_concatenation_where_its_first_part_is_written():
    plan = _plan(computed_second=False)
    source, infos = generate_module(plan, "cat", "test")
    body = source[source.index("def call_boxed"):]
    assert [i.name for i in infos] == ["k0", "k1", "k2"] and len(plan.kernels[1].roots) == 1  # k1: cos(x) alone
    assert body.index("cat = torch.empty_strided") < body.index("torch.as_strided(cat") < body.index("k0_launch")


@pytest.mark.parametrize("batched", [False, True], ids=["rows", "a batch of rows"])
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w stored transposed"])
@pytest.mark.parametrize("adjacent", [True, False], ids=["adjacent", "apart"])
def test_a_sum_of_products_over_adjacent_slices_is_one_product(transposed, adjacent, batched):
    """p0 and p1 views of one buffer side by side (or a column apart), each times its rows
    of w: the sum, its terms in either order, is p @ w over the joined slices; also where
    the parts are a batch of rows that the products see flattened, as a linear layer's."""
    r, k, n = 8, 16, 4
    gap = 0 if adjacent else 1
    width = 2 * k + gap
    x = _load("x", (r, width))
    parts = [PNode("slice", (1, i * (k + gap), 1), (_unary("exp", x),), (r, k), "float32")
             for i in range(2)]
    stored = (n, 2 * k + gap) if transposed else (2 * k + gap, n)
    rows = (2, r // 2) if batched else (r,)
    buffers = {"x": Buffer("x", (r, width), "float32", "input"), "w": Buffer("w", stored, "float32", "input"),
               "c": Buffer("c", (r, width), "float32", "temp"), "out": Buffer("out", (*rows, n), "float32", "output")}
    part_strides = contiguous_strides((*rows, width))
    for i in range(2):
        buffers[f"p{i}"] = Buffer(f"p{i}", (*rows, k), "float32", "temp", part_strides, ("c", i * (k + gap)))
    if batched:
        parts = [PNode("reshape", ((*rows, k),), (p,), (*rows, k), "float32") for p in parts]

    def rows_of_w(i):
        at = i * (k + gap)
        if transposed:
            load = PNode("load", ("w", (width, 1), at), (), (n, k), "float32")
            return PNode("permute", ((1, 0),), (load,), (k, n), "float32")
        return PNode("load", ("w", (n, 1), at * n), (), (k, n), "float32")

    def part(i):
        load = PNode("load", (f"p{i}", part_strides, 0), (), (*rows, k), "float32")
        return PNode("reshape", ((r, k),), (load,), (r, k), "float32") if batched else load

    dots = [PNode("dot", (), (part(i), rows_of_w(i)), (r, n), "float32") for i in range(2)]
    total = PNode("binary", ("add",), (dots[1], dots[0]), (r, n), "float32")
    if batched:
        total = PNode("reshape", ((*rows, n),), (total,), (*rows, n), "float32")
    spec = KernelSpec("k1", [(total, "out")])
    plan = Plan([buffers["x"], buffers["w"]], buffers,
                [KernelSpec("k0", [(parts[0], "p0"), (parts[1], "p1")]), spec], [("buffer", "out")])
    torch.manual_seed(0)
    inputs = [_x().repeat(1, 3)[:, :width], torch.randn(*stored)]
    want = evaluate(copy.deepcopy(plan), inputs, None)
    joined = _joined_products(spec, buffers)
    if not adjacent:
        assert joined is None
        return
    product = joined.args[0] if batched else joined
    assert joined.shape == (*rows, n) and product.op == "dot"
    a, b = product.args
    assert a.attrs == ("c", (width, 1), 0) and a.shape == (r, 2 * k)
    assert b.shape == (2 * k, n) and b.attrs == (("w", (1, width), 0) if transposed else ("w", (n, 1), 0))
    spec.roots = [(joined, "out")]
    torch.testing.assert_close(evaluate(plan, inputs, None), want, equal_nan=True)
