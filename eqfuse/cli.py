"""The ``eqfuse`` command: show, demo, rules."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import time

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _device():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _load_target(target: str):
    """An example name, or ``path/to/file.py:function`` (with the file's module, for its
    ``example_inputs``)."""
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
        return fn, module
    raise SystemExit(f"eqfuse: unknown example {target!r}; examples: {', '.join(EXAMPLES)}")


# --inputs' dtype names: the short ones torch users write, and torch's own
INPUT_DTYPES = {"f16": "float16", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "f32": "float32",
                "fp32": "float32", "float": "float32", "f64": "float64", "fp64": "float64", "double": "float64",
                "i64": "int64", "long": "int64", "i32": "int32", "int": "int32", "i16": "int16", "i8": "int8",
                "u8": "uint8", "bool": "bool"}
_INPUT = re.compile(r"\s*(?:(\w+)\s*:\s*)?(\w+)\s*\[([\d\s,]*)\]\s*(?:<\s*(\d+)\s*)?(,|$)")
INDEX_BOUND = 8  # integer inputs are drawn from [0, this) unless the spec gives "< N"


def parse_inputs(spec: str, device: str = "cpu") -> tuple:
    """Example inputs from ``--inputs``: comma-separated ``[name:] dtype[d0, d1, ...] [< N]``
    (``x: f16[4096, 4096], w: f16[4096], ids: i64[2, 128] < 50257``): floats drawn from a
    normal distribution, integers from [0, N) (N = 8 unless given: an index into a table
    wants the table's size), bools at random."""
    import torch
    inputs, pos = [], 0
    while pos < len(spec):
        m = _INPUT.match(spec, pos)
        if m is None:
            raise SystemExit(f"eqfuse: --inputs: cannot read {spec[pos:].strip()!r}; expected "
                             f"name: dtype[size, ...] (< N for integers), e.g. 'x: f16[4, 8], ids: i64[4] < 100'")
        name, dtype_name, sizes, bound, _ = m.groups()
        dtype = INPUT_DTYPES.get(dtype_name, dtype_name if dtype_name in INPUT_DTYPES.values() else None)
        if dtype is None:
            raise SystemExit(f"eqfuse: --inputs: unknown dtype {dtype_name!r} for {name or 'an input'}; "
                             f"known: {', '.join(sorted(INPUT_DTYPES))}")
        shape = tuple(int(d) for d in sizes.replace(",", " ").split())
        dtype = getattr(torch, dtype)
        if dtype == torch.bool:
            t = torch.rand(shape) < 0.5
        elif dtype.is_floating_point:
            t = torch.randn(shape, dtype=dtype)
        else:
            t = torch.randint(0, int(bound) if bound else INDEX_BOUND, shape, dtype=dtype)
        inputs.append(t.to(device))
        pos = m.end()
    if not inputs:
        raise SystemExit("eqfuse: --inputs: no input given")
    return tuple(inputs)


def _target_and_inputs(args):
    """(function, example inputs) for the ``target``, ``--inputs``, ``--shape`` and
    ``--dtype`` arguments."""
    import torch

    from .examples import Example
    target = _load_target(args.target)
    dtype = getattr(torch, DTYPES[args.dtype])
    if getattr(args, "inputs", None):
        return (target.fn if isinstance(target, Example) else target[0]), parse_inputs(args.inputs, _device())
    if isinstance(target, Example):
        shape = args.shape or target.demo_shape
        if len(shape) != len(target.demo_shape):
            raise SystemExit(f"eqfuse: {target.name} takes a shape of {len(target.demo_shape)} sizes")
        return target.fn, target.make_inputs(*shape, dtype, _device())
    target, module = target
    given = getattr(module, "example_inputs", None)
    if given is not None:  # the file's own: any shapes, dtypes and ranks
        inputs = given() if callable(given) else given
        inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        return target, tuple(x.to(_device()) if isinstance(x, torch.Tensor) else x for x in inputs)
    rows, cols = args.shape or (64, 1000)
    nargs = target.__code__.co_argcount
    return target, tuple(torch.randn(rows, cols, dtype=dtype, device=_device()) for _ in range(nargs))


def cmd_show(args) -> int:
    import eqfuse

    fn, inputs = _target_and_inputs(args)
    compiled = eqfuse.compile(fn, inputs)
    print(compiled.explain())
    print()
    print(compiled.source)
    return 0


def cmd_demo(args) -> int:
    import torch

    import eqfuse

    from .examples import ALL_EXAMPLES as EXAMPLES
    from .examples import ATTENTION_EXAMPLES, MATMUL_EXAMPLES, matches
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
    failures = calls = 0
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
        ok = matches(got, ref, contraction=ex.name in contractions, dtype=dtype)
        failures += not ok
        shape = "x".join(map(str, inputs[0].shape))
        calls += len(compiled.library_calls)
        kernels = str(len(compiled.kernels)) + (f"+{len(compiled.library_calls)}" if compiled.library_calls else "")
        line = (f"{ex.name:24s} {shape:>13s} {kernels:>7s} {len(compiled.fallbacks):>9d} "
                f"{err:>9.2e} {seconds:>9.2f}")
        if device == "cuda":
            import triton.testing
            te = triton.testing.do_bench(lambda: ex.fn(*inputs), return_mode="median") * 1e3
            tq = triton.testing.do_bench(lambda: compiled(*inputs), return_mode="median") * 1e3
            line += f" {te:>9.1f} {tq:>9.1f}"
        print(line + ("" if ok else "   MISMATCH"))
    if calls:
        print("\nkernels k+c: k generated kernels and c cuBLAS calls (plain products; option cublas=False)")
    print(f"\n{len(EXAMPLES) - failures}/{len(EXAMPLES)} examples match eager")
    return 1 if failures else 0


def cmd_inspect(args) -> int:
    import eqfuse

    fn, inputs = _target_and_inputs(args)
    compiled = eqfuse.compile(fn, inputs)
    out = args.out or f"eqfuse-inspect/{args.target.rsplit(':', 1)[-1]}"
    print(compiled.inspect(out, arch=args.arch))
    return 0


def cmd_export(args) -> int:
    import eqfuse
    from eqfuse.export import export_graph

    fn, inputs = _target_and_inputs(args)
    compiled = eqfuse.compile(fn, inputs, cublas=False)  # the exported runner launches kernels only
    out = args.out or f"eqfuse-export/{args.target.rsplit(':', 1)[-1]}"
    try:
        manifest = export_graph(compiled, out, arch=args.arch)
    except eqfuse.EqfuseError as e:
        raise SystemExit(f"eqfuse export: {e}") from None
    shapes = ", ".join("x".join(map(str, x.shape)) + f" {str(x.dtype).removeprefix('torch.')}" for x in inputs)
    print(f"exported {len(compiled.kernels)} kernel(s) of {args.target} for {args.arch}, inputs {shapes}: "
          f"{manifest}")
    print("run it without Triton: eqfuse.runtime.load_exported(" + repr(str(manifest.parent)) + ")(*inputs)")
    return 0


INPUTS_HELP = ("the inputs, comma-separated: [name:] dtype[sizes] [< N], e.g. "
               "'x: f16[4096, 4096], w: f16[4096], ids: i64[2, 128] < 50257' (integers drawn from [0, N), "
               f"N = {INDEX_BOUND} unless given); instead of --shape and a file's example_inputs")


def _add_target_arguments(parser, default_dtype="float32",
                          target_help="an example name or path/to/file.py:function") -> None:
    parser.add_argument("target", nargs="?", default="rmsnorm", help=target_help)
    parser.add_argument("--shape", type=int, nargs="+", default=None,
                        help="ROWS COLS (M N K for a matmul example); default: the example's own")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=default_dtype)
    parser.add_argument("--inputs", default=None, help=INPUTS_HELP)


