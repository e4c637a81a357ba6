"""The op coverage of the schema, one small function each, against eager PyTorch."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_matches

import eqfuse
import eqfuse.backend
from eqfuse.schema import ops

X = (5, 12)

CASES = {
    # pointwise
    "arith": (lambda x, y: (x + y) * (x - y) / (y.abs() + 1) - (-x), 2),
    "sub_alpha": (lambda x, y: torch.sub(x, y, alpha=2.5), 2),
    "unary": (lambda x: torch.exp(x) + torch.log(x.abs() + 1) + torch.sqrt(x.abs()) + torch.tanh(x)
              + torch.sigmoid(x) + torch.erf(x) + torch.sin(x) + torch.cos(x), 1),
    "log1p_expm1": (lambda x: torch.log1p(x.abs() * 1e-3) + torch.log1p(x.abs()) + torch.expm1(x * 1e-6)
                    + torch.expm1(x), 1),
    "rounding": (lambda x: torch.floor(x * 3) + torch.ceil(x * 3) + torch.reciprocal(x.abs() + 1), 1),
    "log2_exp2_trunc_sign": (lambda x: torch.log2(x.abs() + 1) + torch.log10(x.abs() + 1) + torch.exp2(x)
                             + torch.trunc(x * 3) + torch.sign(x) + torch.round(x * 4), 1),
    "trig_hyperbolic": (lambda x: torch.tan(x) + torch.sinh(x) + torch.cosh(x) + torch.asinh(x * 3)
                        + torch.acosh(x.abs() + 1) + torch.atanh(x.clamp(-0.99, 0.99)) + torch.atan(x * 4)
                        + torch.asin(x.clamp(-1, 1)) + torch.acos(x.clamp(-1, 1)), 1),
    "atan2_hypot": (lambda x, y: torch.atan2(x, y) + torch.hypot(x, y) + torch.atan2(x, y[:1] * 0 + 2), 2),
    "pow": (lambda x: x ** 2 + x.abs() ** 0.5 + x ** 3 + (x.abs() + 1) ** -0.5 + (x.abs() + 1) ** -1, 1),
    "pow_general": (lambda x: torch.nan_to_num(x ** 1.7, nan=-7.0) + x ** 4 + x ** 5 + (x.abs() + 0.5) ** -2.5
                    + x ** -3, 1),
    "pow_zero": (lambda x: (x * 0) ** 1.5 + (x * 0) ** 0 + (x * 0) ** -1, 1),
    "max_min_clamp": (lambda x, y: torch.maximum(x, y) + torch.minimum(x, y) + x.clamp(-0.5, 0.5)
                      + x.clamp(min=0) + x.clamp(max=0), 2),
    "where_cmp": (lambda x, y: torch.where(x > y, x, y * 2) + (x >= 0).float() + (x == y).float()
                  + (x != y).float() + (x < 0.5).float() + (x <= y).float(), 2),
    "logical": (lambda x, y: ((x > 0) & (y > 0)) | ~(x < y) ^ (y > 1), 2),
    "casts": (lambda x: (x * 10).to(torch.int32).to(torch.float32) + (x > 0).to(torch.float16).float()
              + x.half().float(), 1),
    "int_arith": (lambda x: (x * 10).to(torch.int64) * 3 - 1, 1),
    "int_bits": (lambda x: (((x * 100).to(torch.int32) >> 2) & 0xF | 0x30) ^ ((x * 10).to(torch.int32) << 3), 1),
    "int_to_bf16": (lambda x: (x * 100).to(torch.int32).to(torch.bfloat16) * 2, 1),
    "masked_fill": (lambda x: x.masked_fill(x < 0, -1.0), 1),
    "relu_gelu_silu": (lambda x: F.relu(x) + F.gelu(x) + F.silu(x) + F.gelu(x, approximate="tanh"), 1),
    "scalar_tensor_const": (lambda x: x + torch.tensor(2.0), 1),
    "leaky_hardtanh": (lambda x: F.leaky_relu(x, 0.1) + F.hardtanh(x) + F.softplus(x), 1),
    # reductions
    "sum_all": (lambda x: x.sum(), 1),
    "mean_dim0": (lambda x: x.mean(0), 1),
    "sum_dims": (lambda x: x.reshape(5, 3, 4).sum((0, 2), keepdim=True), 1),
    "amax_amin": (lambda x: x.amax(-1) - x.amin(-1, keepdim=True).squeeze(-1), 1),
    "var_std": (lambda x: x.var(-1) + x.std(0) .sum() + torch.var_mean(x, -1)[1], 1),
    "logsumexp": (lambda x: torch.logsumexp(x, -1), 1),
    "softmax_dim0": (lambda x: torch.softmax(x, 0), 1),
    "sum_bool": (lambda x: (x > 0).sum(-1), 1),
    "norm_by_sum": (lambda x: x / x.sum(-1, keepdim=True), 1),
    # views
    "permute_view": (lambda x: x.t().reshape(4, 15) * 2, 1),
    "computed_permute": (lambda x: (x * 2).t().contiguous() + 1, 1),
    "unsqueeze_expand": (lambda x: x.unsqueeze(0).expand(3, 5, 12) + 1, 1),
    "slice_select": (lambda x: x[1:4, 2:10:3] * 2 + x[2] [None, 2:5], 1),
    "computed_slice": (lambda x: (x + 1)[1:4, ::2] * (x * 2)[2, ::2], 1),
    "cat": (lambda x, y: torch.cat([x, y * 2, x[:, :3]], dim=1) + 1, 2),
    "cat_dim0": (lambda x, y: torch.cat([x + 1, y], dim=0), 2),
    "split": (lambda x: [t * i for i, t in enumerate(torch.split(x + 1, 5, dim=1))], 1),
    "flatten": (lambda x: (x * 2).flatten() + 1, 1),
    "arange": (lambda x: x + torch.arange(12, dtype=torch.float32), 1),
    "tril_triu": (lambda x: torch.tril(x[:, :5]) + torch.triu(x[:, 5:10], 1), 1),
    "outer_products_of_views": (lambda x, y: x[:, :1] * y[:1, :], 2),
    # multiple outputs and reuse
    "multi_out": (lambda x: (x.exp(), x.exp().sum(-1), x * 2), 1),
    "identity_and_view": (lambda x: (x, x.t()), 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_op(name):
    fn, nargs = CASES[name]
    torch.manual_seed(1)
    inputs = tuple(torch.randn(*X) for _ in range(nargs))
    compiled = eqfuse.compile(fn, inputs)
    assert compiled.fallbacks == [], compiled.fallbacks
    assert_matches(compiled(*inputs), fn(*inputs))


@pytest.mark.parametrize("dim, size, step", [(1, 3, 2), (0, 2, 1), (-1, 5, 1), (2, 1, 3), (1, 9, 4), (0, 4, 4)])
def test_unfold_is_an_indexed_read(dim, size, step):
    """``Tensor.unfold``'s windows read at their positions in one kernel, bit for bit
    eager's values (its view's), special values included."""
    x = _with_specials((4, 9, 5))
    f = lambda x: x.unfold(dim, size, step)  # noqa: E731
    c = eqfuse.compile(f, (x,))
    assert len(c.kernels) == 1 and not c.fallbacks, c.explain()
    got, want = c(x), f(x)
    assert got.shape == want.shape and torch.equal(got.view(torch.int32), want.contiguous().view(torch.int32))


def test_unfold_of_a_0d_tensor_is_the_value_as_one_window():
    x = torch.tensor(-0.0)
    c = eqfuse.compile(lambda x: x.unfold(0, 1, 1) * 3.0, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got = c(x)
    assert got.shape == (1,) and torch.signbit(got).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("base", [2.0, 10.0, 0.5, 3.14159, 1e-3])
def test_a_positive_scalar_to_a_tensor_power_is_exp2_on_special_values(base, dtype):
    """``base ** x`` (``__rpow__``) for a positive scalar base: exp2(x log2(base)), exp2
    itself for base 2. NaN where torch has NaN, infinities and zeros where it has them,
    values within a few ulps (float32; one rounding in half precision)."""
    x = torch.tensor(SPECIAL + [0.3, -0.3, 1e-6, 3.0, -3.0, 20.0, -20.0, 37.9, -37.9, 127.5, -149.5, 1e4, -1e4])
    x = x.to(dtype)
    f = lambda x: base ** x  # noqa: E731
    c = eqfuse.compile(f, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), f(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), (x, got, want)
    rtol = 4e-6 if dtype == torch.float32 else {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-37, equal_nan=True)


POWER_VALUES = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, -3.0,
                2.5, -2.5, 1e-40, -1e-40, 1e30, 0.3, 127.5, -127.0, 200.0]


@pytest.mark.parametrize("dtype, exponent_dtype", [(torch.float32, None), (torch.float16, None),
                                                   (torch.bfloat16, None), (torch.float32, torch.int32)])
def test_a_tensor_to_a_tensor_power_is_cs_pow_on_every_pair_of_special_values(dtype, exponent_dtype):
    """``x ** y`` of two tensors: the magnitude as exp2(y log2|x|), the signs, NaN, ones,
    zeros and infinities as C's pow gives them (eager's), on every pair of special values."""
    import itertools
    pairs = list(itertools.product(POWER_VALUES, POWER_VALUES))
    x = torch.tensor([a for a, _ in pairs]).to(dtype)
    y = torch.tensor([b for _, b in pairs])
    if exponent_dtype is not None:
        y = y.nan_to_num(0.0, 1e6, -1e6).clamp(-300, 300).to(exponent_dtype)
    else:
        y = y.to(dtype)
    c = eqfuse.compile(torch.pow, (x, y))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x, y), torch.pow(x, y)
    assert got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), \
        [(a, b, g, w) for a, b, g, w in zip(x.tolist(), y.tolist(), got.tolist(), want.tolist())
         if (g != g) != (w != w) or (abs(g) == float("inf")) != (abs(w) == float("inf"))][:5]
    kept = ~want.isnan()
    assert torch.equal(torch.signbit(got[kept]), torch.signbit(want[kept]))
    rtol = 1e-5 if dtype == torch.float32 else {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-37, equal_nan=True)


@pytest.mark.parametrize("base", [1.0, 0.0, -2.0, 1.0 + 2 ** -30])
def test_a_scalar_base_of_one_or_below_stays_eager_with_its_reason(base):
    x = torch.tensor([float("nan"), float("inf"), 2.0, -0.5, 0.0, 3.0])
    c = eqfuse.compile(lambda x: base ** x, (x,))
    assert [f.op for f in c.fallbacks] == ["pow"] and "scalar base" in c.fallbacks[0].reason, c.explain()
    torch.testing.assert_close(c(x), base ** x, equal_nan=True)


def test_ldexp_is_a_kernel_exact_as_eagers():
    """``ldexp`` as a true ldexp, bit for bit: eager's is no ``x * 2.0 ** e`` (ldexp(0, 140)
    is 0 there, not NaN; ldexp(inf, -200) inf; ldexp(1e-40, 140) finite), denormal results
    rounded once, exponents past the float range."""
    x = torch.tensor(SPECIAL + [1.5, -3.0, 0.75, 1.0, -1.0, 3e-39, 0.0, 1e-40, 1.5, 1.5, 1.5, 3e38, -2.5, 7.0])
    e = torch.tensor([3, -200, 0, 5, 127, -126, 1, 140, -140, 0, -1, 2, 60, 140, 140, -149, -150, -151, -300,
                      1000, -1000])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        c = eqfuse.compile(torch.ldexp, (x.to(dtype), e))
        assert c.kernels and not c.fallbacks, c.explain()
        got, want = c(x.to(dtype), e), torch.ldexp(x.to(dtype), e)
        assert got.dtype == want.dtype
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~got.isnan()].view(torch.int8), want[~want.isnan()].view(torch.int8)), (got, want)


@pytest.mark.parametrize("name", sorted(ops.UNARY))
def test_unary_op_on_special_values(name):
    """Each unary op's Triton form against torch on NaN, infinities, signed zeros,
    denormals, the largest floats and ordinary values: NaN where torch has NaN, zeros of
    torch's sign, values to float32 rounding."""
    op = ops.UNARY[name]
    x = torch.tensor(SPECIAL + [0.3, -0.3, 1e-6, -1e-6, 1e-30, 3e38, -3e38, 20.0, -20.0, 100.0, -100.0])
    c = eqfuse.compile(lambda x: op.torch_fn(x), (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), op.torch_fn(x)
    assert torch.equal(got.isnan(), want.isnan()), (x, got, want)
    if want.dtype.is_floating_point:
        zeros = want == 0
        assert torch.equal(torch.signbit(got[zeros]), torch.signbit(want[zeros])), (x, got, want)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-37, equal_nan=True)
    else:
        assert torch.equal(got, want)


