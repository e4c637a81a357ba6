"""The kernel-level operators: one table that says what each means in PyTorch (the
reference used by the soundness tests) and how it is written in Triton.

Triton templates take operand expressions already converted to the compute dtype
(float32 for every floating type narrower than float64).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OpDef:
    name: str
    torch_fn: Callable
    triton: str  # a format string over {a}, {b} (and the names ``lets`` binds)
    cost: float = 1.0  # relative compute cost per element, for the cost model
    # steps bound to names before ``triton``, in order: (name, format string over {a} and
    # the names bound before it); the code generator assigns each to a variable of its own
    lets: tuple = ()


def _stepped(name: str, torch_fn: Callable, form: tuple, cost: float) -> OpDef:
    """An OpDef from ``form``: (its steps, its value's template)."""
    lets, triton = form
    return OpDef(name, torch_fn, triton, cost, lets)


def _log1p(v: str) -> str:
    """log1p of ``v`` over a step ``u`` = v + 1 bound before it: log(u) * (v / (u - 1))
    corrects the rounding of 1 + v (Goldberg's trick); the ratio first, so that log(u) * v
    cannot overflow (v = 3e38), and u = inf is inf (the ratio would be inf / inf)."""
    return f"tl.where({{u}} == 1.0, {v}, tl.where({{u}} == float('inf'), {{u}}, tl.log({{u}}) * ({v} / ({{u}} - 1.0))))"


def _expm1_near_0(x: str) -> str:
    """expm1 of ``x``, for |x| <= 1, over a step ``u`` = exp(x) bound before it: (u - 1) *
    (x / log(u)) (Kahan's), the error of u cancelling between u - 1, exact there, and
    log(u); u = 1 is x itself (-0.0 keeps its sign). exp(x) - 1 lost up to 1e-3 of the
    value between 1e-5 and 1e-2 (2e-5: 1.3e-3)."""
    return f"tl.where({{u}} == 1.0, {x}, ({{u}} - 1.0) * ({x} / tl.log({{u}})))"


def _horner(var: str, coefficients: tuple) -> str:
    """c0 + v (c1 + v (c2 + ...)) over the name ``var``, in Triton."""
    text = repr(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        text = f"{c!r} + {{{var}}} * ({text})"
    return text


LOG1P = (("u", "{a} + 1.0"),), _log1p("{a}")
# past |x| = 1, u - 1 loses nothing (and from -17 on, exp(x)'s denormals would spoil log(u))
EXPM1 = (("u", "tl.exp({a})"),), f"tl.where(tl.abs({{a}}) > 1.0, {{u}} - 1.0, {_expm1_near_0('{a}')})"
LN2 = "0.6931471805599453"
# an odd function from its value {m} at |x| (sign bit clear): x's sign bit set on it, -0.0
# and NaN's sign included; one logical instruction where two selects and two comparisons
# were (the code generator names {int}, {float} and {sign}, the compute width's integer,
# float and sign bit)
ODD = ("(({m}).to({int}, bitcast=True) | (tl.cast({a}, {float}).to({int}, bitcast=True) & {sign}))"
       ".to({float}, bitcast=True)")
# e^m / 2 for m = |x| past 88, where e^m overflows while e^m / 2 does not until 89.4: the
# square of e^(m/2), halved first (exp(m - ln 2) lost the rounding of m - ln 2: 1.4e-6)
HALF_EXP_PAST_88 = "(0.5 * tl.exp(0.5 * {m})) * tl.exp(0.5 * {m})"
# sinh |x| = (E + E / (E + 1)) / 2 with E = expm1(|x|), exact near 0
SINH = (("m", "tl.abs({a})"), ("u", "tl.exp({m})"),
        ("e", f"tl.where({{m}} > 1.0, {{u}} - 1.0, {_expm1_near_0('{m}')})"),
        ("m", "tl.where({m} < 88.0, 0.5 * ({e} + {e} / ({e} + 1.0)), " + HALF_EXP_PAST_88 + ")")), ODD
COSH = (("m", "tl.abs({a})"), ("u", "tl.exp({m})")), \
    "tl.where({m} < 88.0, 0.5 * ({u} + 1.0 / {u}), " + HALF_EXP_PAST_88 + ")"
# asinh |x| = log1p(|x| + x^2 / (1 + sqrt(1 + x^2))), exact near 0; past 2^26, where x^2
# would lose 1 (and overflow from 1.8e19), log |x| + ln 2
ASINH = (("m", "tl.abs({a})"), ("v", "{m} + {m} * {m} / (1.0 + tl.sqrt(1.0 + {m} * {m}))"), ("u", "{v} + 1.0"),
         ("m", f"tl.where({{m}} > 67108864.0, tl.log({{m}}) + {LN2}, {_log1p('{v}')})")), ODD
# acosh x = log1p(t + sqrt(2t + t^2)) with t = x - 1 (exact near 1); NaN below 1
ACOSH = (("t", "{a} - 1.0"), ("v", "{t} + tl.sqrt(2.0 * {t} + {t} * {t})"), ("u", "{v} + 1.0")), \
    f"tl.where({{a}} < 1.0, float('nan'), tl.where({{a}} > 67108864.0, tl.log({{a}}) + {LN2}, {_log1p('{v}')}))"
# atanh |x| = log1p(2|x| / (1 - |x|)) / 2, 1 - |x| exact near 1 (at x near -1, 1 + 2x / (1
# - x) lost the digits: 2.5e-2); +-inf at +-1, NaN past them
ATANH = (("m", "tl.abs({a})"), ("v", "2.0 * {m} / (1.0 - {m})"), ("u", "{v} + 1.0"),
         ("m", f"0.5 * {_log1p('{v}')}")), ODD
# tanh |x| as Cephes' tanhf: 1 - 2 / (e^2|x| + 1) past 0.625 (1 from where e^2|x|
# overflows; e^2|x| as exp2(|x| 2 log2 e), the product exp's would round, one instruction
# fewer), an odd polynomial below (relative error under 2e-7). One exp and one division
# an element: the form before it (E / (E + 2) with E = expm1(2|x|) by Kahan's, an exp, a
# log and two divisions) made Gemma-2's logit soft-capping, [4096 x 256000] bf16, a
# compute-bound 2666 us on an H200 (Inductor's 1000). 2 sigmoid(2x) - 1 lost up to 4e-4
# of the value just above 2.4e-4.
_TANHF = (-3.33332819422e-1, 1.33314422036e-1, -5.37397155531e-2, 2.06390887954e-2, -5.70498872745e-3)
TANH = (("m", "tl.abs({a})"), ("s", "{m} * {m}"),
        ("p", f"({_horner('s', _TANHF)}) * {{s}} * {{m}} + {{m}}"),
        ("m", "tl.where({m} > 0.625, 1.0 - 2.0 / (tl.exp2({m} * 2.885390081777927) + 1.0), {p})")), ODD
# atan |x| by Cephes' atanf: reduced to |z| <= tan(pi/8) around 0, pi/4 or pi/2, then an
# odd polynomial (relative error under 2e-7)
_ATAN = (("m", "tl.abs({x})"),
         ("z", "tl.where({m} > 2.414213562373095, -1.0 / {m}, tl.where({m} > 0.41421356237309503, "
               "({m} - 1.0) / ({m} + 1.0), {m}))"),
         ("y", "tl.where({m} > 2.414213562373095, 1.5707963267948966, tl.where({m} > 0.41421356237309503, "
               "0.7853981633974483, 0.0))"),
         ("s", "{z} * {z}"),
         ("m", "{y} + ((((0.0805374449538 * {s} - 0.138776856032) * {s} + 0.199777106478) * {s} "
               "- 0.333329491539) * {s} * {z} + {z})"))
_ATAN_OF_X = ODD.replace("{a}", "{x}")


def _atan_of(x: str) -> tuple:
    """The steps of atan of ``x`` (a template over {a}) and its value's template."""
    return (("x", x), *_ATAN), _ATAN_OF_X


ATAN = _atan_of("{a}")
# asin x = atan(x / sqrt((1 - x)(1 + x))): +-pi/2 at +-1, NaN past them
ASIN = _atan_of("{a} / tl.sqrt((1.0 - {a}) * (1.0 + {a}))")
# acos x = 2 atan(sqrt((1 - x) / (1 + x))): exact near 1, pi at -1, NaN past +-1
ACOS = _atan_of("tl.sqrt((1.0 - {a}) / (1.0 + {a}))")[0], "2.0 * " + _ATAN_OF_X
# tan x = sin x / cos x: -0.0 keeps its sign, NaN at the infinities
TAN = (), "(tl.sin({a}) / tl.cos({a}))"


# erfc by fdlibm's erfcf (its coefficients: s_erff.c, Sun Microsystems 1993), every branch
# computed and the one |x| falls in selected: below 0.84375, 1 - erf(x) from erf's rational
# form (written so that 1 - erf loses no digits past 1/4); to 1.25, (1 - erx) - P/Q around
# 1; to 28, exp(-x^2) R/S in 1/x^2 over x, with x^2 split into the square of x's leading
# 11 bits and the rest (exp(-z^2 - 0.5625) exp((z - x)(z + x) + R/S), both arguments exact:
# with 12 bits, as s_erff.c, z^2 + 0.5625 rounds past 64, 4e-6 of the value at x = 8; x^2
# rounded once would cost x^2 ulps); 0 or 2 beyond; 2 - erfc(|x|) for negative x.
_ERFX = 0.84506291151
_ERF_PP, _ERF_QQ = (1.2837916613e-01, -3.2504209876e-01, -2.8481749818e-02, -5.7702702470e-03,
                    -2.3763017452e-05), (1.0, 3.9791721106e-01, 6.5022252500e-02, 5.0813062117e-03,
                                         1.3249473704e-04, -3.9602282413e-06)
_ERF_PA, _ERF_QA = (-2.3621185683e-03, 4.1485610604e-01, -3.7220788002e-01, 3.1834661961e-01, -1.1089469492e-01,
                    3.5478305072e-02, -2.1663755178e-03), (1.0, 1.0642088205e-01, 5.4039794207e-01,
                                                           7.1828655899e-02, 1.2617121637e-01, 1.3637083583e-02,
                                                           1.1984500103e-02)
_ERFC_RA, _ERFC_SA = (-9.8649440333e-03, -6.9385856390e-01, -1.0558626175e+01, -6.2375331879e+01, -1.6239666748e+02,
                      -1.8460508728e+02, -8.1287437439e+01, -9.8143291473e+00), \
    (1.0, 1.9651271820e+01, 1.3765776062e+02, 4.3456588745e+02, 6.4538726807e+02, 4.2900814819e+02,
     1.0863500214e+02, 6.5702495575e+00, -6.0424413532e-02)
_ERFC_RB, _ERFC_SB = (-9.8649431020e-03, -7.9928326607e-01, -1.7757955551e+01, -1.6063638306e+02, -6.3756646729e+02,
                      -1.0250950928e+03, -4.8351919556e+02), \
    (1.0, 3.0338060379e+01, 3.2579251099e+02, 1.5367296143e+03, 3.1998581543e+03, 2.5530502930e+03,
     4.7452853394e+02, -2.2440952301e+01)
ERFC = (("x", "tl.cast({a}, tl.float32)"), ("m", "tl.abs({x})"),
        ("z", "{x} * {x}"),
        ("y", f"({_horner('z', _ERF_PP)}) / ({_horner('z', _ERF_QQ)})"),
        ("n", "tl.where({x} < 0.25, 1.0 - ({x} + {x} * {y}), 0.5 - ({x} * {y} + ({x} - 0.5)))"),
        ("t", "{m} - 1.0"),
        ("q", f"({_horner('t', _ERF_PA)}) / ({_horner('t', _ERF_QA)})"),
        ("c", f"tl.where({{x}} >= 0.0, {1.0 - _ERFX!r} - {{q}}, 1.0 + ({_ERFX!r} + {{q}}))"),
        ("s", "1.0 / ({m} * {m})"),
        ("r", f"tl.where({{m}} < 2.857142857, ({_horner('s', _ERFC_RA)}) / ({_horner('s', _ERFC_SA)}), "
              f"({_horner('s', _ERFC_RB)}) / ({_horner('s', _ERFC_SB)}))"),
        ("h", "({m}.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)"),
        ("e", "tl.exp(-{h} * {h} - 0.5625) * tl.exp(({h} - {m}) * ({h} + {m}) + {r}) / {m}"),
        ("e", "tl.where({x} > 0.0, {e}, 2.0 - {e})"),
        ("e", "tl.where({m} >= 28.0, tl.where({x} > 0.0, 0.0, 2.0), {e})")), \
    "tl.where({x} != {x}, {x}, tl.where({m} < 0.84375, {n}, tl.where({m} < 1.25, {c}, {e})))"

# erfinv by Giles' single-precision form ("Approximating the erfinv function", GPU
# Computing Gems, 2011): a polynomial in w = -log(1 - x^2), about w = 2.5 below 5 and in
# sqrt(w) - 3 above, times x (1.2e-7 of the value in float64); +-inf at +-1, NaN past them
_GILES_CENTRAL = (1.50140941, 0.246640727, -0.00417768164, -0.00125372503, 0.00021858087, -4.39150654e-06,
                  -3.5233877e-06, 3.43273939e-07, 2.81022636e-08)
_GILES_TAIL = (2.83297682, 1.00167406, 0.00943887047, -0.0076224613, 0.00573950773, -0.00367342844,
               0.00134934322, 0.000100950558, -0.000200214257)
ERFINV = (("x", "tl.cast({a}, tl.float32)"), ("w", "-tl.log((1.0 - {x}) * (1.0 + {x}))"),
          ("c", "{w} - 2.5"), ("t", "tl.sqrt({w}) - 3.0"),
          ("p", f"tl.where({{w}} < 5.0, {_horner('c', _GILES_CENTRAL)}, {_horner('t', _GILES_TAIL)}) * {{x}}")), \
    "tl.where(tl.abs({x}) == 1.0, {x} * float('inf'), {p})"


UNARY: dict[str, OpDef] = {op.name: op for op in [
    OpDef("neg", torch.neg, "({a} * -1)", 0.5),  # Triton's -x is 0 - x: -(+0.0) would be +0.0
    OpDef("exp", torch.exp, "tl.exp({a})", 2),
    OpDef("log", torch.log, "tl.log({a})", 2),
    OpDef("sqrt", torch.sqrt, "tl.sqrt({a})", 2),
    OpDef("rsqrt", torch.rsqrt, "tl.rsqrt({a})", 2),
    _stepped("tanh", torch.tanh, TANH, 3),
    OpDef("sigmoid", torch.sigmoid, "tl.sigmoid({a})", 3),
    OpDef("relu", torch.relu, "tl.where({a} < 0, 0, {a})", 0.5),  # as torch: NaN and -0.0 pass
    OpDef("abs", torch.abs, "tl.abs({a})", 0.5),
    OpDef("erf", torch.erf, "tl.erf({a})", 3),
    _stepped("erfc", torch.erfc, ERFC, 8),
    _stepped("erfinv", torch.erfinv, ERFINV, 6),
    OpDef("sin", torch.sin, "tl.sin({a})", 3),
    OpDef("cos", torch.cos, "tl.cos({a})", 3),
    OpDef("floor", torch.floor, "tl.floor({a})", 0.5),
    OpDef("ceil", torch.ceil, "tl.ceil({a})", 0.5),
    OpDef("reciprocal", torch.reciprocal, "(1.0 / {a})", 1),
    _stepped("log1p", torch.log1p, LOG1P, 3),
    _stepped("expm1", torch.expm1, EXPM1, 3),
    OpDef("log2", torch.log2, "tl.log2({a})", 2),
    _stepped("sinh", torch.sinh, SINH, 4),
    _stepped("cosh", torch.cosh, COSH, 3),
    _stepped("tan", torch.tan, TAN, 4),
    _stepped("asinh", torch.asinh, ASINH, 4),
    _stepped("acosh", torch.acosh, ACOSH, 4),
    _stepped("atanh", torch.atanh, ATANH, 4),
    _stepped("atan", torch.atan, ATAN, 4),
    _stepped("asin", torch.asin, ASIN, 5),
    _stepped("acos", torch.acos, ACOS, 5),
    OpDef("exp2", torch.exp2, "tl.exp2({a})", 2),
    # log2(x) * log10(2): within an ulp or two of log10 (exact at 0, inf and NaN)
    OpDef("log10", torch.log10, "(tl.log2({a}) * 0.30102999566398120)", 2),
    # toward zero: ceil below 0 keeps -0.0 (trunc(-0.3) is -0.0), floor keeps NaN
    OpDef("trunc", torch.trunc, "tl.where({a} < 0, tl.ceil({a}), tl.floor({a}))", 0.5),
    # half to even, as torch: x's fraction above its floor decides (x + 0.5 would round
    # 0.49999997 up); from -0.5 to 0.5 a zero of x's sign (round(-0.3) is -0.0); from 2^23
    # on every float32 is whole (float64 is not: translated for narrower floats only)
    OpDef("round", torch.round,
          "tl.where(tl.abs({a}) >= 8388608.0, {a}, tl.where(tl.abs({a}) <= 0.5, {a} * 0.0, "
          "tl.floor({a}) + tl.where({a} - tl.floor({a}) > 0.5, 1.0, "
          "tl.where({a} - tl.floor({a}) == 0.5, tl.where(tl.floor({a}) % 2 != 0, 1.0, 0.0), 0.0))))", 2),
    # as torch: 0 for NaN and for either zero
    OpDef("sign", torch.sign, "tl.where({a} > 0, 1.0, tl.where({a} < 0, -1.0, 0.0))", 0.5),
    OpDef("not", torch.logical_not, "({a} == 0)", 0.5),
    OpDef("isnan", torch.isnan, "({a} != {a})", 0.5),
    OpDef("isinf", torch.isinf, "(tl.abs({a}) == float(\"inf\"))", 0.5),
    # the sign bit itself, set for -0.0 and for a NaN that carries it (float32 only: a GPU's
    # conversions between float widths, and its arithmetic, may hand back a NaN unsigned)
    OpDef("signbit", torch.signbit, "(tl.cast({a}, tl.float32).to(tl.int32, bitcast=True) < 0)", 0.5),
]}

PI = "3.141592653589793"
# hypot: max(|a|, |b|) sqrt(1 + (min / max)^2), which overflows only where the result does;
# inf where either is infinite (a NaN beside it too), else NaN where either is NaN
HYPOT = (("x", "tl.abs({a})"), ("y", "tl.abs({b})"), ("m", "tl.where({x} > {y}, {x}, {y})"),
         ("n", "tl.where({x} > {y}, {y}, {x})")), \
    ("tl.where({x} == float('inf'), {x}, tl.where({y} == float('inf'), {y}, tl.where({a} != {a}, {a}, "
     "tl.where({b} != {b}, {b}, tl.where({m} == 0.0, 0.0, {m} * tl.sqrt(1.0 + ({n} / {m}) * ({n} / {m})))))))")
# atan2(a, b): atan(|a| / |b|) in [0, pi/2] (pi/4 where both are infinite, 0 where both are
# zeros), pi minus it where b is negative or -0.0, negated where a is negative or -0.0
ATAN2 = (("x", "tl.abs({a}) / tl.abs({b})"), *_ATAN,
         ("m", "tl.where(tl.abs({a}) == float('inf'), tl.where(tl.abs({b}) == float('inf'), 0.7853981633974483, {m}), "
               "tl.where({a} == 0.0, tl.where({b} == 0.0, 0.0, {m}), {m}))"),
         ("m", f"tl.where({{b}} < 0.0, {PI} - {{m}}, tl.where({{b}} == 0.0, "
               f"tl.where(1.0 / {{b}} < 0.0, {PI} - {{m}}, {{m}}), {{m}}))")), \
    "tl.where({a} < 0.0, {m} * -1.0, tl.where({a} == 0.0, tl.where(1.0 / {a} < 0.0, {m} * -1.0, {m}), {m}))"


def _fmod_steps() -> tuple:
    """The steps of fmod(a, b) of float32 values, exact (a GPU's frem is not), into ``f``:
    |a| = ma 2^ea and |b| = mb 2^eb with integers of 24 bits, the remainder is that of ma
    2^(ea - eb) by mb, times 2^eb, with a's sign. The long division shifts 32 bits at a time
    in int64 (eight steps cover float32's exponents). NaN where b is 0 or a infinite (or
    either NaN); a where |a| < |b| (an infinite b among them)."""
    exponent = "((({x} >> 23) & 255))"
    significand = "((({x} & 8388607) | tl.where((({x} >> 23) & 255) == 0, 0, 8388608))"
    steps = [("a", "tl.cast({a}, tl.float32)"), ("b", "tl.cast({b}, tl.float32)"),  # a literal becomes a value
             ("p", "{a}.to(tl.int32, bitcast=True)"), ("q", "{b}.to(tl.int32, bitcast=True)"),
             # a denormal's exponent is the smallest normal one's, without the implicit bit
             ("d", f"(tl.maximum({exponent.format(x='{p}')}, 1) - tl.maximum({exponent.format(x='{q}')}, 1))"
                   ".to(tl.int64)"),
             ("k", f"tl.maximum({exponent.format(x='{q}')}, 1) - 150"),
             ("ma", significand.format(x="{p}") + ").to(tl.int64)"),
             ("mb", significand.format(x="{q}") + ").to(tl.int64)"),
             ("mb", "tl.where({mb} == 0, 1, {mb})"),
             ("r", "{ma} % {mb}")]
    steps += [("r", f"({{r}} << tl.minimum(tl.maximum({{d}} - {32 * i}, 0), 32)) % {{mb}}") for i in range(8)]
    steps += [  # 2^k (k = eb - 150) from its bits, normal or denormal; r 2^k is exact (it is a multiple of
        # b's last place below |b|)
        ("s", "tl.where({k} >= -126, ({k} + 127) << 23, 1 << tl.maximum({k} + 149, 0)).to(tl.float32, bitcast=True)"),
        ("f", "{r}.to(tl.float32) * {s}"),
        ("f", "(({f}.to(tl.int32, bitcast=True) & 2147483647) | ({p} & (-2147483647 - 1)))"
              ".to(tl.float32, bitcast=True)"),
        ("f", "tl.where({d} < 0, {a}, {f})"),
        ("f", "tl.where({a} != {a}, {a}, tl.where({b} != {b}, {b}, tl.where({b} == 0.0, float('nan'), "
              "tl.where(tl.abs({a}) == float('inf'), float('nan'), {f}))))")]
    return tuple(steps)


FMOD = _fmod_steps(), "{f}"
# Python's remainder, as torch computes it: fmod, plus b where it is nonzero and of the
# other sign than b
REMAINDER = FMOD[0], "tl.where({f} != 0.0, tl.where(({b} < 0.0) != ({f} < 0.0), {f} + {b}, {f}), {f})"
# floor division, as torch computes it (div_floor_floating): (a - fmod(a, b)) / b, one
# less where that remainder is of the other sign than b, then floored and rounded to the
# nearer whole; a zero of a / b's sign where the quotient is 0; a / b where b is 0
FLOOR_DIVIDE = (*FMOD[0], ("t", "({a} - {f}) / {b}"),
                ("t", "tl.where({f} != 0.0, tl.where(({b} < 0.0) != ({f} < 0.0), {t} - 1.0, {t}), {t})"),
                ("g", "tl.floor({t})"), ("g", "tl.where({t} - {g} > 0.5, {g} + 1.0, {g})"),
                ("z", "(({a} / {b}).to(tl.int32, bitcast=True) & (-2147483647 - 1)).to(tl.float32, bitcast=True)")), \
    "tl.where({b} == 0.0, {a} / {b}, tl.where({t} != 0.0, {g}, {z}))"

# nextafter(a, b), float32: a's bits one step further from zero where b lies beyond a
# from zero, one step nearer otherwise (-0.0's bits are a zero's too); from a zero, the
# smallest denormal of b's sign; b where they are equal, NaN where either is
NEXTAFTER = (("p", "tl.cast({a}, tl.float32).to(tl.int32, bitcast=True)"),
             ("q", "tl.cast({b}, tl.float32).to(tl.int32, bitcast=True)"),
             ("n", "tl.where(({b} > {a}) == ({a} > 0.0), {p} + 1, {p} - 1).to(tl.float32, bitcast=True)"),
             ("z", "(({q} & (-2147483647 - 1)) | 1).to(tl.float32, bitcast=True)")), \
    "tl.where({a} != {a}, {a}, tl.where({b} != {b}, {b}, tl.where({a} == {b}, {b}, tl.where({a} == 0.0, {z}, {n}))))"


BINARY: dict[str, OpDef] = {op.name: op for op in [
    OpDef("add", torch.add, "({a} + {b})"),
    OpDef("sub", torch.sub, "({a} - {b})"),
    OpDef("mul", torch.mul, "({a} * {b})"),
    OpDef("div", torch.div, "({a} / {b})", 1.5),
    OpDef("pow", torch.pow, "", 4),  # written by the code generator (constant exponents)
    # NaN from either side, as torch has it (Triton's maximum is a GPU's max.f32, which
    # returns the other operand; propagate_nan has no Gluon spelling for the templates)
    OpDef("maximum", torch.maximum, "tl.where({a} != {a}, {a}, tl.where({b} != {b}, {b}, tl.maximum({a}, {b})))"),
    OpDef("minimum", torch.minimum, "tl.where({a} != {a}, {a}, tl.where({b} != {b}, {b}, tl.minimum({a}, {b})))"),
    # the other operand where one is NaN (NaN where both are), else the first where equal
    # (fmax(-0.0, 0.0) is -0.0 in torch)
    OpDef("fmax", torch.fmax, "tl.where({a} != {a}, {b}, tl.where({b} > {a}, {b}, {a}))"),
    OpDef("fmin", torch.fmin, "tl.where({a} != {a}, {b}, tl.where({b} < {a}, {b}, {a}))"),
    # a's magnitude bits with b's sign bit, NaN included (float32 only, as signbit)
    # (tl.cast: a literal operand becomes a value that bitcasts)
    OpDef("copysign", torch.copysign, "(((tl.cast({a}, tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF) | "
          "(tl.cast({b}, tl.float32).to(tl.int32, bitcast=True) & (-0x7FFFFFFF - 1))).to(tl.float32, bitcast=True))",
          0.5),
    _stepped("hypot", torch.hypot, HYPOT, 3),
    _stepped("nextafter", torch.nextafter, NEXTAFTER, 2),
    _stepped("atan2", torch.atan2, ATAN2, 5),
    # On integers: C's quotient toward zero and remainder of the dividend's sign (Triton's
    # // and %, as LLVM's sdiv and srem); floor division and Python's remainder are built
    # from them (schema/handlers/pointwise.py, _int_division)
    OpDef("idiv", lambda a, b: torch.div(a, b, rounding_mode="trunc"), "({a} // {b})"),
    OpDef("irem", torch.fmod, "({a} % {b})"),
    # On floats (float32 and narrower, computed in float32), exact: the significands' long division
    _stepped("fmod", torch.fmod, FMOD, 12),
    _stepped("remainder", torch.remainder, REMAINDER, 13),
    _stepped("floordiv", lambda a, b: torch.div(a, b, rounding_mode="floor"), FLOOR_DIVIDE, 16),
    OpDef("eq", torch.eq, "({a} == {b})"),
    OpDef("ne", torch.ne, "({a} != {b})"),
    OpDef("lt", torch.lt, "({a} < {b})"),
    OpDef("le", torch.le, "({a} <= {b})"),
    OpDef("gt", torch.gt, "({a} > {b})"),
    OpDef("ge", torch.ge, "({a} >= {b})"),
    # On bools, as selects and a comparison: Triton's interpreter refuses & | ^ between a
    # scalar bool (a broadcast value of one element) and a block of them
    OpDef("and", torch.logical_and, "tl.where({a}, {b}, False)"),
    OpDef("or", torch.logical_or, "tl.where({a}, True, {b})"),
    OpDef("xor", torch.logical_xor, "({a} != {b})"),
    # On integers: bits (unpacking quantised weights).
    OpDef("bitand", torch.bitwise_and, "({a} & {b})", 0.5),
    OpDef("bitor", torch.bitwise_or, "({a} | {b})", 0.5),
    OpDef("bitxor", torch.bitwise_xor, "({a} ^ {b})", 0.5),
    OpDef("rshift", torch.bitwise_right_shift, "({a} >> {b})", 0.5),
    OpDef("lshift", torch.bitwise_left_shift, "({a} << {b})", 0.5),
]}

BOOL_UNARY = {"not", "isnan", "isinf", "signbit"}  # unary ops whose result is bool
COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor"}

# Reductions over the last axis: torch reference and the neutral element.
REDUCE: dict[str, tuple[Callable, float]] = {
    "sum": (lambda x: x.sum(-1, keepdim=True), 0.0),
    "max": (lambda x: x.amax(-1, keepdim=True), float("-inf")),
    "min": (lambda x: x.amin(-1, keepdim=True), float("inf")),
    "prod": (lambda x: x.prod(-1, keepdim=True), 1.0),
}

# dtype names used in terms, and the torch / Triton types they stand for.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
TRITON_DTYPES = {
    "float16": "tl.float16", "bfloat16": "tl.bfloat16", "float32": "tl.float32",
    "float64": "tl.float64", "int8": "tl.int8", "int16": "tl.int16", "int32": "tl.int32",
    "int64": "tl.int64", "uint8": "tl.uint8", "bool": "tl.int1",
}
NARROW_FLOATS = {"float16", "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise KeyError(f"dtype {dtype} is not supported by eqfuse kernels") from None


def itemsize(dtype: str) -> int:
    """Bytes an element of ``dtype`` (a name) takes: asked thousands of times a graph by
    the cost model and the TMA checks, so read from torch's dtype, not a tensor made for it."""
    return DTYPES[dtype].itemsize


def is_float(dtype: str) -> bool:
    return DTYPES[dtype].is_floating_point


def is_int(dtype: str) -> bool:
    """An integer dtype (bool is not one)."""
    return dtype != "bool" and not DTYPES[dtype].is_floating_point and not DTYPES[dtype].is_complex


def reduce_identity(op: str, dtype: str):
    """The value reduction ``op`` starts from in ``dtype``: -inf for a float max, the
    smallest integer for an integer one (an int64 max over a row: multilabel_margin_loss)."""
    identity = REDUCE[op][1]
    if dtype == "bool":
        return op == "min"
    if not is_float(dtype) and math.isinf(identity):
        info = torch.iinfo(DTYPES[dtype])
        return info.min if identity < 0 else info.max
    return identity
