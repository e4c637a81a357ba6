"""A graph with one dynamic dimension, run at every size by one sized module.

Dynamo hands over a graph with a symbolic size (``dynamic=True``, ``mark_dynamic``, or
the second shape a function meets). eqfuse compiles it for the first size it is called
with, as any graph. At the second, it builds the sized module (codegen/sized.py) from
the graph's plans at that size, the next and a far one, with the block sizes the first
build chose: its kernels take the dynamic size at launch, so every later size runs the
kernels compiled once. Symbols that move by the same step (a decoder's cache of each
layer, its mask, the positions of the step: one length) are one size, each at its own
distance from it. Where there is no sized module
(``NotSized``: a kernel written otherwise at another size, a number that does not follow
the size, an eager step that takes a view of the size's extent, symbols that change
apart), each size compiles on its own.
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("eqfuse")


class SizedGraph:
    """``call_boxed(tensors)`` at any size ``accepts`` takes: the sized module's ``call``
    with the size read from the inputs. ``accepts`` reads only what the backend's key for
    a call holds (shapes, strides, TF32), so the backend asks once per key."""

    def __init__(self, sized, module, device, constants: list, finish, tf32: bool, seconds: float):
        from .compiled import make_fallback_runner

        self.sized = sized
        self.module = module
        self.fallback_runners = [make_fallback_runner(s) for s in sized.fallbacks]
        self.device = device
        self.constants = constants
        self.finish = finish
        self.tf32 = tf32
        self.seconds = seconds  # to build it: plans, code, kernels

    def accepts(self, tensors: list) -> bool:
        """Whether ``tensors`` are the graph's inputs at a size the module runs: laid out
        as it expects them at that size, within its bound, with TF32 as it was built."""
        if torch._C._get_cublas_allow_tf32() != self.tf32:
            return False
        i, d = self.sized.size_input
        if i >= len(tensors) or tensors[i].dim() <= d:
            return False
        size = tensors[i].shape[d] - self.sized.size_offset
        if not 1 <= size <= self.sized.max_size:
            return False
        given = [(tuple(t.shape), t.stride()) for t in list(tensors) + self.constants]
        return given == self.sized.input_layouts(size)

    def call_boxed(self, tensors: list):
        args = list(tensors) + self.constants
        tensors.clear()
        return self.finish(self.module.call_boxed(self.device, self.fallback_runners, args))


class OneSize:
    """The symbols of a call that moved since the first call, as one size: each moved by
    the same step, so each is the size at its own distance from it (a decoder's cache of
    each layer and its mask: one length; the positions a step covers: that length plus
    one). Raises NotSized where they moved otherwise. ``value``: this call's size."""

    def __init__(self, example_inputs, first: dict, sizes, tensors: list):
        from ..codegen.sized import NotSized

        self.example_inputs, self.sizes, self.tensors = example_inputs, sizes, tensors
        self.values = symbol_values(example_inputs, sizes, tensors)
        self.changed = [s for s, v in self.values.items() if first.get(s) != v]
        # At a call where they part, the module's layouts of its inputs no longer match
        # (``accepts``), and the call compiles on its own
        steps = {self.values[s] - first[s] for s in self.changed if s in first}
        if not self.changed or len(steps) != 1 or any(s not in first for s in self.changed):
            moves = ", ".join(f"{s} {first.get(s, '?')}->{self.values[s]}" for s in sorted(self.changed, key=str))
            raise NotSized(f"{len(self.changed)} symbolic sizes changed since the first call ({moves}), not by one "
                           "step; a sized module follows one size")
        self.value = self.values[self.changed[0]]

    def at(self, size: int) -> dict:
        """Each symbol's value where the size is ``size``."""
        return {**self.values, **{s: size + self.values[s] - self.value for s in self.changed}}

    def inputs_at(self, size: int) -> tuple:
        """The size arguments and tensors at ``size`` (``_at``)."""
        return _at(self.example_inputs, self.sizes, self.tensors, self.at(size))

    def layouts(self, size: int) -> list:
        """(shape, strides) of each tensor input at ``size``."""
        values = self.at(size)
        return [(tuple(_concrete(s, values) for s in x.shape), tuple(_concrete(s, values) for s in x.stride()))
                for x in self.example_inputs if isinstance(x, torch.Tensor)]

    def size_input(self) -> tuple:
        """(tensor input, dimension, offset): where a call's size is read, the dimension
        less the offset; NotSized where only size arguments hold it (a full sliding-window
        cache's length)."""
        from ..codegen.sized import NotSized

        tensor_inputs = [x for x in self.example_inputs if isinstance(x, torch.Tensor)]
        for i, x in enumerate(tensor_inputs):
            for d, s in enumerate(x.shape):
                if isinstance(s, torch.SymInt) and s.node.expr in self.changed:
                    return i, d, self.values[s.node.expr] - self.value
        raise NotSized("no input has the dynamic size as a dimension of its own")