# Every value of these, each sign: magnitudes from 1e-8 to 1e4, steps across [-1.5, 1.5],
# and approaches to +-1 (where acosh, atanh, asin and acos turn)
_MAGNITUDES = torch.logspace(-8, 4, 1500)
DENSE = torch.cat([_MAGNITUDES, -_MAGNITUDES, torch.linspace(-1.5, 1.5, 1501), 1 + torch.logspace(-7, 0, 200),
                   1 - torch.logspace(-7, -0.01, 200), -1 + torch.logspace(-7, -0.01, 200)]).float()


@pytest.mark.parametrize("name", sorted(set(ops.UNARY) - ops.BOOL_UNARY))
def test_unary_op_within_a_few_ulps_across_its_range(name):
    """Each float unary op's Triton form within 4e-7 (about 3 ulps of float32) of the value
    in float64, where torch's float32 result is finite, and NaN where torch's is: tanh lost
    4e-4 of the value just above 2.4e-4 (2 sigmoid(2x) - 1), expm1 1.3e-3 at 2e-5 (exp(x) -
    1), atanh 2.5e-2 next to -1, before their forms here."""
    fn = ops.UNARY[name].torch_fn
    c = eqfuse.compile(lambda x: fn(x), (DENSE,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want, exact = c(DENSE), fn(DENSE), fn(DENSE.double())
    assert torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite()
    rel = ((got.double() - exact) / exact.abs().clamp_min(1e-30))[finite].abs()
    assert rel.max() <= 4e-7, (DENSE[finite][rel.argmax()], rel.max())


@pytest.mark.parametrize("e", [1.5, 2.5, 5.0, 7.0, -3.5, 1.7, 10.0, 0.1])
def test_pow_by_a_constant_within_an_ulp_across_sixty_decades(e):
    """x ** e as exp2(e log2|x|) in float64: in float32 the rounding of log2|x|, scaled by
    e, came to 9e-6 of the value, and results past the denormals' edge came out 0. Odd
    integer powers keep the sign, -0.0's included."""
    x = torch.cat([torch.logspace(-30, 30, 3000), torch.linspace(0, 4, 2001), -torch.logspace(-3, 3, 200),
                   torch.tensor([-0.0, float("inf"), -float("inf"), float("nan")])]).float()
    c = eqfuse.compile(lambda t: t ** e, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want, exact = c(x), x ** e, x.double() ** e
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isfinite() & ~want.isnan()], want[~want.isfinite() & ~want.isnan()])
    assert torch.equal(torch.signbit(got[want == 0]), torch.signbit(want[want == 0]))
    normal = (exact.abs() > 1.2e-38) & (exact.abs() < 3.4e38)
    rel = ((got.double() - exact) / exact.abs())[normal].abs()
    assert rel.max() <= 1.2e-7, (x[normal][rel.argmax()], rel.max())
    tiny = (exact.abs() <= 1.2e-38) & (exact != 0)
    assert torch.equal(got[tiny], exact[tiny].float())  # denormal results rounded once, not flushed


CUMSUMS = {
    "position ids": (lambda m: torch.cumsum(m, dim=1).type_as(m) * m,
                     lambda: torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])),
    "along dim 0": (lambda x: torch.cumsum(x, 0) * 2, lambda: torch.randn(7, 3)),
    "int32 kept": (lambda x: torch.cumsum(x, 0, dtype=torch.int32), lambda: torch.arange(9).reshape(3, 3)),
    "bools": (lambda b: torch.cumsum(b, 1), lambda: torch.arange(22).reshape(2, 11) % 3 == 0),
    "half": (lambda x: x.cumsum(-1) + 1, lambda: torch.randn(2, 3, 33).half()),
    "special values": (lambda x: x.cumsum(-1), lambda: torch.tensor([
        [1.0, float("nan"), 2.0, 3.0], [float("inf"), 1.0, -float("inf"), 1.0], [-0.0, -0.0, 1e-40, 3e38]])),
}


@pytest.mark.parametrize("name", list(CUMSUMS))
def test_cumsum_as_row_sums(name):
    """A cumulative sum as the row sums of a triangle of the row (frontend/decompose/):
    kernels, no eager step; its dtype as torch's (int64 for integers and bools, a dtype
    asked for kept), NaN and infinities carried on as eager carries them."""
    fn, make = CUMSUMS[name]
    x = make()
    c = eqfuse.compile(fn, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), fn(x)
    assert got.dtype == want.dtype
    if x.dtype == torch.half:  # float32 sums in another order than eager's scan: rounded to half,
        want = fn(x.float()).half()  # one may land an ulp from eager's
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-3 if x.dtype == torch.half else 1e-6, atol=1e-6)


PRODUCTS = {
    "prod of rows": lambda x: x.prod(-1),
    "prod of all": lambda x: x.prod(),
    "prod keepdim": lambda x: x.prod(0, keepdim=True) * 2,
    "prod in half": lambda x: torch.prod(x.half(), 1),
    "prod in float64": lambda x: x.prod(1, dtype=torch.float64),
    "cumprod": lambda x: x.cumprod(-1),
    "cumprod dim 0": lambda x: x.cumprod(0) * 2,
    "cumprod in half": lambda x: torch.cumprod(x.half(), 1),
}


@pytest.mark.parametrize("name", list(PRODUCTS))
def test_products_of_rows_are_reductions(name):
    """prod, and cumprod as the products over the triangle of each row (as cumsum's row
    sums): kernels, no eager step; NaN, infinities, zeros and their signs as eager's."""
    fn = PRODUCTS[name]
    x = torch.rand(4, 9) + 0.5
    x[0, 2], x[1, 3], x[1, 4], x[2, 0], x[3, 5] = float("nan"), float("inf"), 0.0, -0.0, -1e-30
    c = eqfuse.compile(fn, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), fn(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, equal_nan=True, rtol=2e-3 if got.dtype == torch.half else 1e-5, atol=0)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


SCANS = {  # (function, input): scans as row reductions over each element's prefix
    "cummax": (lambda x: torch.cummax(x, 1), "floats"),
    "cummin": (lambda x: torch.cummin(x, 1), "floats"),
    "cummax dim 0": (lambda x: torch.cummax(x, 0), "floats"),
    "cummax of ints": (lambda x: torch.cummax(x, 1), "ints"),
    "cummin of ints": (lambda x: torch.cummin(x, -1), "ints"),
    "logcumsumexp": (lambda x: torch.logcumsumexp(x, 1), "floats"),
    "logcumsumexp of infinities": (lambda x: torch.logcumsumexp(x, 1), "infinities"),
}
SCAN_INPUTS = {
    "floats": lambda: torch.tensor([[1., 3., 3., 2., float("nan"), 5., float("nan"), 7.],
                                    [0.5, -0.0, 0.0, -1., float("inf"), 2., float("-inf"), 1.]]),
    "ints": lambda: torch.tensor([[2, 1, 2, 2, 0, 0], [5, 5, 1, 9, 9, 3]]),
    "infinities": lambda: torch.tensor([[1., float("-inf"), float("inf"), 2.], [float("-inf")] * 4,
                                        [100., 200., 300., -1e30]]),
}


