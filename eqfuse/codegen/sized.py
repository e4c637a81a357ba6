"""A sized module: one generated module for every size of a graph's dynamic dimension.

eqfuse's plans are made for the sizes they were traced at. A graph whose dimension dynamo
marked dynamic (a batch, a sequence) gets two plans, at sizes n and n + 1 of that
dimension, generated with the same kernel configurations. Where the two modules differ
only in numbers proportional to the size (``c * n`` against ``c * (n + 1)``: a buffer's
extent, a stride, a kernel's row count), they are one module, written for the size
``SIZE`` read from an input at each call. Its kernels take those sizes as runtime
arguments (``RUNTIME_SIZES``: the axes programs are laid out along, masked at every size)
and its buffers, views and grids are computed from ``SIZE``. Anything else that differs
(a kernel's text, a number not proportional to the size, a kernel's configuration, a
different plan) and there is no sized module: ``NotSized`` says where, and the graph is
compiled for each size instead.

Why two consecutive sizes: a choice made from a size that comes out the same at n and
n + 1 for ``c * n`` comes out the same at every size (both dividing evenly by a block
means c does), and what two sizes cannot show (whether 32-bit indices suffice) is a
bound on the size, ``max_size``.
"""

from __future__ import annotations

import io
import tokenize
from dataclasses import dataclass

from ..export import grid_formula, grid_sizes
from ..schema.plan import FallbackStep, Plan
from . import kernel as kgen
from .module import KernelInfo, assemble, call_lines, kernel_info, launch_options, prepare

SIZE = "SIZE"


class NotSized(Exception):
    """The two plans are not one plan at two sizes: why, in a line."""


@dataclass
class SizedModule:
    source: str
    infos: list  # KernelInfo at the size the module was made at
    size_input: tuple  # (input position, dimension) that SIZE is read from
    max_size: int  # the largest size whose buffers 32-bit indices reach
    inputs: list  # per input: ((shape, strides) at size 0, (shape, strides) per unit of size)

    def input_layouts(self, size: int) -> list:
        """Each input's (shape, strides) at ``size``, as the module expects them."""
        return [tuple(tuple(a + c * size for a, c in zip(fixed, per)) for fixed, per in zip(base, step))
                for base, step in self.inputs]


def per_size(a: int, b: int, n: int, what: str) -> int:
    """``c`` where ``a`` and ``b`` are ``c * n`` and ``c * (n + 1)``; 0 where they are equal."""
    if a == b:
        return 0
    c = b - a
    if c > 0 and a == c * n:
        return c
    raise NotSized(f"{what} is {a} at size {n} and {b} at size {n + 1}, not proportional to the size")


