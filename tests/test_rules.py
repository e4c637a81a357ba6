"""Soundness: both sides of every rewrite rule agree on random inputs."""

import zlib

import pytest
import torch
from conftest import DEVICE, assert_matches

import eqfuse
from eqfuse.examples import EXAMPLES
from eqfuse.rewrite import soundness
from eqfuse.rewrite.rules import (
    ALGEBRA,
    CAST_ROUNDTRIPS,
    MATMUL,
    RULESET_NAMES,
    SOFTMAX,
    AlgebraRule,
    TorchBuilder,
    catalogue,
    choice_key,
    rulesets,
)


@pytest.mark.parametrize("rule", ALGEBRA, ids=lambda r: r.name)
def test_algebra_rule_is_sound(rule):
    """Both sides agree on random values and on special ones (NaN, infinities, signed
    zeros, denormals, the largest finite values): eqfuse.rewrite.soundness."""
    assert soundness.unsound(rule) is None


def test_adding_zero_is_no_rule_negative_zero_would_lose_its_sign():
    """1 / (x + 0) at x = -0.0 is +inf in eager: the sum must stay."""
    assert "add-zero" not in {r.name for r in ALGEBRA}
    x = torch.tensor([-0.0, 0.0, 3.0])
    c = eqfuse.compile(lambda x: 1.0 / (x + 0.0), (x,))
    assert not c.fallbacks, c.explain()
    assert torch.equal(c(x), torch.tensor([float("inf"), float("inf"), 1 / 3]))


@pytest.mark.parametrize("rule", MATMUL, ids=lambda r: r.name)
def test_matmul_rule_is_sound(rule):
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(rule.name.encode()))
    for m, k, n in ((1, 1, 1), (5, 7, 3), (17, 33, 9)):
        a = torch.randn(m, k, dtype=torch.float64, generator=gen, device="cpu")
        b = torch.randn(k, n, dtype=torch.float64, generator=gen, device="cpu")
        s = torch.randn((), dtype=torch.float64, generator=gen, device="cpu") * 3
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
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(rule.name.encode()))
    for b, m, n, d in ((1, 1, 1, 1), (2, 5, 7, 3), (3, 17, 33, 9)):
        s = torch.randn(b, m, n, dtype=torch.float64, generator=gen, device="cpu") * 4 + 30
        s[..., 1:][torch.rand(b, m, n - 1, generator=gen, device="cpu") < 0.3] = float("-inf")
        v = torch.randn(b, n, d, dtype=torch.float64, generator=gen, device="cpu")
        r = torch.rand(b, m, 1, dtype=torch.float64, generator=gen, device="cpu") + 0.5
        x = torch.exp(s - s.amax(-1, keepdim=True)) if rule.row_factor else s
        lhs, rhs = rule.pattern(TorchBuilder(), x, v, r)
        if rule.exact:
            torch.testing.assert_close(lhs, rhs, rtol=1e-10, atol=1e-10)
        else:
            # The sides round the weights (and the result) to float16 at different
            # points: each term of the sum may move by a few float16 ulps, so the bound
            # scales with the sum of the terms' magnitudes, not with the (possibly
            # cancelled) result.
            weights = x if rule.row_factor else torch.exp(s - s.amax(-1, keepdim=True))
            terms = weights @ v.abs() * 2  # r (or 1 / r) is at most 2
            assert ((lhs - rhs).abs() <= 4 * 2.0**-10 * terms + 1e-6).all(), (lhs - rhs).abs().max()


# --- concatenations and slices (CONCAT, and the views rules slice-read / slice-permute) ---

