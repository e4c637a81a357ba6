"""The precision policy (docs/design.md, "Precision"): by default a half-precision op's result stays
in float32 until a store or an explicit cast; with ``emulate_precision_casts`` each op's
result is rounded to its dtype, as eager rounds it."""

import pytest
import torch
from conftest import DEVICE

import eqfuse
from eqfuse.errors import EqfuseError
from eqfuse.examples import ATTENTION_EXAMPLES

EMULATE = {"emulate_precision_casts": True}


def compiled(fn, *inputs, **options):
    c = eqfuse.compile(fn, inputs, **options)
    assert c.kernels and not c.fallbacks, c.explain()
    return c(*inputs)


def representable(x: torch.Tensor, dtype) -> bool:
    return bool((x == x.to(dtype).to(x.dtype)).all())


@pytest.mark.parametrize("name,fn,make", [
    # fp16: 2048 + 1 rounds to 2048 before the cast to float32
    ("sum-then-widen", lambda x, y: (x + y).float(),
     lambda: (torch.tensor([2048.0, 1.0, -3.0], dtype=torch.float16), torch.ones(3, dtype=torch.float16))),
    # bf16: 1e-41 rounds to 0 (bf16 has fewer subnormals than float32), so logical_not is True
    ("underflow-then-test", lambda x: torch.logical_not(x * 0.001),
     lambda: (torch.tensor([1e-38, 1.0, 0.0], dtype=torch.bfloat16),)),
    # a reduction to one element, then an op on it: 257.5 rounds to 258, 259 to 260
    ("scalar-sum-then-add", lambda x: x.sum() + 1, lambda: (torch.tensor([256.0, 1.0, 0.5], dtype=torch.bfloat16),)),
])
def test_emulated_casts_give_eager_values_where_float32_intermediates_do_not(name, fn, make):
    inputs = tuple(x.to(DEVICE) for x in make())
    want = fn(*inputs)
    assert torch.equal(compiled(fn, *inputs, **EMULATE), want)
    assert not torch.equal(compiled(fn, *inputs), want)  # the default policy: float32 in between


def test_an_overflow_eager_has_is_computed_too_instead_of_sent_to_eager():
    """fp16 x * 1000 overflows at 100: float32 intermediates would not (the default sends
    such a graph to eager, its check finding the infinities differ); rounded, the kernel
    overflows as eager does."""
    x = torch.tensor([100.0, 1.0, -70.0], dtype=torch.float16)
    fn = lambda x: (x * 1000) / 1000  # noqa: E731
    assert torch.equal(compiled(fn, x, **EMULATE), fn(x))
    default = eqfuse.compile(fn, (x,))
    assert not default.kernels and "infinities differ" in default.explain()


@pytest.mark.parametrize("fn", [lambda x: x.exp().float(), lambda x: torch.rsqrt(x).sum(0, dtype=torch.float32)],
                         ids=["exp-then-widen", "rsqrt-then-float32-sum"])
def test_each_half_precision_result_is_rounded_before_float32_work(fn):
    """exp's result is a bf16 value (within one bf16 rounding of eager's: the two float32
    exps may differ by an ulp); rsqrt's values are rounded before the float32 sum."""
    torch.manual_seed(0)
    x = (torch.rand(64, 32) + 0.5).to(torch.bfloat16)
    want = fn(x)
    got = compiled(fn, x, **EMULATE)
    torch.testing.assert_close(got, want, rtol=2 ** -8, atol=0)
    if got.shape == x.shape:
        assert representable(got, torch.bfloat16) and not representable(compiled(fn, x), torch.bfloat16)
    else:
        assert (got - want).abs().max() < (compiled(fn, x) - want).abs().max()


def test_under_emulation_no_rule_drops_a_rounding():
    """The softmax forms that round the weights once for the product instead of where the
    graph rounds them (``exact=False``) stay off: a bf16 attention is still computed right,
    without them."""
    ex = ATTENTION_EXAMPLES["causal_attention"]
    torch.manual_seed(0)
    inputs = ex.make_inputs(1, 2, 17, 16, torch.bfloat16, DEVICE)
    c = eqfuse.compile(ex.fn, inputs, **EMULATE)
    fired = c.report["saturation"]["rules_fired"]
    assert not [r for r in fired if "rounded" in r or r.startswith("cast-bfloat16")], fired
    torch.testing.assert_close(c(*inputs), ex.fn(*inputs), rtol=2e-2, atol=2e-2)


def test_the_option_is_a_bool():
    with pytest.raises(EqfuseError, match="emulate_precision_casts='yes': expected True or False"):
        eqfuse.compile(lambda x: x + 1, (torch.ones(2),), emulate_precision_casts="yes")