@pytest.mark.parametrize("name", list(SCANS))
def test_running_extremes_and_logcumsumexp_are_row_reductions(name):
    """cummax/cummin (the last position holding each prefix's extreme, NaN from the first
    NaN on, as torch's) and logcumsumexp (infinities as torch's): kernels, no eager step."""
    fn, inputs = SCANS[name]
    x = SCAN_INPUTS[inputs]()
    c = eqfuse.compile(fn, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), fn(x)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_a_histogram_with_its_range_is_a_reduction(dtype):
    """histc over a given range (a mixture of experts' tokens per expert): each bin's count
    of the elements in it, the top edge in the last bin, NaN and elements outside in none,
    as eager's; kernels, no eager step. A range from the data, or half widths, stay eager."""
    torch.manual_seed(0)
    x = torch.randn(60) * 3
    x[:5] = torch.tensor([float("nan"), 2.0, -2.0, 0.0, 1.2])
    x = x.nan_to_num(nan=99.0).to(dtype) if dtype == torch.int32 else x.to(dtype)
    fn = lambda x: torch.histc(x.float() if x.dtype == torch.int32 else x, 8, -2, 2)  # noqa: E731
    c = eqfuse.compile(fn, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), fn(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    if dtype != torch.int32:  # NaN and infinities met after compiling (a bin index cast from NaN raised)
        for odd in (torch.tensor(float("nan")), torch.tensor([float("inf")]), torch.tensor([float("-inf"), 1.0])):
            for f in (fn, lambda x: torch.histc(x, min=0, max=10)):  # (OpInfo's: 100 bins)
                finite = torch.full_like(odd, 0.5).to(dtype)
                c = eqfuse.compile(f, (finite,))
                assert torch.equal(c(finite), f(finite))  # the first launch, on the values compiled for
                assert c.kernels and torch.equal(c(odd.to(dtype)), f(odd.to(dtype))), c.explain()
    for stays in (lambda x: torch.histc(x, 4), lambda x: torch.histc(x.half(), 4, -1, 1)):
        c = eqfuse.compile(stays, (torch.randn(9),))
        assert [f.op for f in c.fallbacks] == ["histc"], c.explain()


TOPKS = {
    "top 2 of rows": lambda x: torch.topk(x, 2, dim=-1),
    "top 3 along dim 0": lambda x: torch.topk(x, 3, dim=0),
    "top 1": lambda x: x.topk(1),
    "router": lambda x: torch.topk(x.softmax(-1), 2),
}


@pytest.mark.parametrize("name", list(TOPKS))
def test_topk_of_a_few_is_passes_over_the_row(name):
    """topk of up to TOPK_PASSES (a mixture of experts' router): that many passes, each
    the largest not taken yet (NaN the largest, infinities, -0.0 as eager's); kernels, no
    eager step; the values eager's, each index one holding its value (torch leaves the
    order of ties open: eqfuse takes the lowest position)."""
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    if name != "router":  # (a softmax of a row holding NaN is NaN throughout: ties)
        x[0, 2], x[3, 1], x[4, 3] = float("nan"), float("inf"), -0.0
        x[2, :6] = float("-inf")
    fn = TOPKS[name]
    c = eqfuse.compile(fn, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    (values, indices), (want_values, want_indices) = c(x), fn(x)
    exact = {"rtol": 1e-6, "atol": 1e-7} if name == "router" else {"rtol": 0, "atol": 0}  # a softmax's ulp
    torch.testing.assert_close(values, want_values, equal_nan=True, **exact)
    dim = 0 if "dim 0" in name else -1
    source = x.softmax(-1) if name == "router" else x
    torch.testing.assert_close(source.gather(dim, indices), values, equal_nan=True, **exact)
    assert indices.dtype == want_indices.dtype


_ROWS = lambda x, i: x.gather(-1, i)  # noqa: E731 - the values at a row's indices
_ONE_PER_ROW = lambda x, i: x.gather(1, i.unsqueeze(1)).squeeze(1)  # noqa: E731
SORTS = {  # function, and where eager leaves the order of ties open, the values its indices hold
    "sort": (lambda x: torch.sort(x, stable=True), None),
    "sort descending along dim 0": (lambda x: torch.sort(x, dim=0, descending=True, stable=True), None),
    "sort, order of ties open": (lambda x: torch.sort(x), _ROWS),
    "argsort": (lambda x: torch.argsort(x, stable=True), None),
    "msort": (lambda x: torch.msort(x), None),
    "topk of the smallest": (lambda x: torch.topk(x, 5, largest=False), _ROWS),
    "topk of more than TOPK_PASSES": (lambda x: torch.topk(x, 7), _ROWS),
    "kthvalue": (lambda x: torch.kthvalue(x, 3, 1), _ONE_PER_ROW),
    "median along a dim": (lambda x: torch.median(x, 1), _ONE_PER_ROW),
    "median": (lambda x: torch.median(x), None),
    "nanmedian along a dim": (lambda x: torch.nanmedian(x, 1, keepdim=True), _ROWS),
    "nanmedian": (lambda x: torch.nanmedian(x), None),
    "sort of bools": (lambda x: torch.sort(x > 0, descending=True, stable=True), None),
}


@pytest.mark.parametrize("name", list(SORTS))
def test_sorts_are_ranks_over_the_rows_pairs(name):
    """sort, argsort, msort, topk beyond its passes, kthvalue, median and nanmedian as
    ranks (frontend/decompose/): kernels, no eager step; values eager's (NaN the
    largest, infinities, -0.0, denormals, ties), indices eager's where the order is
    stable, else each index one holding its value."""
    fn, held = SORTS[name]
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    x[0, 2], x[3, 1], x[4, 3], x[1, 5], x[2, 0] = float("nan"), float("inf"), -0.0, 1e-40, float("-inf")
    if held is None:  # ties: -0.0 and 0.0, infinities, finite values
        x[4, 4], x[2, 1:3], x[1, :2] = 0.0, float("-inf"), 2.5
    c = eqfuse.compile(fn, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), fn(x)
    if held is None:
        for g, w in zip(*((got, want) if isinstance(want, tuple) else ((got,), (want,)))):
            torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)
        return
    (values, indices), (want_values, want_indices) = got, want
    torch.testing.assert_close(values, want_values, equal_nan=True, rtol=0, atol=0)
    assert indices.dtype == want_indices.dtype and indices.shape == want_indices.shape
    torch.testing.assert_close(held(x, indices), values, equal_nan=True, rtol=0, atol=0)


def test_a_topk_whose_example_ties_eager_orders_otherwise_runs_in_eager_with_the_reason():
    """eqfuse's ties go to the lowest position; eager's topk orders them as its partial
    sort leaves them. Validation compares indices exactly, so such an example sends the
    graph to eager: eager's indices, and the reason (a limitation: ties are open)."""
    x = torch.tensor([[2.5, 2.5, 1.0, 0.0, 3.0, -1.0, 0.5, 2.0]])
    fn = lambda x: torch.topk(x, 7)  # noqa: E731
    want = fn(x)
    if torch.equal(want.indices, torch.sort(x, descending=True, stable=True).indices[:, :7]):
        pytest.skip("this torch orders topk's ties stably")
    c = eqfuse.compile(fn, (x,))
    assert not c.kernels and "differs from the graph" in c.fallbacks[0].reason, c.explain()
    assert torch.equal(c(x).indices, want.indices)


def test_integer_sorts_whose_order_of_ties_is_open_stay_eager():
    """Eager's order of tied integers is its algorithm's, and ties are common (a mixture
    of experts' expert ids): such sorts stay ATen's, stable ones are ranks."""
    x = torch.randint(0, 3, (4, 8))
    for fn, op in ((lambda x: torch.sort(x), "sort"), (lambda x: x.topk(2), "topk"),
                   (lambda x: torch.kthvalue(x, 2), "kthvalue"), (lambda x: torch.median(x, 1), "median")):
        c = eqfuse.compile(fn, (x,))
        assert [f.op for f in c.fallbacks] == [op], c.explain()
    c = eqfuse.compile(lambda x: torch.sort(x, stable=True), (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    for g, w in zip(c(x), torch.sort(x, stable=True)):
        assert torch.equal(g, w)


def test_a_sort_past_its_work_bound_stays_eager_with_its_reason(monkeypatch):
    from eqfuse.frontend.decompose import bounds

    monkeypatch.setattr(bounds, "CUMSUM_WORK", 4 * 8 * 8 - 1)  # one pair short
    x = torch.randn(4, 8)
    c = eqfuse.compile(lambda x: torch.sort(x), (x,))
    assert [f.op for f in c.fallbacks] == ["sort"], c.explain()
    for g, w in zip(c(x), torch.sort(x)):
        assert torch.equal(g, w)


def test_products_of_integers_stay_eager_with_their_reason():
    x = torch.arange(1, 13).reshape(3, 4)
    for fn, op in ((lambda x: x.prod(1), "prod"), (lambda x: x.cumprod(1), "cumprod")):
        c = eqfuse.compile(fn, (x,))
        assert [f.op for f in c.fallbacks] == [op] and c.fallbacks[0].reason, c.explain()
        assert torch.equal(c(x), fn(x))


def test_a_cumsum_too_long_for_row_sums_stays_eager_with_its_reason(monkeypatch):
    from eqfuse.frontend.decompose import bounds
    monkeypatch.setattr(bounds, "CUMSUM_WORK", 100)
    x = torch.randn(4, 33)
    c = eqfuse.compile(lambda x: x.cumsum(-1) * 2, (x,))
    assert any("cumsum" in f.reason for f in c.fallbacks), c.explain()
    torch.testing.assert_close(c(x), x.cumsum(-1) * 2)


PATCHES = {  # input, weight, stride: windows that tile the input
    "vit patches": ((2, 3, 32, 32), (8, 3, 16, 16), 16),
    "patches past the edge": ((2, 3, 33, 35), (8, 3, 16, 16), 16),
    "1x1": ((2, 4, 9, 9), (5, 4, 1, 1), 1),
    "1-d": ((2, 4, 10), (6, 4, 2), 2),
    "3-d": ((1, 2, 4, 6, 8), (3, 2, 2, 2, 2), 2),
}


@pytest.mark.parametrize("name", list(PATCHES))
def test_a_convolution_whose_windows_tile_the_input_is_a_product(name):
    """stride = kernel size, no padding (a vision transformer's patch embedding): a matrix
    product over a view of the input's patches (frontend/decompose/), no eager step; the
    output as eager's, contiguous as eager's, special values carried as eager's."""
    shape, weight_shape, stride = PATCHES[name]
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[len(shape)]
    fn = lambda x, w, b: conv(x, w, b, stride=stride)  # noqa: E731
    torch.manual_seed(0)
    x, w, b = torch.randn(shape), torch.randn(weight_shape), torch.randn(weight_shape[0])
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 3e38])
    c = eqfuse.compile(fn, (x, w, b))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x, w, b), fn(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(PATCHES))
@pytest.mark.parametrize("mask", [(True, True, True), (False, True, True)])  # (False: an image needs no gradient)
def test_the_backward_of_a_convolution_whose_windows_tile_the_input_is_products(name, mask):
    """``convolution_backward`` as a training graph holds it (a vision transformer's patch
    embedding): the input's, the weight's and the bias's gradients as products over the
    patches and a sum, no eager step; values as eager's, special values included."""
    shape, weight_shape, stride = PATCHES[name]
    dims = len(shape) - 2
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(weight_shape)
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 3e38])
    grad = torch.randn(torch.ops.aten.convolution(x, w, None, [stride] * dims, [0] * dims, [1] * dims, False,
                                                  [0] * dims, 1).shape)
    grad.view(-1)[:2] = torch.tensor([-0.0, 1e-40])

    def fn(grad, x, w):
        return torch.ops.aten.convolution_backward(grad, x, w, [weight_shape[0]], [stride] * dims, [0] * dims,
                                                   [1] * dims, False, [0] * dims, 1, list(mask))
    c = eqfuse.compile(fn, (grad, x, w))
    assert c.kernels and not c.fallbacks, c.explain()
    for got, want in zip(c(grad, x, w), fn(grad, x, w)):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-4, atol=1e-4 * want.abs().nan_to_num(
                0, 0, 0).max().item())


def test_other_convolutions_stay_eager_with_their_reason():
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    for fn in (lambda x, w: F.conv2d(x, w), lambda x, w: F.conv2d(x, w, stride=3, padding=1)):
        c = eqfuse.compile(fn, (x, w))
        assert [f.op for f in c.fallbacks] == ["convolution"], c.explain()
        torch.testing.assert_close(c(x, w), fn(x, w))


_B1, _B2 = torch.randn(3, 5, 4, device="cpu"), torch.randn(3, 4, 6, device="cpu")
DECOMPOSED = {  # function, inputs from (x, y) of shape [5, 6] with special values, exact
    "round to 3 decimals": (lambda x, y: torch.round(x, decimals=3), True),
    "round to -1 decimals": (lambda x, y: torch.round(x * 100, decimals=-1), True),
    "angle": (lambda x, y: torch.angle(x), True),
    "angle of integers": (lambda x, y: torch.angle((y * 4).int()), True),
    "addbmm": (lambda x, y: torch.addbmm(x, _B1.to(x.device), _B2.to(x.device)), False),
    "addbmm scaled": (lambda x, y: torch.addbmm(x, _B1.to(x.device), _B2.to(x.device), beta=0.5, alpha=2), False),
    "addbmm, beta 0": (lambda x, y: torch.addbmm(x, _B1.to(x.device), _B2.to(x.device), beta=0), False),
    "dist": (lambda x, y: torch.dist(y, x.nan_to_num(0, 0, 0)), False),
    "dist, p inf": (lambda x, y: torch.dist(y, x, float("inf")), False),
    "dist, p 1": (lambda x, y: torch.dist(y, x[:1].nan_to_num(0, 0, 0), 1), False),
    "cdist": (lambda x, y: torch.cdist(x, y), False),
    "cdist, p 1": (lambda x, y: torch.cdist(x.unsqueeze(0), y[:3].unsqueeze(0), p=1), False),
    "pdist": (lambda x, y: F.pdist(x), False),
    "pdist, p 3": (lambda x, y: F.pdist(y, p=3), False),
}


@pytest.mark.parametrize("name", list(DECOMPOSED))
def test_ops_torch_computes_in_other_terms_are_kernels(name):
    """round to decimals (ATen's own steps), angle of reals, addbmm (one product over the
    batch and the shared dim), dist, cdist and pdist (vector norms of differences):
    kernels, no eager step; eager's values, special values included (addbmm with beta 0
    reads no NaN of its input)."""
    fn, exact = DECOMPOSED[name]
    torch.manual_seed(0)
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    x.view(-1)[:5] = torch.tensor([float("nan"), float("inf"), -0.0, 1.2345, -1e-4])
    c = eqfuse.compile(fn, (x, y))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x, y), fn(x, y)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got, want, equal_nan=True, **tol)
    if exact:  # signed zeros too (a NaN's sign is the device's arithmetic's)
        numbers = ~want.isnan()
        assert torch.equal(got.signbit()[numbers], want.signbit()[numbers])


_IDX = torch.tensor([[0, 1, 2, 3, 0], [0, 1, 2, 3, 1], [3, 3, 0, 3, 1]])  # duplicates along dim 0
SCATTERS = {
    "scatter_add": lambda x, s: x.scatter_add(0, _IDX, s),
    "scatter, several values to a position": lambda x, s: x.scatter(0, _IDX, s),
    "scatter of a source larger than its index": lambda x, s: x.scatter(0, _IDX[:1], s),
    "scatter of a value": lambda x, s: x.scatter(1, _IDX[:, :4], 2.5),
    "scatter multiplying": lambda x, s: x.scatter(0, _IDX, s, reduce="multiply"),
    **{f"scatter_reduce {r}{'' if keep else ', not self'}": (
        lambda x, s, r=r, keep=keep: x.scatter_reduce(0, _IDX, s, r, include_self=keep))
       for r in ("sum", "prod", "mean", "amax", "amin") for keep in (True, False)},
    "scatter past the index's extent": lambda x, s: x.scatter_add(1, _IDX[:2, :3], s[:2, :3]),
    "index_reduce amax": lambda x, s: x.index_reduce(0, torch.tensor([1, 3, 1]), s, "amax"),
    "index_reduce mean": lambda x, s: x.index_reduce(1, torch.tensor([0, 4, 0]), s.t()[:4], "mean",
                                                     include_self=False),
    "index_reduce of a scalar": lambda x, s: x[0, 0].index_reduce(0, torch.tensor([0]), s[0, 0], "amin"),
    "scatter_add of a scalar": lambda x, s: x[1, 2].scatter_add(0, torch.tensor(0), s[2, 2]),
    "put at one position": lambda x, s: x.put(torch.tensor([3]), s.reshape(-1)[:1]),
    "as_strided_scatter": lambda x, s: torch.as_strided_scatter(x, s[:2, :2], (2, 2), (5, 2), 1),
    "as_strided_scatter, overlapping": lambda x, s: torch.as_strided_scatter(x, s[:2, :2], (2, 2), (1, 1), 3),
    "put": lambda x, s: x.put(torch.tensor([0, 7, -1, 7]), s.reshape(-1)[:4]),
    "put accumulating": lambda x, s: x.put(torch.tensor([0, 7, -1, 7]), s.reshape(-1)[:4], accumulate=True),
    "masked_scatter": lambda x, s: x.masked_scatter(x > 0, s.reshape(-1).repeat(2)),
}