def sized_module(plan_a: Plan, plan_b: Plan, n: int, title: str, version: str, configs: dict) -> SizedModule:
    """The module for every size, from ``plan_a`` at size ``n`` and ``plan_b`` at ``n + 1``
    (both rewritten by code generation's ``prepare``). Raises NotSized."""
    for plan in (plan_a, plan_b):
        prepare(plan)
        steps = [s for s in plan.steps if isinstance(s, FallbackStep)]
        if steps:
            raise NotSized(f"an eager step ({steps[0].node}) runs with the sizes it was traced at")
    kernels_a, kernels_b = plan_a.kernels, plan_b.kernels
    if [k.name for k in kernels_a] != [k.name for k in kernels_b]:
        raise NotSized(f"the plans differ: kernels {[k.name for k in kernels_a]} at size {n}, "
                       f"{[k.name for k in kernels_b]} at size {n + 1}")
    runtime = {}
    for ka, kb in zip(kernels_a, kernels_b):
        # Compared with every size the kernel could take at launch masked, as it will be
        # where that size follows the dynamic one
        cfg, may = configs.get(ka.name), _launchable(ka)
        a, b = kernel_info(ka, plan_a.buffers, cfg, may), kernel_info(kb, plan_b.buffers, cfg, may)
        runtime[ka.name] = _runtime_sizes(a, b, n, may)
    # The kernels as they will run: the sizes that follow the dynamic one taken at launch
    # (a batch, B0 ..., is the grid's only: the kernel never sees it)
    infos = [kernel_info(k, plan_a.buffers, configs.get(k.name), frozenset(runtime[k.name]) & _launchable(k))
             for k in kernels_a]
    if plan_a.buffers.keys() != plan_b.buffers.keys():
        raise NotSized(f"the plans differ: other buffers at size {n + 1} than at {n}")
    largest = max(per_size(b.numel, plan_b.buffers[name].numel, n, f"buffer {name}'s element count")
                  for name, b in plan_a.buffers.items())
    formulas = {}
    for info in infos:
        for k in (info, info.fallback) if info.fallback is not None else (info,):
            formulas[k.name] = grid_formula(k)
            if formulas[k.name] is None:
                raise NotSized(f"kernel {k.name}: its grid is not a formula over its sizes")
    inputs = _inputs(plan_a, plan_b, n)
    size_input = next(((i, d) for i, (_, (shape, _)) in enumerate(inputs) for d, c in enumerate(shape) if c == 1),
                      None)
    if size_input is None:
        raise NotSized("no input has the dynamic size as a dimension of its own")
    body_a, rets_a = call_lines(plan_a, infos, SIZE)
    body_b, rets_b = call_lines(plan_b, infos, SIZE)
    body = _merged(body_a, body_b, n)
    rets = _merged(rets_a, rets_b, n)
    arg, dim = plan_a.inputs[size_input[0]].name, size_input[1]
    body.insert(0, f"{SIZE} = {arg}.shape[{dim}]")
    scales = {info.name: runtime[info.name] for info in infos}
    scales.update({info.fallback.name: runtime[info.name] for info in infos if info.fallback is not None})

    def launcher_line(info: KernelInfo) -> str:
        sizes = {**info.constexprs, **grid_sizes(info)}
        return (f"{info.name}_launch = SizedLauncher({info.name}, {formulas[info.name]!r}, {sizes!r}, "
                f"{scales[info.name]!r}, {tuple(info.constexprs)!r}, {launch_options(info)})")

    source = assemble(f"{title} (sized: every size of one dimension)", version, infos, launcher_line,
                      [b.name for b in plan_a.inputs], body, rets, launcher="SizedLauncher")
    return SizedModule(source, infos, size_input, (2**31 - 1) // max(largest, 1), inputs)


def _launchable(spec) -> frozenset:
    """The sizes of the kernel it could take at launch (kernel.RUNTIME_SIZES)."""
    sched = kgen.schedule_of(spec)
    if sched.kind == "pointwise" and sched.inner:  # its 2-D tiling divides the size by X
        return frozenset()
    return frozenset(kgen.RUNTIME_SIZES.get(sched.kind, ()))


def _runtime_sizes(a: KernelInfo, b: KernelInfo, n: int, may: frozenset) -> dict:
    """The kernel's sizes that follow the dynamic dimension (name -> per unit of size), of
    the kernel at ``n`` (``a``) and at ``n + 1`` (``b``); NotSized where the kernel
    differs otherwise."""
    if a.source != b.source or a.launch != b.launch or (a.fallback is None) != (b.fallback is None) or \
            (a.fallback is not None and a.fallback.source != b.fallback.source):
        raise NotSized(f"kernel {a.name} is written otherwise at size {n + 1} than at {n}")
    sizes_a, sizes_b = grid_sizes(a), grid_sizes(b)
    if sizes_a.keys() != sizes_b.keys():
        raise NotSized(f"kernel {a.name} has other sizes at size {n + 1} than at {n}")
    scaled = {}
    for name, va in sizes_a.items():
        c = per_size(va, sizes_b[name], n, f"kernel {a.name}'s {name}")
        if c and not (name in may or name.startswith("B") and name[1:].isdigit()):
            raise NotSized(f"kernel {a.name} ({a.schedule.describe()}): {name} follows the dynamic size, "
                           "which it cannot take at launch")
        if c:
            scaled[name] = c
    return scaled


def _inputs(plan_a: Plan, plan_b: Plan, n: int) -> list:
    """Each input's (shape, strides) at size 0 and per unit of size."""
    out = []
    for a, b in zip(plan_a.inputs, plan_b.inputs):
        if len(a.shape) != len(b.shape):
            raise NotSized(f"input {a.name} has another rank at size {n + 1}")
        pairs = list(zip(tuple(a.shape) + tuple(a.layout), tuple(b.shape) + tuple(b.layout)))
        per = [per_size(x, y, n, f"input {a.name}'s shape and strides") for x, y in pairs]
        fixed = [x - c * n for (x, _), c in zip(pairs, per)]
        r = len(a.shape)
        out.append(((tuple(fixed[:r]), tuple(fixed[r:])), (tuple(per[:r]), tuple(per[r:]))))
    return out


def _merged(lines_a: list, lines_b: list, n: int) -> list:
    """``lines_a`` with each number that differs in ``lines_b`` written as a multiple of
    SIZE. The lines must differ in nothing else."""
    if len(lines_a) != len(lines_b):
        raise NotSized(f"the module runs {len(lines_a)} steps at size {n} and {len(lines_b)} at {n + 1}")
    out = []
    for la, lb in zip(lines_a, lines_b):
        ta, tb = _tokens(la), _tokens(lb)
        if [t.type for t in ta] != [t.type for t in tb] or \
                any(x.string != y.string for x, y in zip(ta, tb) if x.type != tokenize.NUMBER):
            raise NotSized(f"the module differs at size {n + 1} in more than sizes: {la!r} against {lb!r}")
        line = la
        for x, y in reversed(list(zip(ta, tb))):
            if x.string != y.string:
                if not (x.string.isdigit() and y.string.isdigit()):
                    raise NotSized(f"{x.string} at size {n} is {y.string} at {n + 1} in {la!r}")
                c = per_size(int(x.string), int(y.string), n, f"{x.string!r} in {la!r}")
                text = SIZE if c == 1 else f"{c} * {SIZE}"
                line = line[:x.start[1]] + f"({text})" + line[x.end[1]:]
        out.append(line)
    return out


def _tokens(line: str) -> list:
    return [t for t in tokenize.generate_tokens(io.StringIO(line).readline)
            if t.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER)]
