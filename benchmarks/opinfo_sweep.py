"""PyTorch's OpInfo database (the op list Inductor is tested against) through
``eqfuse.compile``, on the CPU interpreter: per op and dtype, its first sample inputs
compiled and called, and the result held against eager's.

    TRITON_INTERPRET=1 python benchmarks/opinfo_sweep.py [--dtypes float32 float16]
        [--samples 1] [--ops add mul ...] [--out results.json]

A result is wrong where its values (NaN equal to NaN), dtype or shape differ from eager's,
where it is not contiguous and eager's is, where it shares memory with an input and
eager's does not, or where the call changed an input; a compile or call that raises is an
error, unless it is eqfuse's own clear refusal (``refused``: a function it cannot trace,
such as one whose output depends on its data). Each sample is otherwise ``kernels``
(eqfuse generated at least one kernel), ``no work`` (nothing to compute: the compiled
graph returns views of its inputs, or tensors with no elements) or ``eager`` (the graph
runs in eager, with its reason). Ops whose eager result differs between two calls (random ops), or holds
uninitialised memory, are compared on dtype and shape only. Each other sample is then
called again through the same compiled function with its values shuffled, with a NaN in
each float input, and with non-contiguous inputs (``VARIANTS``), each held against eager
alike (a variant eager refuses is not held). The coverage is the
share of ops with a sample compiled (kernels or no work, no eager step); the kernel
compiler's coverage that of the ops a kernel compiler is for (``NOT_KERNEL_OPS``).
``tests/test_opinfo.py`` runs a seeded share of this in the suite.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

import eqfuse  # noqa: E402

RTOL = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# Ops whose result holds whatever memory held: compared on dtype and shape only
UNINITIALISED = ("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided")


def op_db():
    from torch.testing._internal.common_methods_invocations import op_db as db
    return db


def samples(op, dtype, count: int):
    """The op's first ``count`` sample inputs at ``dtype`` on the CPU, as (call, tensors):
    ``call(*tensors)`` calls the op with the sample's other arguments fixed."""
    if dtype not in op.supported_dtypes("cpu"):
        return []
    out = []
    for s in op.sample_inputs("cpu", dtype, requires_grad=False):
        if len(out) == count:
            break
        leaves, spec = pytree.tree_flatten((s.input, s.args, s.kwargs))
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if not where:
            continue

        def call(*tensors, leaves=leaves, spec=spec, where=where, fn=op.op):
            filled = list(leaves)
            for i, t in zip(where, tensors):
                filled[i] = t
            x, args, kwargs = pytree.tree_unflatten(filled, spec)
            return fn(x, *args, **kwargs)

        out.append((call, [leaves[i] for i in where]))
    return out


def _tensors(result) -> list:
    return [x for x in pytree.tree_leaves(result) if isinstance(x, torch.Tensor)]


def _clones(tensors):
    return [t.clone() for t in tensors]


def _shares(t: torch.Tensor, inputs) -> bool:
    return any(t.numel() and x.numel() and t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
               for x in inputs)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN equal to NaN."""
    if a.is_floating_point() or a.is_complex():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a, b)


def wrong(got, want, inputs_after, inputs_before, inputs_eager, deterministic: bool) -> str | None:
    """How the compiled result ``got`` differs from eager's ``want``, in words (None: it
    does not). The inputs: after the compiled call, before any call, after eager's."""
    for before, after, eager in zip(inputs_before, inputs_after, inputs_eager):
        if _same(before, after) != _same(before, eager):
            return "the call changed an input" if _same(before, eager) else "the call left an input eager changes"
        differs = _differs(after, eager) if deterministic and not _same(after, eager) else None
        if differs:  # (written by a kernel, as a batch norm's running statistics: its rounding)
            return f"the call changed an input otherwise than eager: {differs}"
    g, w = _tensors(got), _tensors(want)
    if len(g) != len(w) or type(got) is not type(want) and not (isinstance(got, (tuple, list))
                                                                 and isinstance(want, (tuple, list))):
        return f"result {type(got).__name__} of {len(g)} tensors, eager {type(want).__name__} of {len(w)}"
    if not w and got != want:
        return f"result {got!r}, eager {want!r}"
    for i, (a, b) in enumerate(zip(g, w)):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"output {i}: {a.dtype} {tuple(a.shape)}, eager {b.dtype} {tuple(b.shape)}"
        if not deterministic:
            continue
        if b.is_contiguous() and not a.is_contiguous():
            return f"output {i}: strides {a.stride()}, eager's contiguous {b.stride()}"
        if _shares(a, inputs_after) and not _shares(b, inputs_eager):
            return f"output {i} shares memory with an input; eager's does not"
        differs = _differs(a, b)
        if differs:
            return f"output {i}: {differs}"
    return None