def _scatter_inputs(dtype=torch.float32):
    torch.manual_seed(0)
    if not dtype.is_floating_point:
        return torch.randint(-5, 5, (4, 5), dtype=dtype), torch.randint(-9, 9, (3, 5), dtype=dtype)
    x, src = torch.randn(4, 5, dtype=dtype), torch.randn(3, 5, dtype=dtype)
    x[0, 0], x[1, 1], src[2, 3], src[0, 1], src[1, 2] = -0.0, float("nan"), float("inf"), 3e38, 1e-40
    return x, src


@pytest.mark.parametrize("name", list(SCATTERS))
def test_scatters_with_several_values_per_position_are_reductions_over_the_index(name):
    """scatter, scatter_add, scatter_reduce, index_reduce, put, as_strided_scatter and
    masked_scatter where several values name one position (frontend/decompose/): kernels
    only, eager's values, special values included (NaN carried by a maximum, -0.0 kept
    where nothing lands)."""
    fn = SCATTERS[name]
    x, src = _scatter_inputs()
    c = eqfuse.compile(fn, (x, src))
    assert c.kernels and not c.fallbacks, c.explain()
    torch.testing.assert_close(c(x, src), fn(x, src), equal_nan=True)


@pytest.mark.parametrize("offset,dim1,dim2", [(0, 0, 1), (1, 0, 1), (-2, 0, 1), (0, 2, 0), (1, -1, 1)])
def test_a_diagonal_scatter_reads_each_diagonal_element_in_place(offset, dim1, dim2):
    """diagonal_scatter (frontend/decompose/): src on the diagonal, each place reading
    its element, x elsewhere; one kernel, eager's values and special values."""
    torch.manual_seed(0)
    x = torch.randn(4, 5, 3)
    x[0, 0, 0], x[1, 2, 0] = -0.0, float("inf")
    src = torch.randn(x.diagonal(offset, dim1, dim2).shape)
    src.view(-1)[:2] = torch.tensor([float("nan"), -0.0])
    fn = lambda x, s: torch.diagonal_scatter(x, s, offset, dim1, dim2)  # noqa: E731
    c = eqfuse.compile(fn, (x, src))
    assert len(c.kernels) == 1 and not c.fallbacks, c.explain()
    got, want = c(x, src), fn(x, src)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("reduce", ["sum", "amax", "amin"])
def test_an_integer_scatter_reduce_is_exact(reduce):
    fn = lambda x, s: x.scatter_reduce(0, _IDX, s, reduce, include_self=False)  # noqa: E731
    x, src = _scatter_inputs(torch.int32)
    c = eqfuse.compile(fn, (x, src))
    assert c.kernels and not c.fallbacks, c.explain()
    assert torch.equal(c(x, src), fn(x, src))


def test_cdist_of_p_zero_or_infinite_stays_eager_with_its_reason():
    x, y = torch.randn(4, 3), torch.randn(5, 3)
    for p in (0.0, float("inf")):
        c = eqfuse.compile(lambda x, y, p=p: torch.cdist(x, y, p=p), (x, y))
        assert [f.op for f in c.fallbacks] == ["_cdist_forward"] and "bounds" in c.fallbacks[0].reason, c.explain()
        torch.testing.assert_close(c(x, y), torch.cdist(x, y, p=p))


def test_a_masked_scatter_short_of_values_gives_nan_where_eager_raises():
    fn = lambda x, m, s: x.masked_scatter(m, s)  # noqa: E731
    x, source = torch.randn(3, 4), torch.randn(5)
    few, many = torch.zeros(3, 4, dtype=torch.bool), torch.ones(3, 4, dtype=torch.bool)
    few[0, :3] = True
    c = eqfuse.compile(fn, (x, few, source))
    assert c.kernels and not c.fallbacks, c.explain()
    with pytest.raises(RuntimeError):
        fn(x, many, source)
    assert c(x, many, source).isnan().all()


def test_a_scatter_index_outside_the_tensor_gives_nan_where_eager_raises():
    fn = lambda x, s, i: x.scatter_add(0, i, s)  # noqa: E731
    x, src = _scatter_inputs()
    c = eqfuse.compile(fn, (x, src, _IDX))
    with pytest.raises(RuntimeError):
        fn(x, src, _IDX + 2)
    assert c(x, src, _IDX + 2).isnan().all()


FLIPS = {
    "last dim": (lambda x: x.flip(-1), torch.float32),
    "two dims": (lambda x: x.flip(0, 2) * 2, torch.float32),
    "beside itself": (lambda x: torch.flip(x, (1,)) + x, torch.float16),
    "of a slice": (lambda x: x[:, 1:].flip(1), torch.float32),
    "ints": (lambda x: x.flip(1) * 3, torch.int32),
    "bools": (lambda x: x.flip(2) & x, torch.bool),
}


@pytest.mark.parametrize("name", list(FLIPS))
def test_flip_reads_backwards_in_a_kernel(name):
    """``flip`` as each dim read backwards (frontend/decompose/): kernels, no eager step;
    every value, NaN, infinity and signed zero where eager puts it."""
    fn, dtype = FLIPS[name]
    x = (torch.randn(3, 4, 5) * 4).to(dtype)
    if dtype.is_floating_point:
        x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    c = eqfuse.compile(fn, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), fn(x)
    assert got.dtype == want.dtype and got.stride() == want.stride()
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    if dtype.is_floating_point:
        assert torch.equal(torch.signbit(got), torch.signbit(want))


POSITIONS = {
    "argmax": lambda x: x.argmax(-1),
    "argmin keepdim": lambda x: x.argmin(1, keepdim=True),
    "argmax of all": lambda x: x.argmax(),
    "argmax dim 0": lambda x: x.argmax(0),
    "max with index": lambda x: torch.max(x, 1),
    "min with index keepdim": lambda x: torch.min(x, 0, keepdim=True),
    "max of all": lambda x: x.max(),
    "min of all": lambda x: x.min() + 1,
}


def _rows_of_special_values():
    x = torch.randn(5, 7)
    x[0, 3] = x[0, 5] = float("nan")  # the first NaN is the extreme
    x[1] = 1.0  # ties: the first
    x[2] = -x[2].abs()
    x[2, 2], x[2, 4] = -0.0, 0.0  # equal: the first
    x[3, 1], x[3, 6] = float("inf"), -float("inf")
    x[4, :2] = torch.tensor([3e38, -3e38])
    return x


@pytest.mark.parametrize("name", list(POSITIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_argmax_argmin_and_max_with_its_index_are_kernels(name, dtype):
    """argmax/argmin, max/min with their indices and of all elements, as reductions
    (frontend/decompose/): kernels, no eager step; the index of the first extreme, NaN the
    extreme where a row has one, as eager's."""
    fn = POSITIONS[name]
    x = _rows_of_special_values()
    x = (x * 10).nan_to_num().to(dtype) if not dtype.is_floating_point else x.to(dtype)
    c = eqfuse.compile(fn, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), fn(x)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)


POOLS = {
    "avg tiles": lambda x: F.avg_pool2d(x, 2, ceil_mode=False),
    "avg overlapping, padded": lambda x: F.avg_pool2d(x, 3, 2, 1),
    "avg padding not counted": lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
    "avg divisor": lambda x: F.avg_pool2d(x, (2, 3), (1, 2), divisor_override=4),
    "avg 1-d": lambda x: F.avg_pool1d(x.flatten(2), 4, 3, 2),
    "avg 3-d": lambda x: F.avg_pool3d(x[..., :8].unsqueeze(0), 2),
    "adaptive avg": lambda x: F.adaptive_avg_pool2d(x[..., :8], (3, 4)),
    "adaptive avg to one": lambda x: F.adaptive_avg_pool2d(x, 1),
    "max tiles": lambda x: F.max_pool2d(x, 2),
    "max with indices": lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True),
    "max with indices, uneven": lambda x: F.max_pool2d(x, (2, 3), (1, 2), return_indices=True),
    "max 3-d with indices": lambda x: F.max_pool3d(x[..., :8].unsqueeze(0), 2, return_indices=True),
    "max 3-d padded": lambda x: F.max_pool3d(x.unsqueeze(0), (3, 2, 3), (1, 2, 2), (1, 0, 1), return_indices=True),
    "adaptive max": lambda x: F.adaptive_max_pool2d(x[..., :8], (3, 4), return_indices=True),
    "adaptive max 3-d": lambda x: F.adaptive_max_pool3d(x[:, :2, :8, :8].unsqueeze(0), (1, 2, 4), return_indices=True),
    "adaptive max to its own size": lambda x: F.adaptive_max_pool2d(x, (9, 10), return_indices=True),
}


@pytest.mark.parametrize("name", list(POOLS))
def test_pooling_over_windows_is_a_kernel(name):
    """Pooling (frontend/decompose/): a reduction over each tile where the windows tile
    the input, else the windows' strided views combined; one kernel, no eager step; NaN,
    infinities and ties as eager's, max pooling's indices the first largest's in its plane."""
    x = torch.randn(2, 3, 9, 10)
    x[0, 0, 1, 1], x[0, 1, 2, 2], x[1, 0, 3, :] = float("nan"), float("inf"), 5.0
    fn = POOLS[name]
    c = eqfuse.compile(fn, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), fn(x)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
        assert g.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()  # a result of its own
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-5, atol=1e-6)


def test_pooling_past_the_edge_stays_eager_with_its_reason():
    x = torch.randn(2, 3, 9, 10)
    fn = lambda x: F.avg_pool2d(x, 2, ceil_mode=True)  # noqa: E731
    c = eqfuse.compile(fn, (x,))
    assert [f.op for f in c.fallbacks] == ["avg_pool2d"] and c.fallbacks[0].reason, c.explain()
    torch.testing.assert_close(c(x), fn(x))


@pytest.mark.parametrize("fn", [torch.atan2, torch.hypot], ids=["atan2", "hypot"])
def test_atan2_and_hypot_on_every_pair_of_special_values(fn):
    """Every pair of NaN, infinities, signed zeros, denormals, the largest floats and
    ordinary values, then random values over twelve decades: NaN where torch has NaN, the
    infinities and zeros (with their signs) torch has, values within 3e-7 of float64's."""
    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, 1.0, -1.0, 0.5,
               -2.5, 1e-20, 7.0]
    g = torch.Generator().manual_seed(0)
    spread = [torch.randn(2000, generator=g) * 10.0 ** torch.randint(-6, 6, (2000,), generator=g) for _ in "ab"]
    a = torch.cat([torch.tensor(special).repeat_interleave(len(special)), spread[0]])
    b = torch.cat([torch.tensor(special).repeat(len(special)), spread[1]])
    c = eqfuse.compile(lambda a, b: fn(a, b), (a, b))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want, exact = c(a, b), fn(a, b), fn(a.double(), b.double())
    assert torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite()
    assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()])
    assert torch.equal(torch.signbit(got[want == 0]), torch.signbit(want[want == 0]))
    rel = ((got.double() - exact) / exact.abs().clamp_min(1e-30))[finite].abs()
    assert rel.max() <= 3e-7, (a[finite][rel.argmax()], b[finite][rel.argmax()], rel.max())


INT_DIVISIONS = {
    "floor": lambda x, b: torch.div(x, b, rounding_mode="floor"),
    "trunc": lambda x, b: torch.div(x, b, rounding_mode="trunc"),
    "//": lambda x, b: x // b, "remainder": lambda x, b: torch.remainder(x, b), "%": lambda x, b: x % b,
    "fmod": lambda x, b: torch.fmod(x, b)}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("divisor", [3, -3, 1, -1, 7])
