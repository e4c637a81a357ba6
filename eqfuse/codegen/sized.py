"""A sized module: one generated module for every size of a graph's dynamic dimension.

eqfuse's plans are made for the sizes they were traced at. A graph whose dimension dynamo
marked dynamic (a batch, a sequence) gets plans at three sizes of that dimension, n,
n + 1 and a far one (or n + 2, where the plan at the far size fuses otherwise), generated
with the same kernel configurations. Where the modules
differ only in numbers that follow the size (``k + c * n`` against ``k + c * (n + 1)``: a
buffer's extent, a stride, a kernel's row count, a divisor that splits a row index into
sequence and batch; k is not 0 where a decoder's cache of length n gains the new token),
they are one module, written for the size ``SIZE`` read from an input at each call.
Eager steps run in it where they take the same arguments at every size (whole buffers:
torch sizes their results). Its kernels take the sizes of the axes their programs are laid out along at
launch (``RUNTIME_SIZES``, masked at every size), and ``SIZE`` itself where a number in
their text follows it; buffers, views and grids are computed from ``SIZE``. Anything else
that differs (a kernel's text, a number not proportional to the size, a kernel's
configuration, a different plan) and there is no sized module: ``NotSized`` says where, and
the graph is compiled for each size instead.

Why these sizes: a choice made from ``k + c * n`` that comes out the same at n and n + 1
comes out the same at every size (both dividing evenly by a block means c and k do). But code
generation also looks at values (which keys a causal mask leaves a row, whether an index
below the size divided by 64 is 0), and what such an analysis finds at n and n + 1 may hold
there only: the far size (``far_size``) is where it would show, and n + 2 where a number
changes every other size (``s // 2``). A threshold beyond all three (a sliding window
wider than the sizes seen) cannot show; an attention kernel whose mask compares indices
with a number that large is not sized. What sizes cannot show at all (whether 32-bit
indices suffice, whether a grid that grows with the size stays within CUDA's limits) is a
bound on the size, ``max_size``.
"""

from __future__ import annotations

import io
import tokenize
from dataclasses import dataclass, replace

from ..export import evaluate_grid_formula, grid_formula, grid_sizes
from ..runtime.launch import at_size
from ..schema import ops
from ..schema.plan import Plan
from . import schedules, tiles
from .configs import default_config, fits
from .module import KernelInfo, assemble, call_lines, kernel_info, launch_options, prepare

SIZE = "SIZE"


class NotSized(Exception):
    """The plans are not one plan at several sizes: why, in a line."""


class PlansDiffer(NotSized):
    """The plans launch other kernels or keep other buffers at two of the sizes: the cost
    model chose otherwise at one of them."""


@dataclass
class SizedModule:
    source: str
    infos: list  # KernelInfo at the size the module was made at
    size_input: tuple  # (input position, dimension) that SIZE is read from
    max_size: int  # the largest size whose buffers 32-bit indices reach and whose grids CUDA takes
    inputs: list  # per input: ((shape, strides) at size 0, (shape, strides) per unit of size)
    fallbacks: list  # the eager steps (FallbackStep), the same at every size
    size_offset: int = 0  # the size input's dimension is SIZE plus this

    def input_layouts(self, size: int) -> list:
        """Each input's (shape, strides) at ``size``, as the module expects them."""
        return [tuple(tuple(a + c * size for a, c in zip(fixed, per)) for fixed, per in zip(base, step))
                for base, step in self.inputs]


def far_size(n: int) -> int:
    """The third size a sized module is checked at: past twice n, odd."""
    return 2 * n + 3


def per_size(a: int, b: int, n: int, what: str, m: int | None = None) -> tuple[int, int]:
    """``(c, k)`` where ``a`` and ``b`` are ``k + c * n`` and ``k + c * m`` (m defaults to
    n + 1), c a whole number, positive or 0 (``a`` equal to ``b``): a length that follows the
    size, or the size plus one (a decoder's cache and the cache with the new token)."""
    m = n + 1 if m is None else m
    if a == b:
        return 0, a
    c, rest = divmod(b - a, m - n)
    if c > 0 and not rest:
        return c, a - c * n
    raise NotSized(f"{what} is {a} at size {n} and {b} at size {m}, not a multiple of the size plus a constant")


def size_text(c: int, k: int) -> str:
    """``k + c * SIZE`` as the module writes it."""
    text = SIZE if c == 1 else f"{c} * {SIZE}"
    return text if k == 0 else f"{text} + {k}" if k > 0 else f"{text} - {-k}"


