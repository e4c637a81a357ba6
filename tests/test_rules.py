"""Soundness: both sides of every rewrite rule agree on random inputs."""

import pytest
import torch
from conftest import DEVICE, assert_matches

import eqfuse
from eqfuse.examples import EXAMPLES
from eqfuse.rewrite.rules import ALGEBRA, CAST_ROUNDTRIPS, MATMUL, SOFTMAX, TorchBuilder, catalogue, rulesets


def _draw(domain, gen):
    x = torch.randn(64, dtype=torch.float64, generator=gen, device="cpu") * 3
    if domain == "pos":
        return x.abs() + 0.1
    if domain == "bool":
        return torch.rand(64, generator=gen, device="cpu") > 0.5
    return x


@pytest.mark.parametrize("rule", ALGEBRA, ids=lambda r: r.name)
def test_algebra_rule_is_sound(rule):
    gen = torch.Generator(device="cpu").manual_seed(hash(rule.name) % 2**31)
    for _ in range(5):
        domains = rule.domains or ("any",) * rule.arity
        xs = [_draw(d, gen) for d in domains]
        lhs, rhs = rule.pattern(TorchBuilder(), *xs)
        torch.testing.assert_close(torch.as_tensor(lhs, dtype=torch.float64),
                                   torch.as_tensor(rhs, dtype=torch.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rule", MATMUL, ids=lambda r: r.name)
def test_matmul_rule_is_sound(rule):
    gen = torch.Generator(device="cpu").manual_seed(hash(rule.name) % 2**31)
    for m, k, n in ((1, 1, 1), (5, 7, 3), (17, 33, 9)):
        a = torch.randn(m, k, dtype=torch.float64, generator=gen)
        b = torch.randn(k, n, dtype=torch.float64, generator=gen)
        s = torch.randn((), dtype=torch.float64, generator=gen) * 3
        lhs, rhs = rule.pattern(TorchBuilder(), a, b, s)
        torch.testing.assert_close(lhs, rhs, rtol=1e-10, atol=1e-10)


def test_scale_moves_to_the_cheaper_side_of_a_product():
    """x @ (w * 3): the scale on w [K, N] would be recomputed for each of the M / 128 row
    tiles; on the product it is applied once per output element, after the K loop."""
    def f(x, w):
        return x @ (w * 3.0)
    x, w = torch.randn(512, 200), torch.randn(200, 16)
    c = eqfuse.compile(f, (x, w))
    assert_matches(c(x, w), f(x, w), contraction=True)
    assert c.report["saturation"]["rules_fired"].get("dot-scale-right", 0) >= 1
    assert len(c.kernels) == 1
    body = c.kernels[0].source
    assert body.index("3.0") > body.index("tl.dot"), body


@pytest.mark.parametrize("narrow,wide", CAST_ROUNDTRIPS)
def test_cast_roundtrip_is_identity(narrow, wide):
    x = (torch.randn(1000) * 100).to(getattr(torch, narrow))
    assert torch.equal(x.to(getattr(torch, wide)).to(getattr(torch, narrow)), x)


def test_every_rule_is_in_the_catalogue_and_built():
    names = {name for _, name, _ in catalogue()}
    assert {r.name for r in ALGEBRA} | {r.name for r in MATMUL} | {r.name for r in SOFTMAX} <= names
    assert "fuse-load-kernel" in names
    assert set(rulesets()) == {"algebra", "views", "fusion"}


@pytest.mark.parametrize("name", ["rmsnorm", "softmax", "residual_layernorm", "causal_softmax"])
def test_fusion_rule_is_sound_and_fuses(name):
    """Load(Kernel(u)) == u: with the rule, one kernel; without it, one per op; both equal eager."""
    ex = EXAMPLES[name]
    inputs = ex.make_inputs(4, 24, torch.float32, DEVICE)
    fused = eqfuse.compile(ex.fn, inputs)
    unfused = eqfuse.compile(ex.fn, inputs, rules=("algebra", "views"))
    assert_matches(fused(*inputs), ex.fn(*inputs))
    assert_matches(unfused(*inputs), ex.fn(*inputs))
    assert len(fused.kernels) == 1 < len(unfused.kernels)
    assert fused.report["saturation"]["rules_fired"]["fuse-load-kernel"] > 0


def test_reshape_reshape_rule_is_sound():
    def f(x):
        return (x * 2).reshape(6, 4).reshape(3, 8) + 1
    x = torch.randn(4, 6)
    c = eqfuse.compile(f, (x,))
    assert_matches(c(x), f(x))
    assert c.report["saturation"]["rules_fired"].get("reshape-reshape", 0) >= 1


def test_spellings_meet():
    """x / (1 + exp(-x)) and x * sigmoid(x) compile to the same kernel body."""
    def spelled(x):
        return x / (1 + torch.exp(-x))
    x = torch.randn(8, 8)
    c = eqfuse.compile(spelled, (x,))
    assert_matches(c(x), spelled(x))
    assert "tl.sigmoid" in c.source and "tl.exp" not in c.source


@pytest.mark.parametrize("seed", range(5))
def test_view_rules_are_sound(seed):
    """reshape(reshape(x, s1), s2) == reshape(x, s2); reshape(x:s, s) == x; broadcast(x:s, s) == x."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dims = [int(d) for d in torch.randint(1, 5, (3,), generator=gen, device="cpu")]
    x = torch.randn(*dims, generator=gen, device="cpu")
    s1 = (dims[0] * dims[1], dims[2])
    s2 = (dims[0], dims[1] * dims[2])
    assert torch.equal(x.reshape(s1).reshape(s2), x.reshape(s2))
    assert torch.equal(x.reshape(x.shape), x)
    assert torch.equal(x.broadcast_to(x.shape), x)


@pytest.mark.parametrize("rule", SOFTMAX, ids=lambda r: r.name)
def test_softmax_rule_is_sound(rule):
    """Both sides on random scores, values and positive row factors; a score row may be
    far from zero (the row max is what keeps exp finite) and hold -inf (a mask)."""
    gen = torch.Generator(device="cpu").manual_seed(hash(rule.name) % 2**31)
    for b, m, n, d in ((1, 1, 1, 1), (2, 5, 7, 3), (3, 17, 33, 9)):
        s = torch.randn(b, m, n, dtype=torch.float64, generator=gen) * 4 + 30
        s[..., 1:][torch.rand(b, m, n - 1, generator=gen) < 0.3] = float("-inf")
        v = torch.randn(b, n, d, dtype=torch.float64, generator=gen)
        r = torch.rand(b, m, 1, dtype=torch.float64, generator=gen) + 0.5
        x = torch.exp(s - s.amax(-1, keepdim=True)) if rule.row_factor else s
        lhs, rhs = rule.pattern(TorchBuilder(), x, v, r)
        tol = 1e-10 if rule.exact else 2e-3  # float16 rounding of the weights
        torch.testing.assert_close(lhs, rhs, rtol=tol, atol=tol)