@pytest.mark.parametrize("kind", list(INT_DIVISIONS))
def test_integer_division_by_a_constant(kind, divisor, dtype):
    """Floor and truncated quotients, Python's and C's remainders, of integers of both signs
    and the extremes (less the smallest, whose quotient by -1 eager itself traps on), as
    torch computes them: kernels, no eager step."""
    info = torch.iinfo(dtype)
    x = torch.tensor([7, -7, 6, -6, 0, 1, -1, 13, -13, info.max, info.min + 1], dtype=dtype)
    fn = INT_DIVISIONS[kind]
    c = eqfuse.compile(lambda x: fn(x, divisor), (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), fn(x, divisor)
    assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


@pytest.mark.parametrize("case", ["a tensor divisor", "float64"])
def test_divisions_without_a_kernel_form_stay_eager_with_their_reason(case):
    """A tensor divisor of integers (eager raises at a zero on the CPU, a kernel would hand
    back a number) and float64 remainders (the kernel form divides float32's significands)
    run in eager, saying so."""
    x = torch.tensor([7, -7, 6], dtype=torch.int64)
    fn, inputs, why = {
        "a tensor divisor": (lambda x, y: x // y + 1, (x, torch.tensor([2, 3, -4])), "by a tensor"),
        "float64": (lambda x: torch.remainder(x, 0.3) + 1, (x.double(),), "on float64"),
    }[case]
    c = eqfuse.compile(fn, inputs)
    assert any(why in f.reason for f in c.fallbacks), c.explain()
    torch.testing.assert_close(c(*inputs), fn(*inputs))


FLOAT_DIVISIONS = {"fmod": torch.fmod, "remainder": torch.remainder, "%": lambda a, b: a % b,
                   "floor": lambda a, b: torch.div(a, b, rounding_mode="floor"), "//": lambda a, b: a // b}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", list(FLOAT_DIVISIONS))
def test_float_remainders_and_floor_division_are_exact(kind, dtype):
    """fmod of floats by the long division of their significands, exact (a GPU's frem is
    not), and Python's remainder and floor division from it as torch computes them: every
    pair of NaN, infinities, signed zeros, denormals and the largest floats, and quotients
    over sixty decades, bit for bit. Where a / b overflows, the CPU's eager fmod gives NaN
    (it divides); C's fmod, and the kernel, give the exact remainder. Narrow floats are
    computed in float32 and rounded once (the CPU's eager floor division of float16
    rounds each step: -16800 // 11.86 is -1418 there, -1417 here and in float32)."""
    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, 1.0, -1.0, 0.5,
               -2.5, 1e-20, 7.0, 1e-45, 3.0]
    g = torch.Generator().manual_seed(0)
    spread = [torch.randn(1500, generator=g) * 10.0 ** torch.randint(-30, 30, (1500,), generator=g) for _ in "ab"]
    a = torch.cat([torch.tensor(special).repeat_interleave(len(special)), spread[0]]).to(dtype)
    b = torch.cat([torch.tensor(special).repeat(len(special)), spread[1]]).to(dtype)
    fn = FLOAT_DIVISIONS[kind]
    c = eqfuse.compile(lambda a, b: fn(a, b), (a.abs() + 1, b.abs() + 1))  # checked where eager divides in range
    assert c.kernels and not c.fallbacks, c.explain()
    got = c(a, b)
    wide, exact = fn(a.float(), b.float()), torch.fmod(a.double(), b.double()).to(dtype)
    overflow = (a.double() / b.double()).abs() > torch.finfo(torch.float32).max
    overflow &= a.isfinite() & b.isfinite() & (b != 0)
    if kind == "fmod":
        want = exact  # exact in float64 too, and representable
    else:
        want = wide.to(dtype) if dtype != torch.float32 else fn(a, b)
        got, want = got[~overflow], want[~overflow]
    assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan())
    same = got.float().view(torch.int32) == want.float().view(torch.int32)
    assert bool((same | got.isnan()).all()), (a[~overflow][~same][:4] if kind != "fmod" else a[~same][:4],
                                              got[~same][:4], want[~same][:4])


BIT_SPECIALS = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 1e-45, -1e-45,
                3.4028235e38, -3.4028235e38, 1.0, -1.0, 0.5, -2.5, 1e-20, 7.0, 1.1754944e-38]


def test_nextafter_steps_the_bits_as_eager():
    """Every pair of NaN, infinities, signed zeros, denormals (the smallest among them),
    the largest and the smallest normal floats: the float next to a toward b, bit for bit."""
    a = torch.tensor(BIT_SPECIALS).repeat_interleave(len(BIT_SPECIALS))
    b = torch.tensor(BIT_SPECIALS).repeat(len(BIT_SPECIALS))
    c = eqfuse.compile(torch.nextafter, (a, b))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(a, b), torch.nextafter(a, b)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_frexp_is_exact_as_eagers(dtype):
    """Mantissa and exponent of special values and of floats over eighty decades (denormals
    included), bit for bit: zeros, infinities and NaN their own mantissa with exponent 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(BIT_SPECIALS), torch.randn(2000, generator=g) * 10.0 ** torch.randint(
        -44, 38, (2000,), generator=g)]).to(dtype)
    c = eqfuse.compile(torch.frexp, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    (mantissa, exponent), (want_m, want_e) = c(x), torch.frexp(x)
    assert mantissa.dtype == dtype and torch.equal(exponent, want_e)
    assert torch.equal(mantissa.isnan(), want_m.isnan())
    finite = ~want_m.isnan()
    assert torch.equal(mantissa[finite].float().view(torch.int32), want_m[finite].float().view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("divisor", [30.0, -7.0, 1 / 3, 0.5, 1e-39, 3e38, 0.0])
def test_a_division_by_a_constant_is_a_product_by_its_reciprocal_within_an_ulp(divisor, dtype):
    """As Inductor lowers it (IEEE division costs as much as an exponential): NaN, infinities
    and signed zeros come out as eager's, other values (denormals and the largest float
    among them) within an ulp of float32 before their rounding to ``dtype``. Where the
    reciprocal is infinite or leaves the normal floats (1e-39, 3e38), and for zero, the
    kernel divides."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(BIT_SPECIALS), torch.randn(2000, generator=g) * 10.0 ** torch.randint(
        -40, 38, (2000,), generator=g)]).to(dtype)
    c = eqfuse.compile(lambda x: x / divisor, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    divides = any(" / " in line for line in c.kernels[0].source.splitlines() if "t" in line.split("=")[0])
    assert divides == (divisor in (1e-39, 3e38, 0.0)), c.kernels[0].source
    got, want = c(x), x / divisor
    assert torch.equal(got.isnan(), want.isnan())
    exact = (x == 0) | x.isinf()  # NaN's checked above
    same = got.float().view(torch.int32) == want.float().view(torch.int32)
    assert bool(same[exact & ~want.isnan()].all()), (x[exact][~same[exact]], got[exact][~same[exact]])
    wide = x.double() / float(torch.tensor(divisor, dtype=torch.float32))
    ulp = torch.finfo(dtype).eps * wide.abs().clamp_min(torch.finfo(torch.float32).tiny)
    finite = want.isfinite()
    assert bool(((got.double() - want.double()).abs()[finite] <= ulp[finite]).all())


@pytest.mark.parametrize("case", ["arange", "floor", "integers"])
def test_a_division_of_whole_numbers_by_a_constant_stays_exact(case):
    """Whole numerators keep the division, bit for bit eager's (a rotary frequency's
    ``arange(0, d, 2) / d``; what ``round(x, decimals)`` undoes)."""
    fn = {"arange": lambda x: x + torch.arange(0, 64, 2, dtype=torch.float32) / 7.0,
          "floor": lambda x: torch.floor(x * 100) / 3.0,
          "integers": lambda x: (x * 100).int() / 3.0}[case]
    x = torch.randn(32)
    c = eqfuse.compile(fn, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    assert torch.equal(c(x), fn(x))


ALLOCATIONS = {"empty_like": lambda x: torch.empty_like(x), "empty": lambda x: torch.empty(2, 3, dtype=torch.int64),
               "new_empty_strided": lambda x: x.new_empty_strided((2, 3), (1, 2)),
               "empty_permuted": lambda x: torch.empty_permuted((2, 3, 4), (2, 0, 1))}


@pytest.mark.parametrize("name", list(ALLOCATIONS))
def test_an_allocation_is_no_kernel_and_no_eager_step(name):
    """An op that allocates and leaves the memory as it is (``empty_like``: Mixtral's router
    fills one) computes nothing: no kernel, no eager step; the tensor has eager's shape,
    dtype and strides. What is written into it afterwards compiles around it."""
    x = torch.randn(3, 4)
    fn = ALLOCATIONS[name]
    c = eqfuse.compile(fn, (x,))
    assert not c.kernels and not c.fallbacks and c.empty_tensors, c.explain()
    got, want = c(x), fn(x)
    assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
    filled = eqfuse.compile(lambda x: torch.empty_like(x).copy_(x * 2) + 1, (x,))
    assert filled.kernels and not filled.fallbacks, filled.explain()
    torch.testing.assert_close(filled(x), x * 2 + 1)


def test_integer_division_by_zero_raises_as_eager_does():
    x = torch.tensor([7, -7, 6], dtype=torch.int64)
    c = eqfuse.compile(lambda x: (x + 1) % 0 + 1, (x,))
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        c(x)


def test_maximum_minimum_and_clamp_return_nan_from_either_side():
    nan = float("nan")
    x, y = torch.tensor([nan, 1.0, 2.0, nan, 5.0]), torch.tensor([1.0, nan, 3.0, nan, -5.0])

    def f(x, y):
        return torch.maximum(x, y), torch.minimum(x, y), x.clamp(0.5, 1.5), torch.maximum(y, x)
    c = eqfuse.compile(f, (x, y))
    assert c.kernels and not c.fallbacks, c.explain()
    for got, want in zip(c(x, y), f(x, y)):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def test_round_goes_half_to_even_and_keeps_the_sign_of_zero():
    """Ties to even on both sides of zero, the largest float below a half (x + 0.5 would
    round it up), zeros of x's sign, and values past 2^23 (all whole) as they are."""
    x = torch.tensor([0.49999997, 2.5, 3.5, -2.5, -0.3, -0.5, 0.5, 1.5, 8388609.0, -8388609.0, 4194304.5,
                      -4194304.5, 4194303.5, 0.7, -1.7, -0.0, 1e-40, 3e38])
    c = eqfuse.compile(torch.round, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), torch.round(x)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), (got, want)


def test_fmax_and_fmin_skip_nan_and_a_truncated_quotient_rounds_toward_zero():
    """fmax / fmin: the other operand where one is NaN, NaN where both are, the first of two
    equal zeros; div(rounding_mode="trunc") on floats: the quotient toward zero, its zero
    signed as torch signs it."""
    nan = float("nan")
    x = torch.tensor([nan, 1.0, nan, -0.0, 0.0, 7.0, -7.0, 1.0, -0.0, -1.0])
    y = torch.tensor([2.0, nan, nan, 0.0, -0.0, 2.0, 2.0, 0.0, 3.0, 3.0])

    def f(x, y):
        return torch.fmax(x, y), torch.fmin(x, y), torch.div(x, y, rounding_mode="trunc"), torch.fmax(y, x)
    c = eqfuse.compile(f, (x, y))
    assert c.kernels and not c.fallbacks, c.explain()
    for got, want in zip(c(x, y), f(x, y)):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
        assert torch.equal(torch.signbit(got[want == 0]), torch.signbit(want[want == 0])), (got, want)


@pytest.mark.parametrize("reduce", ["amax", "amin"])
@pytest.mark.parametrize("cols", [5, 3000])  # a row in registers, a row in a loop
def test_amax_and_amin_return_nan_where_a_row_holds_one(reduce, cols):
    x = torch.randn(4, cols)
    x[0, 1] = float("nan")
    x[2, -1] = float("nan")
    x[3] = float("-inf") if reduce == "amax" else float("inf")

    def f(x):
        return getattr(x, reduce)(-1), getattr(x, reduce)(0)
    c = eqfuse.compile(f, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    for got, want in zip(c(x), f(x)):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def test_small_integer_powers_are_eagers_products():
    """x ** 2, 3, -1, -2 as torch's pow kernels compute them (products and a quotient),
    bit for bit: the square of sqrt(float32's largest) is finite, as in eager."""
    root = torch.finfo(torch.float32).max ** 0.5
    x = torch.tensor([root, -root, 3.0, -0.0, 0.0, 1e-30, float("inf"), float("-inf"), float("nan"), 1.1])

    def f(x):
        return x ** 2, x ** 3, x ** -1, x ** -2
    c = eqfuse.compile(f, (x,))
    for got, want in zip(c(x), f(x)):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
        assert torch.equal(torch.signbit(got[want == 0]), torch.signbit(want[want == 0]))


def _special_rows(dtype):
    """Rows of ordinary values, each but the first holding a special value: NaN, +-inf,
    signed zeros, denormals, the dtype's largest value (whose square overflows)."""
    torch.manual_seed(0)
    x = torch.randn(8, 37)
    big = torch.finfo(dtype).max
    x[1, 3], x[2, 5], x[3, 0] = float("nan"), float("inf"), float("-inf")
    x[4] = 0.0
    x[4, ::2] = -0.0
    x[5] = torch.finfo(dtype).tiny / 4  # denormal
    x[6, :2] = big
    x[7, 4], x[7, 9] = float("inf"), float("nan")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ord", [2, 1, 3, 0.5, -1, 0, float("inf"), float("-inf")])
def test_vector_norms_are_eagers_on_special_values(dtype, ord):
    """linalg.vector_norm (torch.norm, F.normalize) as torch's reference computes it: in
    float32 for half precision, without rescaling (the largest float's square overflows
    to inf in eager too), NaN wherever a row holds one."""
    x = _special_rows(dtype)

    def f(x):
        return torch.linalg.vector_norm(x, ord, dim=-1), torch.linalg.vector_norm(x, ord, dim=0, keepdim=True)
    c = eqfuse.compile(f, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    for got, want in zip(c(x), f(x)):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-3 if dtype == torch.float16 else 1e-5,
                                   atol=0)


def test_normalize_group_norm_repeat_and_addmv_are_kernels():
    """F.normalize, group norm, repeat and addmv through torch's decompositions: kernels,
    eager's values on ordinary rows and on rows holding NaN and inf."""
    x = _special_rows(torch.float32)
    g = torch.randn(2, 6, 5, 7)
    g[1, 2, 0, 0] = float("nan")
    w, b = torch.randn(6), torch.randn(6)
    m, v = torch.randn(37, 8), torch.randn(37)

    def f(x, g, w, b, m, v):
        return (torch.nn.functional.normalize(x, dim=-1), torch.nn.functional.group_norm(g, 3, w, b),
                x.repeat(2, 1, 3), torch.addmv(v, m, x[0].nan_to_num()[:8]))
    args = (x, g, w, b, m, v)
    c = eqfuse.compile(f, args)
    assert len(c.kernels) >= 3 and not c.fallbacks, c.explain()
    for got, want in zip(c(*args), f(*args)):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=1e-5)


def test_softmax_over_rows_too_long_for_registers_reads_them_once_for_its_statistics():
    """A log-softmax over a vocabulary-sized row: its max and its sum of exponentials come
    from one pass with a running max (they took three: the max twice, then the sum), and
    the values at NaN, +inf and rows of -inf are eager's."""
    x = torch.randn(6, 20000)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3] = float("-inf")
    x[4, 3], x[4, 9] = float("inf"), float("nan")
    x[5, :100] = float("-inf")

    def f(x):
        return torch.log_softmax(x, -1), x.amax(-1)
    c = eqfuse.compile(f, (x,))
    assert len(c.kernels) == 1 and not c.fallbacks, c.explain()
    assert c.kernels[0].source.count("for c0 in range") == 2, c.kernels[0].source  # statistics, then outputs
    for got, want in zip(c(x), f(x)):
        torch.testing.assert_close(got, want, equal_nan=True)


