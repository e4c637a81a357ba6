"""The ``eqfuse`` command: show, demo, rules."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _device():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _load_target(target: str):
    """An example name, or ``path/to/file.py:function``."""
    from .examples import ALL_EXAMPLES as EXAMPLES
    if target in EXAMPLES:
        return EXAMPLES[target]
    if ":" in target:
        path, name = target.rsplit(":", 1)
        spec = importlib.util.spec_from_file_location("eqfuse_user_module", path)
        if spec is None:
            raise SystemExit(f"eqfuse: cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, name, None)
        if fn is None:
            raise SystemExit(f"eqfuse: {path} has no function {name!r}")
        return fn
    raise SystemExit(f"eqfuse: unknown example {target!r}; examples: {', '.join(EXAMPLES)}")


def cmd_show(args) -> int:
    import torch

    import eqfuse

    from .examples import Example
    target = _load_target(args.target)
    dtype = getattr(torch, DTYPES[args.dtype])
    if isinstance(target, Example):
        shape = args.shape or target.demo_shape
        if len(shape) != len(target.demo_shape):
            raise SystemExit(f"eqfuse: {target.name} takes a shape of {len(target.demo_shape)} sizes")
        fn, inputs = target.fn, target.make_inputs(*shape, dtype, _device())
    else:
        rows, cols = args.shape or (64, 1000)
        fn = target
        nargs = fn.__code__.co_argcount
        inputs = tuple(torch.randn(rows, cols, dtype=dtype, device=_device()) for _ in range(nargs))
    compiled = eqfuse.compile(fn, inputs)
    print(compiled.explain())
    print()
    print(compiled.source)
    return 0


def cmd_demo(args) -> int:
    import torch

    import eqfuse

    from .examples import ALL_EXAMPLES as EXAMPLES
    from .examples import ATTENTION_EXAMPLES, MATMUL_EXAMPLES, contraction_tolerance, tolerance
    contractions = {**MATMUL_EXAMPLES, **ATTENTION_EXAMPLES}
    device = _device()
    dtype = getattr(torch, DTYPES[args.dtype])
    print(f"eqfuse {eqfuse.__version__} demo on {device}"
          + (" (Triton interpreter)" if device == "cpu" else f" ({torch.cuda.get_device_name()})"))
    header = f"{'example':24s} {'shape':>13s} {'kernels':>7s} {'fallbacks':>9s} {'max err':>9s} {'compile s':>9s}"
    if device == "cuda":
        header += f" {'eager us':>9s} {'eqfuse us':>9s}"
    print(header)
    print("-" * len(header))
    failures = 0
    for ex in EXAMPLES.values():
        torch.manual_seed(0)
        inputs = ex.make_inputs(*ex.demo_shape, dtype, device)
        t0 = time.perf_counter()
        compiled = eqfuse.compile(ex.fn, inputs)
        seconds = time.perf_counter() - t0
        got, ref = compiled(*inputs), ex.fn(*inputs)
        got = got if isinstance(got, tuple) else (got,)
        ref = ref if isinstance(ref, tuple) else (ref,)
        err = max((g.float() - r.float()).abs().nan_to_num().max().item() for g, r in zip(got, ref))
        ok = True
        for g, r in zip(got, ref):
            rtol, atol = contraction_tolerance(dtype, r) if ex.name in contractions else tolerance(dtype)
            ok &= torch.allclose(g.float(), r.float(), rtol=rtol, atol=atol, equal_nan=True)
        failures += not ok
        shape = "x".join(map(str, inputs[0].shape))
        line = (f"{ex.name:24s} {shape:>13s} {len(compiled.kernels):>7d} {len(compiled.fallbacks):>9d} "
                f"{err:>9.2e} {seconds:>9.2f}")
        if device == "cuda":
            import triton.testing
            te = triton.testing.do_bench(lambda: ex.fn(*inputs), return_mode="median") * 1e3
            tq = triton.testing.do_bench(lambda: compiled(*inputs), return_mode="median") * 1e3
            line += f" {te:>9.1f} {tq:>9.1f}"
        print(line + ("" if ok else "   MISMATCH"))
    print(f"\n{len(EXAMPLES) - failures}/{len(EXAMPLES)} examples match eager")
    return 1 if failures else 0


def cmd_rules(args) -> int:
    from .rewrite.rules import catalogue
    rows = catalogue()
    width = max(len(r[1]) for r in rows)
    for ruleset, name, text in rows:
        print(f"{ruleset:8s} {name:{width}s}  {text}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="eqfuse", description="equality-saturation kernel compiler for PyTorch")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("show", help="plan, report and Triton source for an example or file.py:function")
    s.add_argument("target", nargs="?", default="rmsnorm")
    s.add_argument("--shape", type=int, nargs="+", default=None,
                   help="ROWS COLS (M N K for a matmul example); default: the example's own")
    s.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    s.set_defaults(fn=cmd_show)
    d = sub.add_parser("demo", help="compile the examples, check them against eager, print a table")
    d.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    d.set_defaults(fn=cmd_demo)
    r = sub.add_parser("rules", help="the rule catalogue")
    r.set_defaults(fn=cmd_rules)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