@pytest.mark.parametrize("batch", [(), (3,)])
def test_concat_rules_are_sound(batch):
    """Both sides of reshape-cat-last, dot-cat-split, slice-read and slice-permute, on
    random inputs, as the rules write them (a cat of three is two nested ones)."""
    gen = torch.Generator(device="cpu").manual_seed(len(batch))
    a, b, c = (torch.randn(*batch, 2, 5, k, dtype=torch.float64, generator=gen, device="cpu") for k in (4, 7, 3))
    cat = torch.cat([torch.cat([a, b], -1), c], -1)
    # reshape-cat-last: regrouping the leading axes passes through a cat along the last
    rows = (*batch, 10)
    regrouped = torch.cat([torch.cat([a.reshape(*rows, 4), b.reshape(*rows, 7)], -1), c.reshape(*rows, 3)], -1)
    assert torch.equal(cat.reshape(*rows, 14), regrouped)
    # dot-cat-split: a product over a concatenated K is the sum over the parts
    w = torch.randn(*batch, 14, 6, dtype=torch.float64, generator=gen, device="cpu")
    x = cat.reshape(*rows, 14)
    split = x[..., :11] @ w[..., :11, :] + c.reshape(*rows, 3) @ w[..., 11:, :]
    torch.testing.assert_close(x @ w, split, rtol=1e-12, atol=1e-12)
    inner = x[..., :11] @ w[..., :11, :]
    torch.testing.assert_close(inner, a.reshape(*rows, 4) @ w[..., :4, :] + b.reshape(*rows, 7) @ w[..., 4:11, :],
                               rtol=1e-12, atol=1e-12)
    # slice-read: a slice of a strided read is a read at an offset, the stride times the step
    buf = torch.randn(200, dtype=torch.float64, generator=gen, device="cpu")
    view = buf.as_strided((6, 5), (20, 3), 7)
    dim, start, step, size = 0, 1, 2, 3
    sliced = view.narrow(dim, start, (size - 1) * step + 1)[::step]
    assert torch.equal(sliced, buf.as_strided((3, 5), (20 * step, 3), 7 + start * 20))
    # slice-permute: slicing dim d of permute(x, p) slices dim p[d] of x
    t = torch.randn(4, 6, 5, dtype=torch.float64, generator=gen, device="cpu")
    p = (2, 0, 1)
    assert torch.equal(t.permute(p).narrow(2, 1, 3), t.narrow(p[2], 1, 3).permute(p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_product_over_a_concatenation_reads_each_part(dtype):
    """The backward of a fused q/k/v projection: cat(dq, dk, dv) @ W^T. The rules make it
    one kernel whose K loop walks the three parts into one accumulator, each read as
    stored (no element-wise select), and it matches eager."""
    def f(q, k, v, w):
        return torch.cat([q, k, v], -1).reshape(-1, 3 * q.shape[-1]) @ w.t()
    gen = torch.Generator(device="cpu").manual_seed(0)
    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cpu").to(torch.get_default_device(), dtype)
    q, k, v = (rand(2, 9, 256) for _ in range(3))
    w = rand(17, 768)
    c = eqfuse.compile(f, (q, k, v, w))
    assert_matches(c(q, k, v, w), f(q, k, v, w), contraction=True)
    fired = c.report["saturation"]["rules_fired"]
    assert fired.get("dot-cat-split", 0) >= 2 and fired.get("reshape-cat-last", 0) >= 2
    assert len(c.kernels) == 1
    body = c.kernels[0].source
    # one loop over the three K ranges, picking each part's buffer per step; no select per element
    assert body.count("tl.dot(") == 1 and "part_a = " in body and "tl.where((kindex" not in body, body


def test_concatenation_feeding_a_product_along_its_rows_is_stored():
    """The weight gradient of the same projection at GPT-2's size, cat(dq, dk, dv)^T @ x:
    the concatenation runs along the product's rows, where no rule splits it. Gathered in
    the product's operand its loads would not pipeline (codegen/tiles.py: 143 us on an
    H100 against about 45 for the product over the stored concatenation), so the plan
    stores it and the product reads it plainly. (Planned only: the interpreter would take
    minutes to run products of this size; smaller ones keep the gather, which is cheaper
    there, and both forms are checked against eager elsewhere.)"""
    def f(q, k, v, x):
        return torch.cat([q, k, v], -1).reshape(-1, 3 * q.shape[-1]).t() @ x
    q, k, v = (torch.zeros(8, 1024, 768, dtype=torch.float16) for _ in range(3))
    x = torch.zeros(8192, 768, dtype=torch.float16)
    c = eqfuse.compile(f, (q, k, v, x), validate=False)
    products = [k for k in c.kernels if "tl.dot(" in k.source]
    assert products and all("tl.where" not in p.source for p in products), [p.source for p in products]


# --- a user's rules, and the workbench (eqfuse/workbench.py) ---------------------------------

EXP_LOG = AlgebraRule("exp-log", 1, lambda k, x: (k.unary("exp", k.unary("log", x)), x), ("pos",))


def test_a_users_rule_changes_the_plan():
    """``rules=(*RULESET_NAMES, rule)``: the rule joins the algebra ruleset, fires, and
    the kernel computes what its right side says (no log, no exp), eager's values."""
    fn = lambda x: torch.exp(torch.log(x)) * 2.0  # noqa: E731
    x = torch.rand(8, 16) + 0.5
    plain = eqfuse.compile(fn, (x,))
    mine = eqfuse.compile(fn, (x,), rules=(*RULESET_NAMES, EXP_LOG))
    assert "tl.log" in plain.source and "tl.log" not in mine.source, mine.source
    assert mine.report["saturation"]["rules_fired"]["exp-log"] > 0
    torch.testing.assert_close(mine(x), fn(x))


def test_an_unsound_rule_is_refused_with_where_its_sides_part():
    bad = AlgebraRule("div-self", 1, lambda k, x: (k.binary("div", x, x), k.const(1.0)))
    with pytest.raises(eqfuse.EqfuseError, match=r"'div-self' .* is unsound: at x = nan: the left side is nan"):
        eqfuse.compile(lambda x: x / x, (torch.rand(4),), rules=(*RULESET_NAMES, bad))


@pytest.mark.parametrize("rules, problem", [
    (("algebra", "-no-such-rule"), "no built-in rule 'no-such-rule'"),
    (("algebra", AlgebraRule("mul-one", 1, lambda k, x: (x, x))), "has the name of a built-in rule"),
    (("algebr",), "unknown ruleset 'algebr'"),
])
def test_the_rules_option_names_what_it_does_not_know(rules, problem):
    with pytest.raises(eqfuse.EqfuseError, match=problem):
        eqfuse.compile(lambda x: x + 1, (torch.rand(4),), rules=rules)


def test_the_plan_cache_keys_a_users_rule_by_its_sides():
    """Two processes spelling one rule alike share plans; another rule does not."""
    again = AlgebraRule("exp-log", 1, lambda k, x: (k.unary("exp", k.unary("log", x)), x), ("pos",))
    other = AlgebraRule("exp-log", 1, lambda k, x: (k.unary("log", k.unary("exp", x)), x))
    assert choice_key((*RULESET_NAMES, EXP_LOG)) == choice_key((*RULESET_NAMES, again))
    assert choice_key((*RULESET_NAMES, EXP_LOG)) != choice_key((*RULESET_NAMES, other))
    assert choice_key((*RULESET_NAMES, EXP_LOG)) != choice_key(RULESET_NAMES)


def test_rules_try_reports_where_a_users_rule_fired(tmp_path, capsys):
    from eqfuse.cli import main

    path = tmp_path / "my_rules.py"
    path.write_text("from eqfuse.rewrite.rules import AlgebraRule\n"
                    "RULES = [AlgebraRule('add-swapped', 2, lambda k, x, y: (k.binary('add', x, y), "
                    "k.binary('add', y, x)))]\n")
    assert main(["rules", "try", str(path), "--only", "add_constant"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("add_constant"))
    fired = row.split()[3]  # baseline -> with the rule
    assert fired.startswith("0->") and int(fired[3:]) > 0, out
    assert "0 of 1 workloads changed" in out and row.split()[-1] == "ok", out


def test_rules_ablate_reports_the_plans_a_rule_made(capsys):
    """Without softmax-dot, attention written plainly is a product, a softmax and a
    product: three kernels where one streamed."""
    from eqfuse.cli import main

    assert main(["rules", "ablate", "softmax-dot", "--only", "causal_attention_where"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("causal_attention_where"))
    assert row.split()[1] == "1->3" and row.endswith("*"), out
    assert "1 of 1 workloads changed" in out


def test_rules_try_names_a_file_without_rules(tmp_path, capsys):
    from eqfuse.cli import main

    path = tmp_path / "empty.py"
    path.write_text("x = 1\n")
    assert main(["rules", "try", str(path)]) == 1
    assert "defines no RULES" in capsys.readouterr().err