def cmd_calibrate(args) -> int:
    from .errors import EqfuseError
    from .rewrite.cost import calibrations_path
    from .runtime.calibrate import calibrate
    try:
        calibrate()
    except EqfuseError as e:
        raise SystemExit(f"eqfuse calibrate: {e}") from None
    print(f"stored in {calibrations_path()}; the cost model uses it on this device from now on")
    return 0


def cmd_bench(args) -> int:
    from .bench import run
    try:
        result = run(tiny=args.tiny, out_dir=args.out, only=args.only, contenders=args.contenders,
                     chart=not args.no_chart, resume=args.resume)
    except ValueError as e:
        raise SystemExit(f"eqfuse bench: {e}") from None
    mismatched = [r["workload"] for r in result["results"]
                  if not all(c.get("matches_eager", True) for c in r["contenders"].values())]
    if mismatched:
        print(f"outputs differ from eager on: {', '.join(mismatched)}")
    return 1 if mismatched else 0


def cmd_rules(args) -> int:
    from .rewrite.rules import catalogue
    if args.action:
        return _rules_workbench(args)
    rows = catalogue()
    width = max(len(r[1]) for r in rows)
    for ruleset, name, text in rows:
        print(f"{ruleset:8s} {name:{width}s}  {text}")
    return 0


