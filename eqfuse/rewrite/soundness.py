"""Soundness of an algebra rule: its two sides, evaluated with PyTorch in float64
(``rules.TorchBuilder``), agree on random inputs and on special values.

Every built-in rule is checked so (tests/test_rules.py), and so is a user's rule before a
compile takes it (``Options(rules=...)``): a rule that changes a value is refused with
the input where its sides part.
"""

from __future__ import annotations

import torch

from .rules import AlgebraRule, TorchBuilder

# Special values: NaN, infinities, signed zeros, denormals (of float64 and float32), the
# largest finite values, and numbers whose products or sums overflow or cancel.
SPECIALS = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 5e-324, -5e-324, 1e-40, -1e-40,
            torch.finfo(torch.float64).max, -torch.finfo(torch.float64).max, torch.finfo(torch.float32).max,
            1.0, -1.0, 0.5, 2.0]

# torch.maximum's zero sign differs between its scalar and vectorised CPU paths (IEEE
# leaves max(-0.0, +0.0) open): the rules over it are not held to a sign of zero.
ZERO_SIGN_OPEN = {"max-zero-relu"}
DRAWS = 5


def draw(domain: str, gen: torch.Generator) -> torch.Tensor:
    """64 random values of the domain ("any", "pos" or "bool"), then its special values,
    64 of them in a rotated order (each variable its own) so that pairs of specials meet."""
    if domain == "bool":
        return torch.rand(128, generator=gen, device="cpu") > 0.5
    x = torch.randn(64, dtype=torch.float64, generator=gen, device="cpu") * 3
    specials = torch.tensor(SPECIALS, dtype=torch.float64)
    if domain == "pos":
        x, specials = x.abs() + 0.1, specials[(specials > 0) | specials.isnan()]
    shift = int(torch.randint(len(specials), (), generator=gen))
    return torch.cat([x, specials.roll(shift).repeat(64 // len(specials) + 1)[:64]])


def disagreement(lhs, rhs, zero_sign: bool = True) -> int | None:
    """The first position where two sides differ beyond rounding (NaN where the other is
    not; where the left side is a zero, the right side's sign another), or None."""
    lhs, rhs = torch.broadcast_tensors(*(torch.as_tensor(v, dtype=torch.float64) for v in (lhs, rhs)))
    lhs, rhs = lhs.reshape(-1), rhs.reshape(-1)
    nan = lhs.isnan() != rhs.isnan()
    both = ~lhs.isnan() & ~rhs.isnan()
    far = both & ~torch.isclose(lhs, rhs, rtol=1e-12, atol=1e-300)
    sign = (lhs == 0) & (torch.signbit(lhs) != torch.signbit(rhs)) if zero_sign else torch.zeros_like(nan)
    bad = (nan | far | sign).nonzero()
    return int(bad[0]) if len(bad) else None


def unsound(rule: AlgebraRule) -> str | None:
    """Where ``rule``'s sides part, in one line (the inputs and both values), or None."""
    gen = torch.Generator(device="cpu").manual_seed(sum(map(ord, rule.name)))
    domains = rule.domains or ("any",) * rule.arity
    if len(domains) != rule.arity:
        return f"{len(domains)} domains for {rule.arity} variables"
    for _ in range(DRAWS):
        xs = [draw(d, gen) for d in domains]
        try:
            lhs, rhs = rule.pattern(TorchBuilder(), *xs)
        except Exception as e:  # an op the builder does not know, a wrong arity
            return f"its sides cannot be evaluated: {type(e).__name__}: {e}"
        at = disagreement(lhs, rhs, zero_sign=rule.name not in ZERO_SIGN_OPEN)
        if at is not None:
            values = ", ".join(f"{v} = {x[at].item()!r}" for v, x in zip("xyzw", xs))
            sides = [torch.as_tensor(t, dtype=torch.float64).broadcast_to(xs[0].shape).reshape(-1)[at].item()
                     for t in (lhs, rhs)]
            return f"at {values}: the left side is {sides[0]!r}, the right side {sides[1]!r}"
    return None