# The sizes, in units of the size a sized module is made at, whose modelled times choose a
# matmul's tiles: the module runs every size, and tiles the model ranks first at one (a
# 128 x 64 tile at 2560 rows) ran a Llama layer's output projection at 8192 rows in 183 us
# on an H100, against 115 for the tiles chosen there
SIZES_AHEAD = (0.5, 1, 2, 4, 8)


def sized_module(samples: list, title: str, version: str, configs: dict, complete=None,
                 library: bool = False) -> SizedModule:
    """The module for every size, from ``samples``: (size, plan) pairs, the first the
    size the module is made at, each other one compared with it; all must give the same
    module. ``configs``: kernel name -> configuration (the first build's), kept for the
    kernels whose sizes do not follow the dynamic one; a matmul whose sizes do takes the
    tiles best across sizes (``across_sizes``). ``complete(size, plan, configs)``:
    ``configs`` with one for each other kernel of the plan at the first size (on a GPU,
    the first that launches); by default the tile model's first choice there. The plans are
    rewritten by code generation's ``prepare`` (``library``: plain products as cuBLAS
    calls, their views' sizes written over SIZE as the buffers' are). Raises NotSized."""
    for _, plan in samples:
        prepare(plan, library)
        _whole_buffers(plan)
    (n, plan_a), *others = samples
    for m, plan_x in others:
        _same_eager_steps(plan_a, plan_x, m)
    for m, plan_x in others:  # before configurations are completed: that may launch kernels
        _same_plan(plan_a, plan_x, n, m)
    configs = sized_configs(samples, configs)
    if complete is not None:
        configs = complete(n, plan_a, configs)
    configs = {**{k.name: default_config(schedules.schedule_of(k)) for k in plan_a.kernels if k.name not in configs},
               **configs}
    configs = _fitting(configs, [plan for _, plan in samples])
    made = [_merged_module(plan_a, plan_x, n, m, title, version, configs) for m, plan_x in others]
    for (m, _), module in zip(others[1:], made[1:]):
        if module.source != made[0].source:
            raise NotSized(f"the module made from sizes {n} and {m} is not the one made from {n} and {others[0][0]}: "
                           f"{_first_difference(made[0].source, module.source)}")
    return made[0]


def _same_eager_steps(plan_a: Plan, plan_x: Plan, m: int) -> None:
    """Eager steps run at every size where they take the same arguments at each sample
    (whole buffers, literals that do not follow the size: an embedding of the new token,
    an attention over the whole cache): torch sizes their outputs from their inputs. One
    that reads a view written with the size's numbers, or takes a size, runs as traced."""
    steps_a, steps_x = plan_a.fallbacks, plan_x.fallbacks
    if [s.node for s in steps_a] != [s.node for s in steps_x]:
        raise PlansDiffer(f"the eager steps differ at size {m}")
    for a, x in zip(steps_a, steps_x):
        try:  # the whole of each: a step's target may hold layouts (from_fx.EagerCall) that follow the size
            same = bool((a.target, a.args, a.kwargs, a.outputs) == (x.target, x.args, x.kwargs, x.outputs))
        except Exception:  # noqa: BLE001 - a value with no plain equality (a tensor): not the same
            same = False
        if not same:
            raise NotSized(f"an eager step ({a.node}) takes arguments or lays out results as the size does")


def _whole_buffers(plan: Plan) -> None:
    """The plan's eager steps given each view of a whole buffer they read (a token-id input
    as it is) as the buffer: a view spells the size out, the buffer follows it."""
    from ..schema.plan import BufArg
    from ..schema.values import BufRef

    layouts = {b.name: (tuple(b.shape), tuple(b.layout)) for b in [*plan.inputs, *plan.buffers.values()]}

    def whole(a):
        if isinstance(a, BufRef) and a.offset == 0 and layouts.get(a.buf) == (tuple(a.shape), tuple(a.strides)):
            return BufArg(a.buf)
        if isinstance(a, (list, tuple)):
            return type(a)(whole(x) for x in a)
        if isinstance(a, dict):
            return {k: whole(v) for k, v in a.items()}
        return a
    for step in plan.fallbacks:
        step.args, step.kwargs = whole(step.args), whole(step.kwargs)


