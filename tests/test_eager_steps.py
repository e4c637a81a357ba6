"""Eager steps run by another implementation of their op (schema/eager_steps.py): the
same values as the op, on random and special inputs, and the op's name in reports."""

import pytest
import torch
from conftest import DEVICE

import eqfuse
from eqfuse.schema import eager_steps
from eqfuse.schema.eager_steps import embedding_backward, index_put, substituted
from eqfuse.schema.from_fx import step_op

aten = torch.ops.aten


def _gradients(dtype, tokens=64, width=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, tokens // 2, width, generator=g, device="cpu").to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,padding_idx", [(2, -1), (7, 3), (300, 0)])
def test_embedding_backward_by_atomic_adds_matches_aten(dtype, rows, padding_idx):
    grad = _gradients(dtype)
    draw = torch.Generator().manual_seed(1)
    indices = torch.randint(0, rows, grad.shape[:-1], generator=draw, device="cpu").to(DEVICE)
    indices[0, :3] = padding_idx if padding_idx >= 0 else 0
    # CUDA's ATen sums in float32 and rounds once (equal on an H200); the CPU's sums in the
    # gradient's dtype: the reference is the exact sum, rounded once (atomics add in any
    # order on a GPU: within one rounding of it)
    exact = aten.embedding_dense_backward(grad.double(), indices, rows, padding_idx, False)
    got = embedding_backward(grad, indices, rows, padding_idx, False)
    assert got.dtype == dtype and got.shape == exact.shape
    ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(got, exact.to(dtype), rtol=ulp, atol=1e-6)
    if padding_idx >= 0:
        assert not got[padding_idx].any()


def test_embedding_backward_special_values_land_in_their_rows():
    grad = torch.tensor([[[float("nan"), 1.0], [float("inf"), -0.0], [1e38, 3.4e38], [1e-45, -float("inf")]]])
    indices = torch.tensor([[0, 1, 2, 1]])
    expected = aten.embedding_dense_backward(grad, indices, 4, -1, False)
    got = embedding_backward(grad, indices, 4, -1, False)
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert torch.equal(got[3], torch.zeros(2))  # no token: zeros


def test_large_tables_and_counted_gradients_keep_atens_implementation(monkeypatch):
    calls = []
    real = aten.embedding_dense_backward

    class Spy:
        def __call__(self, *args):
            calls.append(args[2:])
            return real(*args)

    monkeypatch.setattr(eager_steps, "aten", type("A", (), {"embedding_dense_backward": Spy()}))
    grad, indices = _gradients(torch.float32), torch.zeros(2, 32, dtype=torch.long)
    embedding_backward(grad, indices, 10, -1, True)  # scale_grad_by_freq: counts per index
    monkeypatch.setattr(eager_steps, "ATOMIC_TABLE_ELEMENTS", 10 * 16 - 1)
    embedding_backward(grad, indices, 10, -1, False)
    assert calls == [(10, -1, True), (10, -1, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 16), (5, 3, 4)])
def test_an_accumulating_index_put_of_rows_sums_as_aten(dtype, shape):
    """Rows named again and again (negative indices among them), values broadcast over
    the index's shape, onto a table that is not zero: the exact sum rounded once (CUDA's
    ATen; the CPU's adds in the dtype); special values land in their rows. The input is
    left as it was."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    x[0].view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    index = torch.randint(-shape[0], shape[0], (3, 10), generator=g).to(DEVICE)
    values = torch.randn(10, *shape[1:], generator=g).to(DEVICE, dtype)
    before = x.clone()
    exact = aten.index_put(x.double(), [index], values.double(), True)
    got = index_put(x, [index], values, True)
    assert got.dtype == dtype and torch.equal(x.nan_to_num(), before.nan_to_num()) and x.isnan().sum() == 1
    ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(got, exact.to(dtype), rtol=ulp, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("case", ["not accumulating", "two index tensors", "a mask", "deterministic"])
def test_index_puts_the_atomic_adds_do_not_take_are_atens(case, monkeypatch):
    calls = []
    real = aten.index_put.default
    monkeypatch.setattr(eager_steps, "aten", type("A", (), {"index_put": type("P", (), {
        "default": staticmethod(lambda *a: calls.append(a) or real(*a))})}))
    x, rows = torch.zeros(4, 3), torch.tensor([0, 2, 0])
    args = {"not accumulating": (x, [rows], torch.ones(3), False),
            "two index tensors": (x, [rows, rows], torch.ones(3), True),
            "a mask": (x, [torch.tensor([True, False, True, False])], torch.ones(3), True),
            "deterministic": (x, [rows], torch.ones(3), True)}[case]
    if case == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert torch.equal(index_put(*args), real(*args)) and len(calls) == 1


def test_the_step_keeps_its_ops_name():
    assert step_op(substituted(aten.embedding_dense_backward.default)) == "embedding_dense_backward"
    assert substituted(aten.add.Tensor) is aten.add.Tensor


def test_a_compiled_embedding_trains_as_eager(monkeypatch):
    ran = []
    monkeypatch.setitem(eager_steps.SUBSTITUTES, aten.embedding_dense_backward.default,
                        lambda *args: ran.append(args[2]) or embedding_backward(*args))
    emb = torch.nn.Embedding(5, 8, padding_idx=1)
    tokens = torch.tensor([[0, 1, 4, 4, 2], [1, 1, 3, 0, 4]])

    def loss(weight, tokens):
        return (torch.nn.functional.embedding(tokens, weight, padding_idx=1).tanh() * 3.0).sum()

    weight = emb.weight.detach().clone().requires_grad_()
    compiled = torch.compile(loss, backend="eqfuse")
    compiled(weight, tokens).backward()
    expected = weight.detach().clone().requires_grad_()
    loss(expected, tokens).backward()
    torch.testing.assert_close(weight.grad, expected.grad)
    assert not weight.grad[1].any()
    assert ran and set(ran) == {5}  # the backward's eager step ran the substitute


def test_a_compiled_accumulating_index_put_past_the_kernel_forms_bounds_runs_the_atomic_adds(monkeypatch):
    """Past the kernel form's bounds (frontend/decompose.py) the step is ATen's op, run
    by the atomic adds: the values are eager's."""
    from eqfuse.frontend import decompose
    ran = []
    monkeypatch.setattr(decompose, "CUMSUM_WORK", 0)
    monkeypatch.setitem(eager_steps.SUBSTITUTES, aten.index_put.default,
                        lambda *args: ran.append(len(args)) or index_put(*args))

    def fn(x, rows, values):
        return x.index_put((rows,), values * 2, accumulate=True) + 1
    x, rows, values = torch.randn(6, 4), torch.tensor([5, 0, 5, -1, 2]), torch.randn(5, 4)
    c = eqfuse.compile(fn, (x, rows, values))
    assert [f.op for f in c.fallbacks] == ["index_put"], c.explain()
    torch.testing.assert_close(c(x, rows, values), fn(x, rows, values))
    assert ran