def build(fn_at, example_inputs, first: dict, sizes, tensors: list, options, configs: dict) -> SizedGraph:
    """The sized graph of a graph with symbolic sizes, or NotSized/EqfuseError saying why
    there is none. ``fn_at(sizes)``: the graph with its size arguments bound;
    ``example_inputs``: dynamo's (symbolic); ``first``: the symbols' values at the first
    call; ``sizes``, ``tensors``: this call's size arguments (position, value) and
    tensors; ``configs``: block sizes by kernel name (the first call's build)."""
    from ..codegen.sized import NotSized
    from ..pipeline import plan_only

    start = time.perf_counter()
    step = OneSize(example_inputs, first, sizes, tensors)
    fn = fn_at(sizes)
    plan_a, captured = plan_only(fn, tensors, options)

    def plan_of(size):
        sizes_x, tensors_x = step.inputs_at(size)
        return plan_only(fn_at(sizes_x), tensors_x, options)[0]

    def inputs_at(size):
        # inputs that follow the size zeroed there (a valid index, a number), the others
        # as this call has them
        _, inputs = step.inputs_at(size)
        return [t if any(t is x for x in tensors) else t.zero_() for t in inputs]

    graph = sized_graph(plan_a, captured, plan_of, inputs_at, step.value, getattr(fn, "__name__", "graph"),
                        tensors, options, configs)
    # Run once here, at this call's size: a matmul's tiles chosen across sizes may not
    # launch on this GPU (shared memory), where the per-size build would have passed over
    # them to the next
    try:
        graph.call_boxed(list(tensors))
    except Exception as e:  # noqa: BLE001 - whatever stops it, the graph compiles per size
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise NotSized(f"the sized module does not run at size {step.value}: {type(e).__name__}: {first_line}") from e
    graph.seconds = time.perf_counter() - start
    return graph


def sized_graph(plan_a, captured, plan_of, inputs_at, value: int, title: str, tensors: list, options,
                configs: dict) -> SizedGraph:
    """The SizedGraph of a graph whose plan at this call's size ``value`` is ``plan_a``
    (``captured``: its capture; ``tensors``: its inputs at ``value``); ``plan_of(size)``:
    its plan at another size; ``inputs_at(size)``: inputs to launch its kernels on there."""
    from ..codegen.sized import NotSized, PlansDiffer, far_size, sized_module
    from ..errors import EqfuseError
    from ..pipeline import _cublas, _load, _parallel
    from .compiled import VERSION, _unflattener

    device = tensors[0].device
    constants = list(captured.constants)
    parallel = _parallel(options, tensors)
    plans = {value: plan_a}

    def plan_at(size):
        if size not in plans:
            plans[size] = plan_of(size)
        return plans[size]

    def far_serves(base: int) -> bool:
        # Not where the graph does not run (past a model's table of positions) or the cost
        # model fuses otherwise (a larger batch makes other fusions pay): base + 2 then,
        # which still shows a number that changes every other size
        try:
            return [k.name for k in plan_at(far_size(base)).kernels] == [k.name for k in plan_at(base).kernels]
        except EqfuseError:
            return False

    def complete(size, plan, chosen):
        # kernels launched alone, at the plan's size
        return _with_runnable_configs(plan, chosen, title, inputs_at(size), constants, parallel)

    # From the plans at this size n, n + 1 and a far one; where the cost model breaks a tie
    # otherwise at n than at the sizes beside it (a Llama layer stores k's rotary embedding
    # as k at 640 tokens, as k^T at 641 and 642), from n + 1 on: that module runs n too.
    # Where the far size did not serve n, it is not tried again for n + 1.
    use_far = True
    for base in (value, value + 1):
        use_far = use_far and far_serves(base)
        samples = [(size, plan_at(size)) for size in (base, base + 1, far_size(base) if use_far else base + 2)]
        try:
            sized = sized_module(samples, title, VERSION, configs, complete if device.type == "cuda" else None,
                                 library=_cublas(device.type, options))
            break
        except PlansDiffer as e:
            if base != value:
                raise
            log.info("eqfuse: sized module: not from size %d (%s); from %d", value, e, value + 1)
    if not sized.infos:
        raise NotSized("the graph has no kernels")
    module = _load(sized.source, device.type)
    if parallel:
        from .parallel_compile import module_launches, precompile
        outcome = precompile(module_launches(module, sized.infos, samples[0][1], tensors + constants, size=value))
        if outcome.note:
            log.info("eqfuse: sized module: %s", outcome.note)
    return SizedGraph(sized, module, device, constants, _unflattener(captured.out_spec),
                      torch._C._get_cublas_allow_tf32(), 0.0)