def sized_configs(samples: list, first: dict) -> dict:
    """Kernel name -> configuration, for the prepared plans in ``samples``: a matmul whose
    sizes follow the dynamic one, the tiles best across sizes; another kernel, the first
    build's configuration where it had the kernel (the name), else none."""
    (n, plan_a), (m, plan_b), *_ = samples
    out = {}
    for ka, kb in zip(plan_a.kernels, plan_b.kernels):  # the same kernels (_same_plan)
        sa, sb = schedules.schedule_of(ka), schedules.schedule_of(kb)
        if sa.kind == sb.kind == "matmul" and sa != sb:
            out[ka.name] = across_sizes(sa, sb, n, m)
        elif ka.name in first:
            out[ka.name] = first[ka.name]
    return out


def across_sizes(sa, sb, n: int, m: int) -> dict:
    """The tiles of a matmul (schedule ``sa`` at size ``n``, ``sb`` at ``m``) whose modelled
    time is closest to the best tiles' at every size of SIZES_AHEAD: the least of each
    candidate's worst ratio to the best there (ties: the model's order at n)."""
    scheds = [_schedule_at(sa, sb, n, m, max(1, round(f * n))) for f in SIZES_AHEAD]
    ranked = tiles.ranked(sa)
    candidates = [c for c in ranked if fits(sb, c)] or ranked
    times = [[tiles.modelled_time_us(s, c) for s in scheds] for c in candidates]
    best = [min(t[i] for t in times) for i in range(len(scheds))]
    worst = [max(t[i] / best[i] for i in range(len(scheds))) for t in times]
    return candidates[worst.index(min(worst))]