def _rules_workbench(args) -> int:
    """``rules try FILE`` / ``rules ablate NAME``: the workbench's table (eqfuse/workbench.py)."""
    from . import workbench
    from .rewrite.rules import RULESET_NAMES, rule_text
    from .runtime.compiled import Options

    if not args.target:
        raise SystemExit(f"eqfuse rules {args.action}: name the {'file' if args.action == 'try' else 'rule'}")
    if args.action == "try":
        extra = workbench.load_rules(args.target)
        for rule in extra:
            print(f"rule {rule.name}: {rule_text(rule)}")
        variant, watched = (*RULESET_NAMES, *extra), [r.name for r in extra]
    else:
        variant, watched = (*RULESET_NAMES, f"-{args.target}"), [args.target]
    Options(rules=variant)  # the soundness check and the names, before any compile
    print("sound on random and special values; compiling each workload with the built-in rules, then with "
          + ("these added" if args.action == "try" else f"{args.target} left out"))
    zoo = [f for f in (args.zoo or "").split(",") if f]
    rows = workbench.compare(variant, only=args.only, zoo_families=zoo,
                             progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(workbench.format_rows(rows, watched))
    return 1 if any(not r["variant"].matches for r in rows) else 0


class _Version(argparse.Action):
    """``--version``: eqfuse's version and those of the packages it compiles with (what a
    bug report needs), looked up only when asked for."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="show the versions of eqfuse, torch, Triton and egglog")

    def __call__(self, parser, namespace, values, option_string=None):
        from .runtime.compiled import VERSION
        from .runtime.plan_cache import installed_version

        found = {p: installed_version(p) or "not installed" for p in ("torch", "triton", "egglog")}
        print(f"eqfuse {VERSION} ({', '.join(f'{p} {v}' for p, v in found.items())})")  # stdout, as argparse's
        parser.exit()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="eqfuse", description="equality-saturation kernel compiler for PyTorch")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("show", help="plan, report and Triton source for an example or file.py:function")
    _add_target_arguments(s, target_help="an example name, or path/to/file.py:function (its inputs: --inputs, "
                                          "the file's example_inputs, a tuple or a function returning one; "
                                          "else --shape floats)")
    s.set_defaults(fn=cmd_show)
    d = sub.add_parser("demo", help="compile the examples, check them against eager, print a table")
    d.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    d.set_defaults(fn=cmd_demo)
    r = sub.add_parser("rules", help="the rule catalogue; 'rules try FILE.py' and 'rules ablate NAME': what a "
                                     "rule of one's own, or a built-in one left out, changes")
    r.add_argument("action", nargs="?", choices=["try", "ablate"], help="try: the RULES of a file of your own; "
                                                                        "ablate: a built-in rule left out")
    r.add_argument("target", nargs="?", help="the file (try) or the rule's name (ablate)")
    r.add_argument("--only", nargs="+", default=None, help="examples whose name contains any of these")
    r.add_argument("--zoo", default="", help="zoo families too, comma-separated (tiny models, inference)")
    r.set_defaults(fn=cmd_rules)
    i = sub.add_parser("inspect", help="each kernel's Triton source and compiler stages (TTIR ... PTX, SASS) "
                                       "written to a directory, with registers, spills, shared memory")
    _add_target_arguments(i)
    i.add_argument("--out", default=None, help="directory (default: eqfuse-inspect/TARGET)")
    i.add_argument("--arch", default=None, help="compile for this GPU, e.g. sm_90 (default: this GPU; "
                                                 "sm_90 without one)")
    i.set_defaults(fn=cmd_inspect)
    x = sub.add_parser("export", help="kernels as cubin + PTX and a JSON manifest, to run without Triton "
                                      "(eqfuse.runtime.load_exported)")
    _add_target_arguments(x)
    x.add_argument("--arch", default="sm_90", help="GPU architecture to compile for (default sm_90)")
    x.add_argument("--out", default=None, help="directory (default: eqfuse-export/TARGET)")
    x.set_defaults(fn=cmd_export)
    c = sub.add_parser("calibrate", help="measure this GPU (copy bandwidth, launch cost, matmul throughput) "
                                         "for the cost model")
    c.set_defaults(fn=cmd_calibrate)
    b = sub.add_parser("bench", help="the benchmark suite: eqfuse vs eager vs torch.compile, a table, "
                                     "JSON and a PNG chart")
    b.add_argument("--tiny", action="store_true", help="a few elements per workload (on the CPU: the interpreter)")
    b.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the chart "
                                                               "(default: benchmarks/results)")
    b.add_argument("--only", nargs="+", default=None, help="workloads whose name contains any of these")
    b.add_argument("--contenders", nargs="+", choices=["torch.compile", "eqfuse"], default=None,
                   help="besides eager (default: both on a GPU, eqfuse alone on the CPU)")
    b.add_argument("--no-chart", action="store_true", help="no PNG chart")
    b.add_argument("--resume", action="store_true", help="keep the workloads today's JSON in --out already has "
                                                         "(a run cut short goes on where it stopped)")
    b.set_defaults(fn=cmd_bench)
    args = p.parse_args(argv)
    from .errors import EqfuseError

    try:
        return args.fn(args)
    except EqfuseError as e:  # the user's function or input: one line, not eqfuse's traceback
        print(f"eqfuse {args.cmd}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
