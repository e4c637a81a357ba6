"""Random small graphs compiled against eager: pointwise ops, reductions, transposes,
softmax, products, casts and views over inputs of small odd sizes, broadcast here and
there. Each program is drawn from a seed, so a failure names the graph that shows it.
The cases below the generator are what it found (each failed before its fix)."""

import random

import pytest
import torch
from conftest import assert_matches

import eqfuse

UNARY = [lambda x: torch.exp(-x.abs()), torch.relu, torch.tanh, torch.sigmoid, torch.abs, torch.neg, torch.sin,
         torch.nn.functional.gelu, torch.nn.functional.silu, lambda x: x * 0.5]
BINARY = [torch.add, torch.mul, torch.sub, torch.maximum, torch.minimum, lambda a, b: a / (b.abs() + 1.0)]
REDUCE = [torch.sum, torch.amax, torch.mean]
STEPS = ["unary"] * 4 + ["binary"] * 4 + ["reduce"] * 2 + ["transpose", "softmax", "matmul", "cast", "view"]


def random_program(seed: int):
    """(input shapes, f): up to eight steps, each applied to values made before it."""
    rng = random.Random(seed)
    dims = [rng.choice([1, 3, 5, 7, 17, 33]) for _ in range(rng.choice([2, 3]))]
    shapes = []
    for _ in range(rng.choice([1, 2, 3])):
        shape = list(dims)
        if rng.random() < 0.3:
            shape[rng.randrange(len(shape))] = 1  # broadcast along one dim
        shapes.append(shape)
    steps = [(rng.choice(STEPS), rng.randrange(100), rng.randrange(100), rng.randrange(100), rng.random() < 0.5)
             for _ in range(rng.randint(2, 8))]

    def step(kind, a, b, k, flag):
        if kind == "binary" and a.shape == torch.broadcast_shapes(a.shape, b.shape) or \
                kind == "binary" and b.shape == torch.broadcast_shapes(a.shape, b.shape):
            return BINARY[k % len(BINARY)](a, b)
        if kind == "reduce":
            return REDUCE[k % len(REDUCE)](a, dim=k % a.dim(), keepdim=flag)
        if kind == "transpose" and a.dim() >= 2:
            return a.transpose(0, -1)
        if kind == "softmax":
            return torch.softmax(a, dim=-1)
        if kind == "matmul" and a.dim() >= 2:
            same = b.dim() == a.dim() and a.shape[-1] == b.shape[-2] and a.shape[:-2] == b.shape[:-2]
            return a @ b if same else a @ a.transpose(-1, -2)
        if kind == "cast":
            return a.half().float() if flag else a * 1.0
        if kind == "view":
            return a.reshape(-1) if flag else a.unsqueeze(0)
        return UNARY[k % len(UNARY)](a)

    def f(*inputs):
        values = list(inputs)
        for kind, i, j, k, flag in steps:
            a, b = values[i % len(values)], values[j % len(values)]
            try:
                values.append(step(kind, a, b, k, flag))
            except RuntimeError:  # shapes the step does not take: a pointwise op instead
                values.append(UNARY[k % len(UNARY)](a))
        made = values[len(inputs):]
        return (made[-1], made[-2]) if len(made) >= 2 and steps[-1][4] else made[-1]
    return shapes, f


@pytest.mark.parametrize("seed", range(48))
def test_random_graph_matches_eager(seed):
    shapes, f = random_program(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    inputs = [torch.randn(*s, generator=gen).to(torch.get_default_device()) for s in shapes]
    ref = f(*inputs)
    assert all(torch.isfinite(r).all() for r in (ref if isinstance(ref, tuple) else (ref,)))  # the ops are bounded
    c = eqfuse.compile(f, inputs)
    assert "internal" not in c.report.get("note", ""), c.report["note"]
    assert_matches(c(*inputs), ref)


# What the generator found

def test_a_product_of_scalar_operands_with_k_past_the_block():
    # [1 x 1] @ [1 x 1]: each operand one value for the whole tile, zeroed past K = 1
    # (it was made a row of the tile by the mask, then given to tl.full, which takes scalars)
    f = lambda a, b: torch.minimum(a @ b, a * 0.5)  # noqa: E731
    a, b = torch.randn(1, 1), torch.randn(1, 1)
    c = eqfuse.compile(f, (a, b))
    assert_matches(c(a, b), f(a, b))
    assert len(c.kernels) == 1


def test_a_scaled_column_times_a_row_keeps_its_product():
    # 2.0 * r with r of shape [M, 1] is no row-scaled operand for the softmax rules: taken
    # for one, it left a product of a scalar and the graph fell back to eager
    f = lambda x, y: (x.sum(1, keepdim=True) * 2.0) @ y  # noqa: E731
    x, y = torch.randn(5, 3), torch.randn(1, 7)
    c = eqfuse.compile(f, (x, y))
    assert "note" not in c.report, c.report.get("note")
    assert_matches(c(x, y), f(x, y))


def test_attention_with_values_one_wide():
    # D = 1: the output tile and a value per row have as many elements; both are stored
    # over the tile's d lanes, masked past the first
    f = lambda s, v: (torch.softmax(s, -1) @ v, torch.softmax(s, -1).sum(-1, keepdim=True))  # noqa: E731
    s, v = torch.randn(9, 5), torch.randn(5, 1)
    c = eqfuse.compile(f, (s, v))
    assert "note" not in c.report, c.report.get("note")
    assert_matches(c(s, v), f(s, v))