def test_gather_of_one_element_per_long_row_reads_only_that_element():
    """A gather is a row sum of the selected element (schema/handlers/indexing.py); over rows too long
    for registers the kernel reads the element alone, with no loop over the row."""
    x = torch.randn(4, 20000)
    x[1, 3], x[2, 9], x[3, 0] = -0.0, float("nan"), float("inf")
    index = torch.tensor([[19999], [3], [9], [0]])

    def f(x, index):
        return x.gather(1, index) * 2
    c = eqfuse.compile(f, (x, index))
    assert len(c.kernels) == 1 and not c.fallbacks, c.explain()
    assert "for c0 in range" not in c.kernels[0].source, c.kernels[0].source
    got, want = c(x, index), f(x, index)
    torch.testing.assert_close(got, want + 0.0, equal_nan=True, rtol=0, atol=0)  # a selected -0.0 is +0.0 (as any sum)


def test_cross_entropy_backward_over_a_wide_vocabulary_loops_over_it_once():
    """The backward's row sum of the one-hot gradient times the loss's reads the target's
    column alone; the gradient is the one loop over the vocabulary."""
    import eqfuse.backend

    def loss(logits, target):
        return F.cross_entropy(logits.float(), target)
    logits = torch.randn(6, 20000, dtype=torch.bfloat16) * 4
    target = torch.tensor([1, 19999, -100, 0, 7, 5])
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    x = logits.clone().requires_grad_()
    torch.compile(loss, backend="eqfuse")(x, target).backward()
    y = logits.clone().requires_grad_()
    loss(y, target).backward()
    torch.testing.assert_close(x.grad, y.grad)
    backward = eqfuse.backend.history[-1]
    assert not backward.fallbacks, backward.explain()
    assert sum(k.source.count("for c0 in range") for k in backward.kernels) == 1, [k.source for k in backward.kernels]


def test_cross_entropy_over_a_wide_vocabulary_matches_eager():
    logits = torch.randn(5, 20000, dtype=torch.bfloat16) * 4
    target = torch.tensor([1, 19999, -100, 0, 7])

    def loss(logits, target):
        return F.cross_entropy(logits.float(), target)
    c = eqfuse.compile(loss, (logits, target))
    assert c.kernels and not c.fallbacks, c.explain()
    assert_matches(c(logits, target), loss(logits, target))


@pytest.mark.parametrize("e", [1.5, -1.5, 0.5, -0.5, 2.5])
def test_fractional_powers_at_infinities_zeros_and_negatives(e):
    x = torch.tensor([-float("inf"), float("inf"), 0.0, -0.0, -2.0, 4.0, float("nan"), 1e-40])
    c = eqfuse.compile(lambda x: x ** e, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x), x ** e
    numbers = ~want.isnan()
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    assert torch.equal(torch.signbit(got[numbers]), torch.signbit(want[numbers])), (got, want)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=2e-6, atol=0)


def test_fp16_compute_is_float32_inside_kernels():
    """A chain in fp16 is computed in fp32 and rounded once: at most eager's rounding error."""
    x = torch.randn(64, 64, dtype=torch.float16)
    f = lambda x: ((x * 1.1 + 0.3) * 0.9 - 0.2).exp()
    c = eqfuse.compile(f, (x,))
    exact = f(x.double())
    assert (c(x).double() - exact).abs().max() <= (f(x).double() - exact).abs().max() + 1e-3


def test_broadcast_batch_dims():
    f = lambda x, b: torch.softmax(x + b, -1)
    x, b = torch.randn(2, 3, 4, 16), torch.randn(3, 1, 16)
    c = eqfuse.compile(f, (x, b))
    assert_matches(c(x, b), f(x, b))
    assert len(c.kernels) == 1


def test_module_with_parameters():
    m = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.GELU())
    x = torch.randn(4, 16)
    c = eqfuse.compile(m, (x,))
    assert_matches(c(x), m(x))
    assert len(c.kernels) == 1, c.explain()
    with torch.no_grad():
        m[0].weight.mul_(2)  # parameters are read at call time, not baked in
    assert_matches(c(x), m(x))


SLICE_SCATTERS = [  # (base shape, dim, start, end): the middle, both edges, the whole, negative
    ((5, 12), 1, 3, 8), ((5, 12), 1, 0, 4), ((5, 12), 1, 9, 12), ((5, 12), 0, 1, 3),
    ((5, 12), 0, 0, 5), ((2, 3, 8), -1, -4, None), ((2, 3, 8), 1, 1, 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape,dim,start,end", SLICE_SCATTERS)
def test_slice_scatter(shape, dim, start, end, dtype):
    """slice_scatter (the backward of slicing) as a concatenation of base's parts and src."""
    def f(base, src):
        return torch.slice_scatter(base * 2, src + 1, dim, start, end) * 3

    torch.manual_seed(0)
    base = torch.randn(shape, dtype=dtype)
    src = torch.randn(base[(slice(None),) * (dim % len(shape)) + (slice(start, end),)].shape, dtype=dtype)
    compiled = eqfuse.compile(f, (base, src))
    assert compiled.fallbacks == [], compiled.fallbacks
    assert len(compiled.kernels) == 1, compiled.explain()
    assert_matches(compiled(base, src), f(base, src))


def test_copy_into_a_slice_is_a_kernel():
    """T5 shifting its labels right: ``out[..., 1:] = ids[..., :-1]``, which torch.compile
    hands over as ``aten.copy`` into a slice and a slice_scatter; also a float copied into
    an int tensor (truncated) and a scalar broadcast."""
    def shift_right(ids, scale):
        out = ids.new_zeros(ids.shape)
        out[..., 1:] = ids[..., :-1].clone()
        out[..., 0] = 7
        out[0] = scale * 2.5  # cast to int64 on copy
        return out.masked_fill(out == -100, 0)

    ids = torch.randint(-100, 50, (3, 9))
    ids[1, 2] = -100
    scale = torch.tensor([[1.9], [-3.7], [0.2]])[:1].expand(1, 9).contiguous()
    compiled = torch.compile(shift_right, backend="eqfuse", fullgraph=True)
    assert torch.equal(compiled(ids, scale), shift_right(ids, scale))
    captured = eqfuse.compile(shift_right, (ids, scale))
    assert captured.fallbacks == [], captured.explain()
    assert torch.equal(captured(ids, scale), shift_right(ids, scale))


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32, torch.bfloat16], ids=str)
def test_a_literal_moved_to_the_device_is_a_constant_of_the_kernel(dtype):
    """``torch.tensor(4096).to(x.device)`` (transformers' sliding-window cache keeps its
    window so, made on the CPU) is its value folded into the kernel, in the dtype it is
    moved to: a copy between devices would be an eager step, which keeps a graph from
    CUDA graphs and waits for the GPU on every call. (On the CPU the move is a cast; one
    to its own dtype would leave no copy at all.)"""
    from eqfuse.schema.plan import step_reads

    def banded(q, k):
        w = torch.tensor(3, dtype=torch.long).to(device=q.device, dtype=dtype)
        return torch.where(k[None, :] > q[:, None] - w, q[:, None] * 2.5, -1.0)

    q, k = torch.arange(7.0), torch.arange(9.0)
    eqfuse.backend.history.clear()
    compiled = torch.compile(banded, backend="eqfuse", fullgraph=True)
    assert torch.equal(compiled(q, k), banded(q, k))
    graph, = eqfuse.backend.history
    scalars = {b.name for b in graph.plan.inputs if b.shape == ()}
    assert graph.fallbacks == [], graph.explain()
    assert not any(scalars & step_reads(k) for k in graph.plan.kernels), graph.explain()


def test_a_literal_copied_into_a_tensor_is_a_constant_of_the_kernel():
    """``out[..., 0] = 7`` under torch.compile copies a 0-dim tensor literal of the code
    (on the CPU, whatever the device of ``out``: T5's start token): its value is folded
    into the kernel, which then never reads a CPU tensor."""
    from eqfuse.schema.plan import step_reads

    def start_token(ids):
        out = ids.new_zeros(ids.shape)
        out[..., 1:] = ids[..., :-1]
        out[..., 0] = 7
        return out * 2

    ids = torch.randint(-100, 50, (3, 9))
    eqfuse.backend.history.clear()
    compiled = torch.compile(start_token, backend="eqfuse", fullgraph=True)
    assert torch.equal(compiled(ids), start_token(ids))
    graph, = eqfuse.backend.history
    scalars = {b.name for b in graph.plan.inputs if b.shape == ()}
    assert scalars and graph.fallbacks == [], graph.explain()
    assert not any(scalars & step_reads(k) for k in graph.plan.kernels), graph.explain()


@pytest.mark.parametrize("pad,value", [((1, 2), 0.0), ((0, 3, 2, 0), -1.5), ((-1, 2), float("nan")),
                                       ((2, -3, -1, 1), float("-inf")), ((0, 0, 1, 1, 1, 0), 7.0)],
                         ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32], ids=str)
def test_constant_pad_is_a_kernel(pad, value, dtype):
    """``F.pad`` (an attention mask padded to a multiple of 8 in training graphs) is a
    concatenation with blocks of the value, narrowed where a pad is negative; ±inf and NaN
    as the value, and an integer tensor, as eager gives them."""
    if not dtype.is_floating_point:
        value = 0 if value != value or abs(value) == float("inf") else int(value)

    def padded(x):
        return F.pad(x * 2, pad, value=value) + 1

    x = torch.randn(3, 5, 6).to(dtype) if dtype.is_floating_point else torch.randint(-9, 9, (3, 5, 6), dtype=dtype)
    compiled = eqfuse.compile(padded, [x])
    assert compiled.fallbacks == [] and len(compiled.kernels) == 1, compiled.explain()
    assert_matches(compiled(x), padded(x))


def test_slice_scatter_of_inputs_reads_them_in_place():
    """Unmodified input parts are strided loads of the input: one kernel, exact values."""
    base, src = torch.randn(4, 10), torch.randn(4, 3)
    f = lambda base, src: torch.slice_scatter(base, src, 1, 2, 5)
    compiled = eqfuse.compile(f, (base, src))
    assert compiled.fallbacks == [] and len(compiled.kernels) == 1
    assert torch.equal(compiled(base, src), f(base, src))