def _differs(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """How ``a`` differs from eager's ``b`` beyond the dtype's tolerance, in words, or None."""
    try:
        rtol = RTOL.get(b.dtype, 0)
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol, equal_nan=True)
    except AssertionError as e:
        return " ".join(str(e).split())[:200]
    return None


def _with_nan(tensors):
    """Each float input with one NaN, in its middle element."""
    out = _clones(tensors)
    for t in out:
        if t.is_floating_point() and t.numel():
            t.view(-1)[t.numel() // 2] = float("nan")
    return out


def _permuted(tensors):
    """Each input's values in another order (a seeded shuffle): the compiled graph must
    not hold the values it was compiled on."""
    g = torch.Generator().manual_seed(0)
    return [t.reshape(-1)[torch.randperm(t.numel(), generator=g)].reshape(t.shape) if t.numel() > 1 else t.clone()
            for t in tensors]


def _spread(tensors):
    """Each input of two or more elements as a non-contiguous view of the same values
    (every other element of a buffer twice its size)."""
    out = []
    for t in tensors:
        if t.dim() == 0 or t.numel() < 2:
            out.append(t.clone())
            continue
        wide = torch.zeros(tuple(t.shape) + (2,), dtype=t.dtype)
        wide[..., 0] = t
        out.append(wide[..., 0])
    return out


# The inputs each sample is called with again, after its own, through the same compiled
# function: values it was not compiled on, a NaN, and strides it was not (compiled anew)
VARIANTS = {"permuted values": _permuted, "with a NaN": _with_nan, "non-contiguous": _spread}


def _variant_problem(compiled, call, tensors, deterministic: bool) -> str | None:
    """The first input variant whose compiled call differs from eager's, in words."""
    for name, make in VARIANTS.items():
        varied = make(tensors)
        copies = _spread if make is _spread else _clones  # (a clone of a spread view is contiguous)
        inputs_eager = copies(varied)
        try:
            want = call(*inputs_eager)
        except Exception:  # noqa: BLE001,PERF203 - eager refuses such inputs (an index out of range): nothing to hold
            continue
        inputs = copies(varied)
        try:
            got = compiled(*inputs)
        except Exception as e:  # noqa: BLE001 - eager ran, so the compiled call must
            return f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
        problem = wrong(got, want, inputs, varied, inputs_eager, deterministic)
        if problem:
            return f"{name}: {problem}"
    return None


def run_sample(call, tensors, uninitialised: bool = False, variants: bool = True) -> dict:
    inputs_eager = _clones(tensors)
    want = call(*inputs_eager)
    again = call(*_clones(tensors))
    deterministic = not uninitialised and all(
        _same(a, b) for a, b in zip(_tensors(want), _tensors(again)) if a.shape == b.shape)
    inputs = _clones(tensors)
    try:
        compiled = eqfuse.compile(call, tuple(inputs))
        got = compiled(*inputs)
    except Exception as e:  # noqa: BLE001 - a sweep records what raises
        outcome = "refused" if isinstance(e, eqfuse.EqfuseError) else "error"
        return {"outcome": outcome, "why": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
    problem = wrong(got, want, inputs, tensors, inputs_eager, deterministic)
    if problem is None and variants and deterministic:
        problem = _variant_problem(compiled, call, tensors, deterministic)
    if problem:
        return {"outcome": "wrong", "why": problem}
    wholly_eager = any(f.node == "<graph>" for f in compiled.fallbacks)  # a first launch that failed, too
    if compiled.kernels and not wholly_eager:
        return {"outcome": "kernels", "kernels": len(compiled.kernels),
                "eager_steps": [f.node for f in compiled.fallbacks]}
    if not compiled.fallbacks:
        return {"outcome": "no work"}  # views of its inputs, or tensors with no elements
    return {"outcome": "eager", "why": compiled.fallbacks[0].reason}


def sweep(ops, dtypes, count: int, log=print, variants: bool = True) -> list[dict]:
    rows = []
    for op in ops:
        for dtype in dtypes:
            try:
                cases = samples(op, dtype, count)
            except Exception as e:  # noqa: BLE001 - an OpInfo whose samples cannot be made
                log(f"{op.name} {dtype}: no samples ({type(e).__name__})")
                continue
            for k, (call, tensors) in enumerate(cases):
                t0 = time.perf_counter()
                try:
                    # (not where a kernel compiler does not go: eager's linalg.eig on a NaN
                    # kills the process in MKL, torch 2.13 on the CPU)
                    row = run_sample(call, tensors, op.name in UNINITIALISED,
                                     variants and not NOT_KERNEL_OPS.match(op.name))
                except Exception as e:  # noqa: BLE001 - eager itself refused the sample
                    row = {"outcome": "eager-error", "why": f"{type(e).__name__}"}
                row.update(op=op.name, variant=op.variant_test_name, dtype=str(dtype)[6:], sample=k,
                           seconds=round(time.perf_counter() - t0, 2))
                rows.append(row)
                if row["outcome"] in ("wrong", "error"):
                    log(f"{row['outcome'].upper()} {op.name}.{op.variant_test_name} {row['dtype']}: {row['why']}")
    return rows


# The ops a kernel compiler is not for (Inductor calls ATen's for them too): matrix
# factorisations and solvers, FFTs, sparse layouts, complex numbers, CUDA's jiterator, and
# ops whose output's shape depends on its values. Their sweep rows stay; the coverage of
# the kernel compiler's ops leaves them out, with the ops no graph can hold (every sample
# refused by eqfuse's own error: random ops, data-dependent Python control flow).
NOT_KERNEL_OPS = re.compile(r"^(fft\.|sparse\.|jiterator_|to_sparse|linalg\.(?!(cross|diagonal|matrix_norm|norm|vecdot|"
                            r"vector_norm|multi_dot|matrix_power|vander)$)|(cholesky|cholesky_inverse|cholesky_solve|lu|"
                            r"lu_solve|lu_unpack|qr|svd|svd_lowrank|pca_lowrank|geqrf|ormqr|triangular_solve|inverse|"
                            r"pinverse|det|logdet|slogdet|matrix_exp|cfloat|cdouble|chalf|view_as_complex|complex|polar|"
                            r"nonzero|unique|unique_consecutive|masked_select|argwhere)$)")


def kernel_compiler_op(name: str, outcomes: list) -> bool:
    """Whether an op counts in the kernel compiler's coverage (NOT_KERNEL_OPS)."""
    return not NOT_KERNEL_OPS.match(name) and not all(o in ("refused", "eager-error") for o in outcomes)


def summary(rows) -> dict:
    by_op: dict = {}
    for r in rows:
        by_op.setdefault((r["op"], r["variant"]), []).append(r["outcome"])
    ops = len(by_op)
    kernels = sum("kernels" in v for v in by_op.values())
    compiled = sum("kernels" in v or "no work" in v for v in by_op.values())
    mine = [v for (name, _), v in by_op.items() if kernel_compiler_op(name, v)]
    mine_compiled = sum("kernels" in v or "no work" in v for v in mine)
    return {"ops": ops, "samples": len(rows), "outcomes": dict(Counter(r["outcome"] for r in rows)),
            "ops_with_kernels": kernels, "ops_compiled": compiled,
            "coverage": round(compiled / ops, 3) if ops else None,
            "kernel_compiler_ops": len(mine), "kernel_compiler_ops_compiled": mine_compiled,
            "kernel_compiler_coverage": round(mine_compiled / len(mine), 3) if mine else None}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--ops", nargs="+")
    p.add_argument("--out")
    args = p.parse_args(argv)
    ops = [op for op in op_db() if not args.ops or op.name in args.ops]
    rows = sweep(ops, [getattr(torch, d) for d in args.dtypes], args.samples)
    s = summary(rows)
    print(s)
    if args.out:
        sys.path.insert(0, os.path.dirname(__file__))
        from common import save_results
        save_results(args.out, rows, summary=s)


if __name__ == "__main__":
    main()