def _schedule_at(sa, sb, n: int, m: int, size: int):
    """The matmul's schedule at ``size``: each extent that follows the size (c * n at n,
    c * m at m) taken at ``size``."""
    def at(a, b):
        return max(1, a + (b - a) * (size - n) // (m - n))
    return replace(sa, m=at(sa.m, sb.m), n=at(sa.n, sb.n), k=at(sa.k, sb.k),
                   batch=tuple(at(x, y) for x, y in zip(sa.batch, sb.batch)))


def _fitting(configs: dict, plans: list) -> dict:
    """The configurations each kernel runs with at every size: the first build's, or, where
    its TMA form fits one size only (a descriptor needs strides of 16 bytes), the same
    tiles one program per tile."""
    out = dict(configs)
    for name, cfg in configs.items():
        scheds = [schedules.schedule_of(k) for plan in plans for k in plan.kernels if k.name == name]
        plain = {k: v for k, v in cfg.items() if k != "PROGRAMS"}
        if plain != cfg and not all(fits(s, cfg) for s in scheds) and all(fits(s, plain) for s in scheds):
            out[name] = plain
    return out


def _merged_module(plan_a: Plan, plan_b: Plan, n: int, m: int, title: str, version: str,
                   configs: dict) -> SizedModule:
    """The module for every size from the plans at sizes ``n`` and ``m``."""
    _same_plan(plan_a, plan_b, n, m)
    infos, scales = [], {}
    for ka, kb in zip(plan_a.kernels, plan_b.kernels):
        cfg = configs.get(ka.name)
        # The sizes that follow the dynamic one, from the kernel as the tile model writes it
        scaled = _runtime_sizes(kernel_info(ka, plan_a.buffers, cfg), kernel_info(kb, plan_b.buffers, cfg), n, m,
                                _launchable(ka))
        # The kernels as they will run: those sizes taken at launch, masked at every size (a
        # batch, B0 ..., is the grid's only: the kernel never sees it)
        runtime = frozenset(scaled) & _launchable(ka)
        a = kernel_info(ka, plan_a.buffers, cfg, runtime)
        b = kernel_info(kb, plan_b.buffers, cfg, runtime)
        if a.launch != b.launch or (a.fallback is None) != (b.fallback is None):
            raise NotSized(f"kernel {a.name} is configured otherwise at size {m} than at {n}")
        for x, y in ((a, b), (a.fallback, b.fallback)) if a.fallback is not None else ((a, b),):
            x.source, takes_size = _merged_kernel(x, y, n, m)
            scales[x.name] = {**scaled, SIZE: 1} if takes_size else scaled
        if runtime & {"M", "N"} and a.schedule.kind == "attention":
            _check_band(ka, n)
        infos.append(a)
    max_size = 2**31 - 1  # buffers whose elements 32-bit indices reach
    for name, b in plan_a.buffers.items():
        c, k = per_size(b.numel, plan_b.buffers[name].numel, n, f"buffer {name}'s element count", m)
        if c:
            max_size = min(max_size, (2**31 - 1 - k) // c)
    formulas = {}
    for info in infos:
        for k in (info, info.fallback) if info.fallback is not None else (info,):
            formulas[k.name] = grid_formula(k)
            if formulas[k.name] is None:
                raise NotSized(f"kernel {k.name}: its grid is not a formula over its sizes")
            max_size = _grid_bound(formulas[k.name], {**k.constexprs, **grid_sizes(k)}, scales[k.name], max_size)
    inputs = _inputs(plan_a, plan_b, n, m)
    ones = sorted((abs(fixed[d]), i, d) for i, ((fixed, _), (shape, _)) in enumerate(inputs)
                  for d, c in enumerate(shape) if c == 1)  # the size itself first, then the size plus k
    if not ones:
        raise NotSized("no input has the dynamic size as a dimension of its own")
    _, *size_input = ones[0]
    size_offset = inputs[size_input[0]][0][0][size_input[1]]
    body_a, rets_a = call_lines(plan_a, infos, SIZE)
    body_b, rets_b = call_lines(plan_b, infos, SIZE)
    body = _merged(body_a, body_b, n, m)
    rets = _merged(rets_a, rets_b, n, m)
    arg, dim = plan_a.inputs[size_input[0]].name, size_input[1]
    body.insert(0, f"{SIZE} = {arg}.shape[{dim}]" + (f" - {size_offset}" if size_offset else ""))

    def launcher_line(info: KernelInfo) -> str:
        sizes = {**info.constexprs, **grid_sizes(info)}
        args = tuple(info.constexprs)
        if SIZE in scales[info.name]:
            sizes[SIZE], args = n, args + (SIZE,)
        return (f"{info.name}_launch = SizedLauncher({info.name}, {formulas[info.name]!r}, {sizes!r}, "
                f"{scales[info.name]!r}, {args!r}, {launch_options(info)})")

    source = assemble(f"{title} (sized: every size of one dimension)", version, infos, launcher_line,
                      [b.name for b in plan_a.inputs], body, rets, launcher="SizedLauncher")
    return SizedModule(source, infos, tuple(size_input), max_size, inputs, plan_a.fallbacks, size_offset)


GRID_LIMITS = (2**31 - 1, 65535, 65535)  # CUDA's, per grid dimension


def _grid_bound(formula: list, sizes: dict, per_size: dict, upto: int) -> int:
    """The largest size up to ``upto`` whose grid stays within GRID_LIMITS (an attention's
    second dimension, batch x heads, grows with a dynamic batch): grids grow with the
    size, so the sizes that fit are those up to a bound, found by bisection."""
    def fits(size):
        grid = evaluate_grid_formula(formula, {**sizes, **{k: at_size(rule, size) for k, rule in per_size.items()}})
        return all(g <= limit for g, limit in zip(grid, GRID_LIMITS))
    if fits(upto):
        return upto
    lo, hi = 0, upto  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _same_plan(plan_a: Plan, plan_b: Plan, n: int, m: int) -> None:
    for what, steps in (("kernels", lambda p: p.kernels), ("cuBLAS calls", lambda p: p.library_calls)):
        names_a, names_b = [k.name for k in steps(plan_a)], [k.name for k in steps(plan_b)]
        if names_a != names_b:
            raise PlansDiffer(f"the plans differ: {what} {names_a} at size {n}, {names_b} at size {m}")
    if plan_a.buffers.keys() != plan_b.buffers.keys():
        raise PlansDiffer(f"the plans differ: other buffers at size {m} than at {n}")


def _launchable(spec) -> frozenset:
    """The sizes of the kernel it could take at launch (kernel.RUNTIME_SIZES)."""
    return frozenset(schedules.RUNTIME_SIZES.get(schedules.schedule_of(spec).kind, ()))


def _runtime_sizes(a: KernelInfo, b: KernelInfo, n: int, m: int, may: frozenset) -> dict:
    """The kernel's sizes that follow the dynamic dimension (name -> (per unit of size, constant)), of
    the kernel at ``n`` (``a``) and at ``m`` (``b``); NotSized where one of them is a size
    the kernel cannot take at launch."""
    sizes_a, sizes_b = grid_sizes(a), grid_sizes(b)
    if sizes_a.keys() != sizes_b.keys():
        raise NotSized(f"kernel {a.name} has other sizes at size {m} than at {n}")
    scaled = {}
    for name, va in sizes_a.items():
        c, k = per_size(va, sizes_b[name], n, f"kernel {a.name}'s {name}", m)
        if c and not (name in may or name.startswith("B") and name[1:].isdigit()):
            raise NotSized(f"kernel {a.name} ({a.schedule.describe()}): {name} follows the dynamic size, "
                           "which it cannot take at launch")
        if c:
            scaled[name] = (c, k)
    return scaled


def _merged_kernel(a: KernelInfo, b: KernelInfo, n: int, m: int) -> tuple[str, bool]:
    """The kernel's source for every size, from its sources at ``n`` (``a``) and ``m``, and
    whether it takes SIZE: a number in the text that follows the size (a stride of a
    sequence, a divisor splitting a row index into batch and position) is written over
    SIZE, which the kernel then takes as an argument after its tensors."""
    if a.source == b.source:
        return a.source, False
    lines = _merged(a.source.split("\n"), b.source.split("\n"), n, m, f"kernel {a.name}")
    head = f"def {a.name}({', '.join(a.params)}, "
    at = next(i for i, line in enumerate(lines) if line.startswith(head))
    lines[at] = head + f"{SIZE}, " + lines[at][len(head):]
    return "\n".join(lines), True


def _check_band(spec, n: int) -> None:
    """An attention kernel whose rows or keys follow the size skips the tiles its mask
    removes as found at the sizes compared (attention.masked_band). Where the mask compares
    indices with a number at least as large as those sizes (a sliding window), what it
    removes at larger sizes was never seen: not sized."""
    from .attention import streams

    if schedules.schedule_of(spec).band is None:
        return
    for node in _static_parts(streams(spec)[0].args[0]):
        if node.op == "const" and not ops.is_float(node.dtype) and abs(int(node.attrs[0])) >= n:
            raise NotSized(f"kernel {spec.name}: its mask compares indices with {node.attrs[0]}, "
                           f"past the sizes it was compared at ({n})")


def _static_parts(node) -> list:
    """The nodes of the subtrees under ``node`` made of indices and constants only."""
    inner = list(node.walk())
    if all(x.op not in ("load", "dot") for x in inner):
        return inner
    return [x for a in node.args for x in _static_parts(a)]


def _inputs(plan_a: Plan, plan_b: Plan, n: int, m: int) -> list:
    """Each input's (shape, strides) at size 0 and per unit of size."""
    out = []
    for a, b in zip(plan_a.inputs, plan_b.inputs):
        if len(a.shape) != len(b.shape):
            raise NotSized(f"input {a.name} has another rank at size {m}")
        pairs = list(zip(tuple(a.shape) + tuple(a.layout), tuple(b.shape) + tuple(b.layout)))
        rules = [per_size(x, y, n, f"input {a.name}'s shape and strides", m) for x, y in pairs]
        per, fixed = [c for c, _ in rules], [k for _, k in rules]
        r = len(a.shape)
        out.append(((tuple(fixed[:r]), tuple(fixed[r:])), (tuple(per[:r]), tuple(per[r:]))))
    return out


def _merged(lines_a: list, lines_b: list, n: int, m: int | None = None, where: str = "the module") -> list:
    """``lines_a`` with each number that differs in ``lines_b`` written as a multiple of
    SIZE plus a constant. The lines must differ in nothing else."""
    m = n + 1 if m is None else m
    if len(lines_a) != len(lines_b):
        raise NotSized(f"{where} has {len(lines_a)} lines at size {n} and {len(lines_b)} at {m}")
    out = []
    for la, lb in zip(lines_a, lines_b):
        if la == lb:
            out.append(la)
            continue
        ta, tb = _tokens(la), _tokens(lb)
        if [t.type for t in ta] != [t.type for t in tb] or \
                any(x.string != y.string for x, y in zip(ta, tb) if x.type != tokenize.NUMBER):
            raise NotSized(f"{where} differs at size {m} in more than sizes: {la.strip()!r} against {lb.strip()!r}")
        line = la
        for x, y in reversed(list(zip(ta, tb))):
            if x.string != y.string:
                if not (x.string.isdigit() and y.string.isdigit()):
                    raise NotSized(f"{x.string} at size {n} is {y.string} at {m} in {la.strip()!r}")
                c, k = per_size(int(x.string), int(y.string), n, f"{x.string!r} in {la.strip()!r}", m)
                line = line[:x.start[1]] + f"({size_text(c, k)})" + line[x.end[1]:]
        out.append(line)
    return out


def _first_difference(a: str, b: str) -> str:
    for la, lb in zip(a.split("\n"), b.split("\n")):
        if la != lb:
            return f"{la.strip()!r} against {lb.strip()!r}"
    return "one is longer"


def _tokens(line: str) -> list:
    return [t for t in tokenize.generate_tokens(io.StringIO(line).readline)
            if t.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER)]