def test_slice_scatter_with_a_step_runs_in_eager_with_the_reason():
    f = lambda base, src: torch.slice_scatter(base * 2, src, 1, 0, 10, 2) + 1
    base, src = torch.randn(4, 10), torch.randn(4, 5)
    compiled = eqfuse.compile(f, (base, src))
    assert [fb.reason for fb in compiled.fallbacks] == ["slice_scatter with step 2 (only step 1 is a concatenation)"]
    assert_matches(compiled(base, src), f(base, src))


# An eager op that records the strides of its argument and lays its result out
# transposed in memory (as flash attention writes [B, H, S, D] as [B, S, H, D]).
STRIDES_SEEN = []


def _transposed_layout(x):
    return torch.empty(x.shape[::-1], dtype=x.dtype, device=x.device).t()


@torch.library.custom_op("eqfuse_test::layout_sensitive", mutates_args=())
def layout_sensitive(x: torch.Tensor) -> torch.Tensor:
    STRIDES_SEEN.append(x.stride())
    return _transposed_layout(x).copy_(x * 2)


@layout_sensitive.register_fake
def _(x):
    return _transposed_layout(x)


def test_eager_step_sees_eager_layouts():
    """An eager step gets its arguments in eager's memory layout (a kernel writes them
    contiguous; cuDNN's attention backward is wrong without it), and its results keep
    eager's layout, for kernels reading them and for the graph's outputs."""
    def f(x):
        y = layout_sensitive((x + 1).t())
        return y, y * 3

    x = torch.randn(5, 12)
    STRIDES_SEEN.clear()
    ref = f(x)
    compiled = eqfuse.compile(f, (x,))
    assert [fb.node for fb in compiled.fallbacks] == ["layout_sensitive"]
    got = compiled(x)
    assert STRIDES_SEEN[-1] == STRIDES_SEEN[0] == (1, 12)
    assert got[0].stride() == ref[0].stride() == (1, 12)
    assert_matches(got, ref)


SPECIAL = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, torch.finfo(torch.float32).max]


def _with_specials(shape, dtype=torch.float32):
    x = torch.randn(shape, dtype=dtype)
    flat = x.view(-1)
    flat[: len(SPECIAL)] = torch.tensor(SPECIAL, dtype=dtype)
    return x


@pytest.mark.parametrize("dim", [1, 0, -1])
def test_gather_of_one_index_per_row_is_a_select_and_sum(dim):
    """Special values elsewhere in a row are not selected (a NaN, an inf), and the one
    selected keeps its value: the gather is one kernel, no eager step."""
    x = _with_specials((5, 7, 3)).transpose(0, 1)  # strided, not contiguous
    index_shape = [7, 5, 3]
    index_shape[dim % 3] = 1
    index = torch.randint(0, x.shape[dim], index_shape)

    def f(x, index):
        return x.gather(dim, index) * 2
    c = eqfuse.compile(f, (x, index))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(x, index), f(x, index)
    torch.testing.assert_close(got, want, equal_nan=True)


def test_scatter_of_one_index_per_row_is_a_select():
    """nll_loss's backward: zeros with one value per row (a scalar, or from a tensor),
    special values in the base kept where nothing is written."""
    base = _with_specials((6, 9))
    index = torch.tensor([[0], [8], [3], [3], [1], [0]])
    src = torch.randn(6, 1)

    def f(base, index, src):
        return base.scatter(1, index, -1.0) + base.scatter(1, index, src)
    c = eqfuse.compile(f, (base, index, src))
    assert c.kernels and not c.fallbacks, c.explain()
    torch.testing.assert_close(c(base, index, src), f(base, index, src), equal_nan=True)


@pytest.mark.parametrize("reduce", ["any", "all"])
@pytest.mark.parametrize("dims, keepdim", [(-1, False), (0, True), ((0, 2), False), (None, False)])
def test_any_and_all_are_reductions(reduce, dims, keepdim):
    """NaN, infinities, -0.0 and denormals among the values; rows of zeros, of nonzeros and
    of -0.0 (which is zero); integers and bools too. ViT's safe softmax and T5's overflow
    check ran them in eager."""
    x = _with_specials((6, 5, 4))
    x[1] = 0.0
    x[2] = -0.0
    x[3, :, 1] = 1.0
    inputs = (x, (x * 3).to(torch.int64), x > 0)

    def f(x, n, b):
        outs = []
        for v in (x, n, b):
            r = getattr(torch, reduce)(v) if dims is None else getattr(torch, reduce)(v, dims, keepdim=keepdim)
            outs.append(r)
        return outs
    c = eqfuse.compile(f, inputs)
    assert c.kernels and not c.fallbacks, c.explain()
    for got, want in zip(c(*inputs), f(*inputs)):
        assert got.dtype == torch.bool and torch.equal(got, want)


def test_any_over_no_elements_is_false_and_all_is_true():
    x = torch.randn(3, 0, 4)

    def f(x):
        return x.any(1), x.all(1), x.any(-1)
    c = eqfuse.compile(f, (x,))
    for got, want in zip(c(x), f(x)):
        assert torch.equal(got, want)


def test_gather_of_several_indices_per_row_reads_them_and_scatter_past_its_work_bound_runs_in_eager(monkeypatch):
    from eqfuse.frontend.decompose import bounds

    x, index = torch.randn(4, 9), torch.randint(0, 9, (4, 3))
    c = eqfuse.compile(lambda x, i: x.gather(1, i) + 1, (x, index))
    assert len(c.kernels) == 1 and not c.fallbacks, c.explain()
    assert_matches(c(x, index), x.gather(1, index) + 1)
    monkeypatch.setattr(bounds, "CUMSUM_WORK", 9 * 4 * 3 - 1)  # one comparison short
    c = eqfuse.compile(lambda x, i: x.scatter(1, i, 2.0) + 1, (x, index))
    assert [fb.op for fb in c.fallbacks] == ["scatter"] and "CUMSUM_WORK" in c.fallbacks[0].reason
    assert_matches(c(x, index), x.scatter(1, index, 2.0) + 1)


def test_cross_entropy_forward_and_backward_have_no_eager_step():
    """The loss of every language model: its gather and its backward's scatter fuse into
    the log-softmax kernels (they ran in eager over the whole [tokens, vocabulary] tensor,
    a copy of it included)."""
    import torch.nn.functional as F

    import eqfuse.backend

    def loss(logits, target):
        return F.cross_entropy(logits.float(), target)
    logits = torch.randn(6, 37, dtype=torch.bfloat16, requires_grad=True)
    target = torch.tensor([1, 5, -100, 36, 0, 7])
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    got = torch.compile(loss, backend="eqfuse")(logits, target)
    got.backward()
    grad, logits.grad = logits.grad, None
    want = loss(logits, target)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, logits.grad)
    graphs = list(eqfuse.backend.history)
    assert len(graphs) == 2 and all(g.kernels and not g.fallbacks for g in graphs), [g.explain() for g in graphs]


def test_an_output_that_is_another_output_reshaped_is_a_view_of_its_buffer():
    """A training forward returns the logits and saves the product they are a view of: one
    buffer, written once (it was stored twice, which kept the product from cuBLAS)."""
    x, w = torch.randn(6, 8), torch.randn(8, 5)

    def f(x, w):
        y = (x @ w).relu()
        return y.view(2, 3, 5), y, y
    c = eqfuse.compile(f, (x, w))
    got = c(x, w)
    for g, e in zip(got, f(x, w)):
        assert_matches(g, e)
    assert got[0].data_ptr() == got[1].data_ptr() == got[2].data_ptr()
    assert sum(len(k.source.split("tl.store(")) - 1 for k in c.kernels) == 1, [k.source for k in c.kernels]


def test_a_chain_of_hundreds_of_pointwise_ops_is_one_kernel():
    """Deeper than Python's default recursion limit in the code generator's walk (it ran
    the graph in eager with a RecursionError); the limit is the user's again afterwards."""
    import sys

    def f(x):
        for i in range(520):
            x = x * 1.001 + 0.001 if i % 2 else torch.sin(x)
        return x
    limit = sys.getrecursionlimit()
    x = torch.randn(64)
    c = eqfuse.compile(f, (x,))
    assert len(c.kernels) == 1 and not c.fallbacks, c.explain()
    assert_matches(c(x), f(x))
    assert sys.getrecursionlimit() == limit


COPIES = {
    "clone": lambda x: x.clone(),
    "alias_copy": lambda x: torch.alias_copy(x),
    "t_copy": lambda x: torch.t_copy(x[0]),
    "squeeze_copy": lambda x: torch.squeeze_copy(x[:1]),
    "unsqueeze_copy": lambda x: torch.unsqueeze_copy(x, 0),
    "rot90_0": lambda x: torch.rot90(x, 0),
    "transpose_contiguous": lambda x: x.transpose(1, 2).contiguous(),
    "expand_copy": lambda x: torch.expand_copy(x[:, :1], (4, 3, 10)),
    "split_with_sizes_copy": lambda x: torch.split_with_sizes_copy(x, [2, 3], 1),
    # a copy of an eager step's view of the input (unfold runs in eager)
    "unfold_copy": lambda x: torch.unfold_copy(x, 2, 2, 2),
    # a copy handed to an eager step that returns a view of it (resize_ runs in eager)
    "clone_resize": lambda x: x.clone().resize_(20, 10),
    # copies of views, each a copying kernel (frontend/decompose/)
    "permute_copy": lambda x: torch.permute_copy(x, (2, 0, 1)),
    "view_copy": lambda x: torch.view_copy(x, (20, 10)),
    "narrow_copy": lambda x: x.narrow_copy(1, 1, 2),
    "unbind_copy": lambda x: torch.unbind_copy(x, 1),
    "as_strided_copy": lambda x: torch.as_strided_copy(x, (2, 2), (10, 1), 3),
}
VIEW_COPIES = ["permute_copy", "view_copy", "narrow_copy", "unbind_copy", "as_strided_copy"]


@pytest.mark.parametrize("name", VIEW_COPIES)
def test_a_copy_of_a_view_is_a_kernel(name):
    x = torch.randn(4, 5, 10)
    compiled = eqfuse.compile(COPIES[name], (x,))
    assert compiled.kernels and not compiled.fallbacks, compiled.explain()


@pytest.mark.parametrize("name", list(COPIES))
def test_a_copy_of_an_input_is_a_tensor_of_its_own(name):
    """Eager returns a new tensor: so does the compiled graph, with eager's strides, and a
    write to it leaves the input as it was."""
    fn = COPIES[name]
    x = torch.randn(4, 5, 10)
    before = x.clone()
    compiled = eqfuse.compile(fn, (x,))
    got, want = compiled(x), fn(x)
    got, want = (list(got), list(want)) if isinstance(want, (list, tuple)) else ([got], [want])
    for g, w in zip(got, want):
        assert torch.equal(g, w) and g.stride() == w.stride()
        assert g.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        g.add_(1.0)
    assert torch.equal(x, before)
    assert len({g.untyped_storage().data_ptr() for g in got}) == len(got)


@pytest.mark.parametrize("view", [lambda x: x.view(20, 10), lambda x: x[1], lambda x: x.transpose(0, 1)])
def test_a_view_of_an_input_stays_a_view(view):
    x = torch.randn(4, 5, 10)
    got = eqfuse.compile(view, (x,))(x)
    assert torch.equal(got, view(x)) and got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
@pytest.mark.parametrize("reduce", ["amax", "amin"])
def test_integer_max_and_min_start_from_the_dtypes_extremes(dtype, reduce):
    """A row of the dtype's extreme values: the reduction starts from them (not from an
    infinity, which no integer holds), in registers and in a loop."""
    info = torch.iinfo(dtype)
    for cols in (7, 3000):
        x = torch.randint(-50, 50, (3, cols), dtype=dtype)
        x[0] = info.min
        x[1] = info.max
        fn = (lambda x: x.amax(-1) * 1) if reduce == "amax" else (lambda x: x.amin(-1) * 1)
        compiled = eqfuse.compile(fn, (x,))
        assert compiled.fallbacks == [] and compiled.kernels, compiled.explain()
        assert torch.equal(compiled(x), fn(x))


STRIDED_OUTPUTS = {
    "baddbmm_transposed_bias": (lambda b, x, y: torch.baddbmm(b.transpose(1, 2), x, y),
                                lambda: (torch.randn(2, 5, 3), torch.randn(2, 3, 4), torch.randn(2, 4, 5))),
    "permuted_sum": (lambda x: (x.permute(2, 0, 1) * 2).contiguous() + 1, lambda: (torch.randn(3, 4, 5),)),
    "transposed_result": (lambda x: (x * 2).t(), lambda: (torch.randn(6, 7),)),
}


