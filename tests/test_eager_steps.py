"""Eager steps run by another implementation of their op (schema/eager_steps.py): the
same values as the op, on random and special inputs, and the op's name in reports."""

import pytest
import torch
from conftest import DEVICE

from eqfuse.schema import eager_steps
from eqfuse.schema.eager_steps import embedding_backward, substituted
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