def _with_runnable_configs(plan, configs: dict, title: str, tensors: list, constants: list,
                           parallel: bool) -> dict:
    """``configs`` and, for each kernel of ``plan`` it has none for (the first build did
    not have it: the plan at this size fuses otherwise), the first of the tile model's
    configurations that launches at this size (``choose_configs``, untimed), as a
    per-size build takes it: the model's first choice can need more shared memory than
    the GPU has (a Llama layer's attention with its rotary prologue at head dim 128 on
    an H100). ``plan`` is prepared already (the sized module's): code generation in the
    trials prepares it again, which changes nothing."""
    from ..codegen.module import kernel_info
    from ..codegen.sized import NotSized
    from .autotune import NoRunnableConfig, choose_configs
    from .compiled import VERSION

    missing = [kernel_info(k, plan.buffers) for k in plan.kernels if k.name not in configs]
    if not missing:
        return configs
    try:
        chosen = choose_configs(plan, missing, title, VERSION, tensors, constants, measure=False, parallel=parallel)
    except NoRunnableConfig as e:
        raise NotSized(str(e)) from e
    return {**configs, **chosen}


def symbol_values(example_inputs, sizes, tensors) -> dict:
    """The value in this call of each symbol that is a size of its own (a tensor's
    dimension, a size argument) in dynamo's example inputs."""
    values = {}
    tensor_inputs = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    for x, t in zip(tensor_inputs, tensors):
        for d, s in enumerate(x.shape):
            if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol:
                values[s.node.expr] = int(t.shape[d])
    for i, v in sizes:
        x = example_inputs[i]
        if isinstance(x, torch.SymInt) and x.node.expr.is_Symbol:
            values[x.node.expr] = int(v)
    return values


def _symbolic_ints(x) -> list:
    if isinstance(x, torch.SymInt):
        return [x]
    if isinstance(x, torch.Tensor):
        return [s for s in (*x.shape, *x.stride()) if isinstance(s, torch.SymInt)]
    return []


def _at(example_inputs, sizes, tensors, values: dict) -> tuple:
    """This call's size arguments and tensors with the symbols at ``values`` (new tensors,
    uninitialised, where a shape or stride follows them)."""
    def concrete(s):
        return _concrete(s, values)
    new_sizes = tuple((i, concrete(example_inputs[i])) for i, _ in sizes)
    tensor_inputs = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    new_tensors = []
    for x, t in zip(tensor_inputs, tensors):
        if _symbolic_ints(x):
            new_tensors.append(torch.empty_strided([concrete(s) for s in x.shape], [concrete(s) for s in x.stride()],
                                                   dtype=t.dtype, device=t.device))
        else:
            new_tensors.append(t)
    return new_sizes, new_tensors


def _concrete(s, values: dict) -> int:
    return int(s.node.expr.subs(values)) if isinstance(s, torch.SymInt) else int(s)