@pytest.mark.parametrize("name", list(STRIDED_OUTPUTS))
def test_outputs_keep_eagers_strides(name):
    """An output laid out as eager lays it out, not as the traced decomposition did."""
    fn, make = STRIDED_OUTPUTS[name]
    args = make()
    got, want = eqfuse.compile(fn, args)(*args), fn(*args)
    assert torch.allclose(got, want, atol=1e-5) and got.stride() == want.stride()


COMPLEX_STEPS = {
    "eig_vectors": (lambda a: torch.view_as_real(torch.linalg.eig(a)[1]), lambda: (torch.randn(4, 4),)),
    "transposed_to_complex": (lambda a: torch.view_as_real(a.t().to(torch.complex64)), lambda: (torch.randn(3, 2),)),
    "fft_along_a_middle_dim": (lambda x: torch.fft.fft(x * 2, n=10, dim=1), lambda: (torch.randn(5, 6, 7),)),
}


@pytest.mark.parametrize("name", list(COMPLEX_STEPS))
def test_complex_results_of_eager_steps_keep_eagers_layout(name):
    """A complex value (no kernel reads one) passes from eager step to eager step, and out,
    as eager made it: not a view of it in memory order (eigenvectors came back transposed)."""
    fn, make = COMPLEX_STEPS[name]
    args = make()
    got, want = eqfuse.compile(fn, args)(*args), fn(*args)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)


def test_signbit_and_copysign_read_the_sign_bit():
    """signbit and copysign by the sign bit itself: set for -0.0, -inf and a NaN that
    carries it, as in eager, also for a NaN made negative; in float32 (other widths run in
    eager, with the reason: a GPU's conversions may hand back a NaN unsigned)."""
    nan = float("nan")
    b = torch.tensor([1.0, -2.0, 0.0, -0.0, float("inf"), -float("inf"), nan, -nan, 1e-40, -1e-40, 3e38, -3e38])
    a = torch.tensor([-3.0, 4.0, -0.0, 5.0, -1.0, 2.0, -7.0, 6.0, nan, -0.0, float("inf"), -nan])

    def f(a, b):
        return torch.signbit(b), torch.copysign(a, b), torch.copysign(a, -1.0), torch.copysign(a, 0.0)
    c = eqfuse.compile(f, (a, b))
    assert c.kernels and not c.fallbacks, c.explain()
    for got, want in zip(c(a, b), f(a, b)):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
        if want.is_floating_point():
            assert torch.equal(torch.signbit(got), torch.signbit(want)), (got, want)
    half = eqfuse.compile(f, (a.half(), b.half()))
    assert "float32's bits" in half.explain()
    for got, want in zip(half(a.half(), b.half()), f(a.half(), b.half())):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def test_a_diagonal_of_an_input_is_a_view_of_it():
    """torch.diagonal of an input folds into its strides: a kernel reads it so (or the
    output is the input's view, with eager's strides); of a computed value it runs in eager
    with the reason."""
    x = torch.randn(5, 6, 7)
    x[0, 0, 0], x[1, 1, 1] = float("nan"), float("-inf")

    def scaled(x):
        return torch.diagonal(x, 0, 1, 2) * 2
    c = eqfuse.compile(scaled, (x,))
    assert len(c.kernels) == 1 and not c.fallbacks, c.explain()
    torch.testing.assert_close(c(x), scaled(x), equal_nan=True, rtol=0, atol=0)
    view = eqfuse.compile(lambda x: torch.diagonal(x, -1, 0, 2), (x,))
    assert not view.kernels and not view.fallbacks
    got = view(x)
    assert got.data_ptr() == torch.diagonal(x, -1, 0, 2).data_ptr() and got.stride() == (7, 43)
    computed = eqfuse.compile(lambda x: torch.diagonal(x * 3, 1, 1, 2), (x,))
    assert "diagonal of a computed value" in computed.explain()
    torch.testing.assert_close(computed(x), torch.diagonal(x * 3, 1, 1, 2), equal_nan=True, rtol=0, atol=0)


def _table(dtype, rows=9, cols=6):
    """A table whose rows hold special values (NaN, +-inf, -0.0, a denormal, the largest)."""
    if not dtype.is_floating_point:
        return torch.arange(rows * cols, dtype=dtype).reshape(rows, cols) - 20
    return _special_rows(dtype)[:, :cols].repeat(2, 1)[:rows].contiguous()


INDEXED_READS = {
    "embedding": (lambda w, i: F.embedding(i, w), lambda: torch.tensor([[1, 3, 8], [0, 0, 2]])),
    "index_select": (lambda w, i: w.t().index_select(1, i), lambda: torch.tensor([8, 0, 4, 4])),
    "index_select_scalar": (lambda w, i: w[2, 3].index_select(0, i), lambda: torch.tensor([0])),
    "index_negative": (lambda w, i: w[i], lambda: torch.tensor([-1, 2, 5, -9])),
    "index_middle_dim": (lambda w, i: w.reshape(3, 3, 6)[:, i], lambda: torch.tensor([[1, 2], [-3, 0]])),
    "index_two_tensors": (lambda w, i: w[i, (i * 7) % 6 - 2], lambda: torch.tensor([[1, -2, 8], [0, 3, -9]])),
    "index_two_broadcast": (lambda w, i: w.reshape(3, 3, 6)[:, i[:, None], i[:2]], lambda: torch.tensor([2, 0, -1])),
    "gather_rows": (lambda w, i: torch.gather(w, 1, i), lambda: torch.randint(0, 6, (9, 4))),
    "gather_narrower": (lambda w, i: torch.gather(w, 0, i), lambda: torch.randint(0, 9, (3, 2))),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
@pytest.mark.parametrize("name", list(INDEXED_READS))
def test_indexed_reads_are_kernels_that_copy_values_exactly(name, dtype):
    """embedding, index_select, x[index], gather: one kernel, no eager step; every value
    read as stored, NaN, infinities, -0.0 and denormals included."""
    fn, index = INDEXED_READS[name]
    torch.manual_seed(0)
    w, i = _table(dtype), index()

    def f(w, i):
        return fn(w, i) * 1
    c = eqfuse.compile(f, (w, i))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(w, i), f(w, i)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    if dtype.is_floating_point:
        assert torch.equal(torch.signbit(got[want == 0]), torch.signbit(want[want == 0]))


def test_an_embedding_fuses_with_what_follows_and_counts_only_the_rows_it_reads():
    """The embedding is read inside the kernel that uses it; the cost model counts the rows
    read, not a vocabulary-wide table."""
    from eqfuse.rewrite.cost import kernel_bytes
    table, ids, scale = torch.randn(50_000, 64), torch.tensor([[7, 49_999, 0, 7]]), torch.randn(64)

    def f(table, ids, scale):
        x = F.embedding(ids, table)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    c = eqfuse.compile(f, (table, ids, scale))
    assert len(c.kernels) == 1 and not c.fallbacks, c.explain()
    torch.testing.assert_close(c(table, ids, scale), f(table, ids, scale))
    (spec,) = c.plan.kernels
    assert kernel_bytes(spec, c.plan.buffers) < 4 * 64 * 4 * 4


def test_an_index_outside_the_table_reads_nan_where_eager_raises():
    """A kernel cannot raise: an index past the table (eager: IndexError, or a device
    assert on a GPU) reads NaN in its place, never another row or memory outside."""
    table = torch.randn(5, 3)

    def f(table, ids):
        return F.embedding(ids, table) + 1
    c = eqfuse.compile(f, (table, torch.tensor([0, 4, 1, 2])))
    ids = torch.tensor([4, 5, -1, 2])
    with pytest.raises(IndexError):
        f(table, ids)
    got = c(table, ids)
    assert torch.isnan(got[1:3]).all()
    torch.testing.assert_close(got[[0, 3]], table[[4, 2]] + 1)
    # two indices: one past its dim reads NaN, not the element its merged index lands on
    c = eqfuse.compile(lambda table, i, j: table[i, j] + 1, (table, torch.tensor([0, 1]), torch.tensor([0, 1])))
    got = c(table, torch.tensor([0, 1]), torch.tensor([3, 1]))
    assert torch.isnan(got[0]) and got[1] == table[1, 1] + 1


WRITES_AT_ONE_POSITION = {
    "index_copy": (lambda c, p, v: c.index_copy(2, p, v), lambda c: c[:, :, :1] * 3),
    "index_add": (lambda c, p, v: c.index_add(2, p, v), lambda c: c[:, :, :1] * 3),
    "index_put_from_the_end": (lambda c, p, v: c.index_put((p - c.shape[0],), v), lambda c: c[0] * 3),
    "index_put_accumulate": (lambda c, p, v: c.index_put((p,), v, accumulate=True), lambda c: c[0] * 3),
    "index_fill": (lambda c, p, v: c.index_fill(1, p, -0.0) + v.sum(), lambda c: c[:1, :1, :1, :1]),
}


@pytest.mark.parametrize("name", list(WRITES_AT_ONE_POSITION))
def test_a_write_at_one_position_is_a_kernel(name):
    """A static cache's update at a decode step (index_copy at the step's position, as
    index_put): the values there, the cache elsewhere, NaN, infinities and signed zeros
    kept as they were; at more positions, an eager step with its reason."""
    fn, values = WRITES_AT_ONE_POSITION[name]
    cache = _special_rows(torch.float32)[:, :36].reshape(2, 4, 6, 6)
    position, v = torch.tensor([1]), values(cache).contiguous()

    def f(c, p, v):
        return fn(c, p, v) * 1
    c = eqfuse.compile(f, (cache, position, v))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(cache, position, v), f(cache, position, v)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(torch.signbit(got[want == 0]), torch.signbit(want[want == 0]))


WRITES_AT_SEVERAL_POSITIONS = {  # (function, its positions, the values' shape): a position twice where allowed
    "index_copy": (lambda c, p, v: c.index_copy(2, p, v), [1, 4], lambda c: c[:, :, :2] * 3),
    "index_add": (lambda c, p, v: c.index_add(2, p, v), [1, 4, 1], lambda c: c[:, :, :3] * 3),
    "index_put_from_the_end": (lambda c, p, v: c.index_put((p - c.shape[0],), v), [1, 0], lambda c: c[:2] * 3),
    "index_put_accumulate": (lambda c, p, v: c.index_put((p,), v, accumulate=True), [1, 0, 1],
                             lambda c: c[torch.tensor([0, 1, 1])] * 3),
    "index_fill": (lambda c, p, v: c.index_fill(1, p, -0.0) + v.sum(), [1, 3, 1], lambda c: c[:1, :1, :1, :1]),
    "cache prompt": (lambda c, p, v: torch.ops.aten.index_put(c, [None, None, p], v), [1, 4],
                     lambda c: c[:, :, :2] * 3),
}


@pytest.mark.parametrize("name", list(WRITES_AT_SEVERAL_POSITIONS))
def test_writes_at_several_positions_are_kernels(name):
    """A static cache's prompt written at its positions (frontend/decompose/): for each
    position the last index naming it, then the values read there, or each position's sum
    of the values naming it where accumulating; kernels, no eager step; special values and
    signed zeros as eager's (a sum's aside)."""
    fn, positions, values = WRITES_AT_SEVERAL_POSITIONS[name]
    cache = _special_rows(torch.float32)[:, :36].reshape(2, 4, 6, 6)
    positions, v = torch.tensor(positions), values(cache).contiguous()

    def f(c, p, v):
        return fn(c, p, v) * 1
    c = eqfuse.compile(f, (cache, positions, v))
    assert c.kernels and not c.fallbacks, c.explain()
    got, want = c(cache, positions, v), f(cache, positions, v)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-6, atol=1e-6)
    if "add" not in name and "accumulate" not in name:
        assert torch.equal(torch.signbit(got[want == 0]), torch.signbit(want[want == 0]))


def test_a_write_outside_the_tensor_gives_nan_where_eager_raises():
    cache, v = torch.randn(3, 5, 2), torch.randn(3, 1, 2)

    def f(c, p, v):
        return c.index_copy(1, p, v) + 1
    c = eqfuse.compile(f, (cache, torch.tensor([2]), v))
    with pytest.raises(IndexError):
        f(cache, torch.tensor([5]), v)
    assert torch.isnan(c(cache, torch.tensor([5]), v)).all()
    several = eqfuse.compile(f, (cache, torch.tensor([2, 0]), v.expand(3, 2, 2).contiguous()))
    assert torch.isnan(several(cache, torch.tensor([2, 5]), v.expand(3, 2, 2).contiguous())).all()
