"""Triton functions that generated kernels call in place of a libdevice one, each written
into a generated module only where one of its kernels calls it (``used_by``).

``eqfuse_erf``: erf as libdevice's ``__nv_erff`` computes it (its two polynomials, the
same fused multiply-adds, its ``ex2``), with selects where libdevice branches twice. A
kernel inlines libdevice's erff once per value a thread holds: the gelu epilogue of a
128 x 256 tile, 128 values a thread, made 260 basic blocks, and its compile for sm_90
took 2.4 s, of which 1.6 s for the erf alone (the same kernel with erf left out: 0.7 s);
it was the slowest kernel of BERT's and GPT-2's cold compiles. Without branches a warp
does the same work: a warp whose values straddle |x| = 1.003 ran both of libdevice's
paths anyway. float64 keeps libdevice's erf (these coefficients are float32's).
"""

from __future__ import annotations

ERF = '''@triton.jit
def eqfuse_erf(x):
    """erf(x): libdevice's erff without its branches (eqfuse/codegen/mathlib.py)."""
    if x.dtype == tl.float64:
        return tl.erf(x)
    t = tl.abs(x)
    tail = t >= 1.00296  # 1 - 2^(-t (1 + p(t))); below, x (1 + p(x^2))
    u = tl.where(tail, t, x * x)
    p = tl.where(tail, 1.6425845e-05, 8.4834945e-05)
    p = tl.fma(p, u, tl.where(tail, -0.00046802105, -0.00082130916))
    p = tl.fma(p, u, tl.where(tail, 0.005264764, 0.005213489))
    p = tl.fma(p, u, tl.where(tail, -0.034303077, -0.026868774))
    p = tl.fma(p, u, tl.where(tail, 0.1532937, 0.11284005))
    p = tl.fma(p, u, tl.where(tail, 0.91631305, -0.37612665))
    p = tl.fma(p, u, tl.where(tail, 0.62829983, 0.12837915))
    s = tl.where(tail, -t, x)
    r = tl.fma(p, s, s)
    e = 1.0 - tl.math.exp2(r)
    return tl.where(tail, tl.where(x < 0, -e, e), r)
'''

HELPERS = {"eqfuse_erf": ERF}


def used_by(sources) -> list[str]:
    """The helpers' sources that the kernel sources call, in a fixed order."""
    sources = list(sources)
    return [text for name, text in HELPERS.items() if any(f"{name}(" in s for s in sources)]
