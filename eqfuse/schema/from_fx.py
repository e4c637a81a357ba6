"""FX graph -> egglog terms.

Every computing FX node becomes its own kernel, ``Kernel(v)``, and its consumers read it
with ``Load(Kernel(v))``: the unfused plan, one kernel per op as in eager. Views of graph
inputs fold into strided loads (FakeTensor strides are exact for them); views of computed
values become index-map terms. Nodes the schema lacks are recorded as eager fallbacks,
each with a one-line reason; their computed arguments become roots that must be
materialised, and their results become ``Input`` buffers for the rest of the graph.

Each op's handler, by room (pointwise, reductions, views, indexing, products), is in
``schema/handlers/``; the values they return, and the Translation, in ``schema/values.py``.

Let-names tie e-classes back to the graph: ``n_<fx name>`` on each node's value,
``out_<i>`` on each graph output, ``fb_<j>_<k>`` on each fallback argument.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import Unsupported
from ..frontend.writes import written_input
from . import ops
from .eager_steps import Flattened, leaves, nested, nested_as, substituted, underlying_op
from .handlers import MOVES, handler_for
from .ops import dtype_name
from .plan import BufArg, contiguous_strides
from .values import ArgRef, BufferView, BufRef, Computed, Fallback, Translation, node_meta

aten = torch.ops.aten
prims = torch.ops.prims


class Translator:
    def __init__(self, captured, emulate_precision_casts: bool = False):
        from egglog import EGraph

        from . import terms

        self.t = terms
        self.cap = captured
        self.egraph = EGraph()
        self.env: dict[torch.fx.Node, Any] = {}
        self.facts: list = []
        self.fallbacks: list[Fallback] = []
        self.roots: list[str] = []
        self.arg_strides: dict[str, tuple] = {}
        self.inputs: list = []
        # input or eager step's buffer name -> its tensor's storage in the trace (for aliasing;
        # an eager step's result may be a view of an input)
        self.input_storages: dict = {}
        self.literals: dict = {}  # input buffer name -> value, for 0-dim literals (CapturedGraph.literals)
        self._ivecs: dict[tuple, Any] = {}
        self.emulate_precision_casts = emulate_precision_casts

    def ivec(self, values):
        """``terms.ivec(values)``, made once per distinct vector: building an egglog term
        through its Python API costs about 0.2 ms, and a graph spells the same few shapes
        and strides a thousand times (every new term's shape fact names one).

        Each vector is a global of the e-graph, which the terms refer to: spelled out
        inside a term, a vector was seen stored with another's values (egglog 13.2: GPT-2's
        training forward on an H100, ``PYTHONHASHSEED=9``, had ``Reshape(addmm_2,
        Vec(8, 1024, 3072))`` come back from the e-graph, extracted or serialised, as
        ``Vec(8, 3072, 3072)``; validation caught it, and the graph ran in eager)."""
        key = tuple(int(v) for v in values)
        vec = self._ivecs.get(key)
        if vec is None:
            vec = self._ivecs[key] = self.egraph.let(f"vec_{len(self._ivecs)}", self.t.ivec(key))
        return vec

    def literal(self, entry):
        """The value of ``entry`` where it is a 0-dim literal of the code (on the CPU, beside
        tensors of any device), else None."""
        if isinstance(entry, BufferView) and not entry.shape:
            return self.literals.get(entry.buf)
        return None

    # --- term construction -------------------------------------------------------------------
    def mk(self, term, dtype: str, shape):
        """Record the dtype and shape analyses of a new term."""
        from egglog import i64, set_
        self.facts.append(set_(self.t.vdtype(term)).to(i64(self.t.dtype_code(dtype))))
        self.facts.append(set_(self.t.vshape(term)).to(self.ivec(shape)))
        return term

    def const(self, value, dtype: str):
        if isinstance(value, bool):
            value = float(value)
        return self.mk(self.t.const(value, dtype), dtype, ())

    def value(self, entry):
        """The Value term of an entry."""
        if isinstance(entry, Computed):
            return entry.term
        if isinstance(entry, BufferView):
            t = self.t
            buf = t.Input(t.buffer_code(entry.buf), t.dtype_code(entry.dtype))
            return self.mk(t.LoadStrided(buf, self.ivec(entry.shape),
                                         self.ivec(entry.strides), entry.offset), entry.dtype, entry.shape)
        raise TypeError(entry)

    def cast(self, term, src: str, dst: str, shape):
        return term if src == dst else self.mk(self.t.Cast(term, self.t.dtype_code(dst)), dst, shape)

    def rounded(self, entry: Computed) -> Computed:
        """``entry`` (a narrow float) rounded to its dtype, as eager stores an op's result:
        a narrow value is computed in float32 until a store or a cast to a narrow dtype,
        and a round trip through float32 is that cast (rules.rulesets keeps it)."""
        wide = self.cast(entry.term, entry.dtype, "float32", entry.shape)
        return Computed(self.cast(wide, "float32", entry.dtype, entry.shape), entry.shape, entry.dtype)

    def operand(self, arg, shape, dtype: str):
        """An op's argument as a Value of ``dtype``, broadcast to ``shape``."""
        if isinstance(arg, (int, float, bool)):
            return self.const(arg, dtype)
        if isinstance(arg, (BufferView, Computed)):
            v = self.cast(self.value(arg), arg.dtype, dtype, arg.shape)
            if tuple(arg.shape) != tuple(shape):
                v = self.mk(self.t.Broadcast(v, self.ivec(shape)), dtype, shape)
            return v
        raise Unsupported(f"argument of type {type(arg).__name__}")

    # --- the walk ------------------------------------------------------------------------------
    def run(self) -> Translation:
        order = 0
        for node in self.cap.gm.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node, order)
                order += 1
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                outputs = self._outputs(node)
        if self.facts and not os.environ.get("EQFUSE_NO_FACTS"):
            self.egraph.register(*self.facts)
        return Translation(self.egraph, self.inputs, outputs, self.fallbacks, self.roots,
                           arg_strides=self.arg_strides)

    def _placeholder(self, node, index):
        v = node_meta(node)
        if not isinstance(v, torch.Tensor):
            raise Unsupported(f"input {node.name} is not a tensor")
        name = f"in{index}"
        if v.layout != torch.strided:  # only eager ops read it (sparse tensors)
            self.inputs.append((name, tuple(v.shape), "opaque"))
            self.env[node] = _Opaque(name)
            return
        dt = self._dtype(v)
        self.inputs.append((name, tuple(v.shape), dt))
        self.input_storages[name] = _storage(v)
        if node.name in self.cap.literals:
            self.literals[name] = self.cap.literals[node.name]
        self.env[node] = BufferView(name, tuple(v.shape), tuple(v.stride()), 0, dt, foldable=True)

    def _dtype(self, v) -> str:
        try:
            return dtype_name(v.dtype)
        except KeyError:
            raise Unsupported(f"dtype {v.dtype} is not supported by eqfuse kernels") from None

    def _call(self, node):
        if node.target is operator.getitem:
            base = self.env[node.args[0]]
            self.env[node] = base[node.args[1]]
            return
        written = written_input(node)
        if written is not None:  # an update of an input in place: an eager step (frontend/writes.py)
            self._fallback(node, f"writes input {written.name} in place", writes=self.env[written].buf)
            return
        handler = handler_for(node.target)
        out = node_meta(node)
        if handler is not None and _no_elements(out):
            self._empty(node, out, f"has no elements (shape {tuple(out.shape)}): an empty tensor, nothing to compute")
            return
        if getattr(node.target, "overloadpacket", None) in ALLOCATIONS and isinstance(out, torch.Tensor):
            self._empty(node, out, "allocates memory it leaves as it is: nothing to compute")
            return
        try:
            if handler is None:
                raise Unsupported(_no_kernel_form(node.target))
            _check_kernel_operands(node)
            if isinstance(out, torch.Tensor):
                self._dtype(out)
            args = [self._resolve(a) for a in node.args]
            kwargs = {k: self._resolve(a) for k, a in node.kwargs.items()}
            entry = handler(self, node, *args, **kwargs)
        except Unsupported as e:
            self._fallback(node, str(e))
            return
        if isinstance(entry, Computed):
            if self.emulate_precision_casts and entry.dtype in ops.NARROW_FLOATS and handler not in MOVES:
                entry = self.rounded(entry)
            # Materialise as its own kernel; consumers read it through Load(Kernel(v)).
            # Later terms name v by its let-binding: spelled out, every term would carry
            # the whole graph above it, and registering them grows with the square of it.
            named = self.egraph.let(f"n_{node.name}", entry.term)
            t = self.t
            loaded = self.mk(t.Load(t.Kernel(named)), entry.dtype, entry.shape)
            entry = Computed(loaded, entry.shape, entry.dtype)
        self.env[node] = entry

    def _resolve(self, a):
        if isinstance(a, torch.fx.Node):
            return self.env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self._resolve(x) for x in a)
        return a

    def _empty(self, node, meta, reason: str):
        """A value with no elements, or an allocation whose contents are left undefined
        (``torch.empty``, ``empty_like``, ``new_empty_strided``): nothing to compute, so no
        kernel; the step that stands for it allocates a tensor of its shape, dtype and
        strides. A concatenation leaves one with no elements out (transformers'
        ``DynamicCache`` starts each layer's keys as ``torch.tensor([])``); any other
        kernel reading it runs in eager."""
        j = len(self.fallbacks)
        name = f"ext{j}_0"
        dt = self._dtype(meta)
        shape = tuple(meta.shape)
        target = EmptyTensor(shape, tuple(meta.stride()), meta.dtype, str(meta.device))
        self.fallbacks.append(Fallback(node.name, target, (), {}, reason, [name], False, [(shape, dt)]))
        self.env[node] = BufferView(name, shape, tuple(meta.stride()), 0, dt, foldable=False)

    def _fallback(self, node, reason, writes: str | None = None):
        """``node`` as an eager step; ``writes``: the input buffer it writes in place (its
        first argument, passed as it is: a copy in eager's layout would take the write)."""
        j = len(self.fallbacks)

        def ref(a, path):
            if isinstance(a, torch.fx.Node):
                e = self.env[a]
                if isinstance(e, BufferView) and not self._copied_input(e, a):
                    return BufRef(e.buf, e.shape, e.strides, e.offset)
                if isinstance(e, BufferView):
                    # A copy in eager (a clone of an input): the step gets a copy too, or a
                    # view it returns would be a view of the input (x.clone().resize_(...))
                    e = Computed(self.value(e), e.shape, e.dtype)
                if isinstance(e, list):  # a multi-result eager node passed whole
                    raise Unsupported("multi-result value passed on")
                if isinstance(e, _Opaque):  # an eager op's result no kernel reads
                    return BufArg(e.name)
                if (viewed := self._view_of_computed(a)) is not None:
                    base, view = viewed
                    name = f"fb_{j}_{path}_base"
                    self.egraph.let(name, base.term)
                    self.roots.append(name)
                    return ArgRef(name, view)
                name = f"fb_{j}_{path}"
                self.egraph.let(name, e.term)
                self.roots.append(name)
                if (layout := _layout(node_meta(a))) is not None:
                    self.arg_strides[name] = layout[1]
                return ArgRef(name)
            if isinstance(a, (list, tuple)):
                return type(a)(ref(x, f"{path}_{i}") for i, x in enumerate(a))
            return a

        args = tuple(ref(a, str(i)) for i, a in enumerate(node.args))
        kwargs = {k: ref(a, k) for k, a in node.kwargs.items()}
        out = node_meta(node)
        multi = isinstance(out, (list, tuple))
        metas = leaves(out)
        names, entries, info = [], [], []
        for k, m in enumerate(metas):
            name = f"ext{j}_{k}"
            names.append(name)
            if isinstance(m, torch.Tensor):
                try:
                    dt = self._dtype(m) if _kernel_readable(m) else None
                except Unsupported:
                    dt = None
                # The buffer holds the result in eager's layout (see EagerCall). Where
                # that layout is dense, views of the result fold into its strides as views
                # of an input do (a weight's gradient from _grouped_mm, transposed twice,
                # is the step's result itself, not a copy of its gigabyte).
                if dt:
                    strides = dense_strides(m.shape, m.stride())
                    entries.append(BufferView(name, tuple(m.shape), strides, 0, dt, strides == tuple(m.stride())))
                else:
                    entries.append(_Opaque(name))
                self.input_storages[name] = _storage(m)
                info.append((tuple(m.shape), dt))
            else:
                entries.append(_Opaque(name))
                info.append(((), None))
        target = substituted(node.target)
        if nested(out):  # its results one buffer each, and its value their nesting (for getitem)
            target, entries = Flattened(target), nested_as(out, iter(entries))
        target = node.target if writes else EagerCall.wrap(node, metas, target)
        self.fallbacks.append(Fallback(node.name, target, args, kwargs, reason, names, multi, info, writes))
        self.env[node] = entries if multi else entries[0]

    def _view_of_computed(self, node):
        """(the computed value, (shape, strides, offset)) where ``node`` is in eager a view
        of a computed value laid out contiguously (a transpose handed to ``_grouped_mm``
        beside the value itself): the step gets that view of the value's buffer, not a
        buffer of its own holding the same bytes (Mixtral's backward wrote two of 0.4 GB)."""
        base = node
        while isinstance(base, torch.fx.Node) and base.op == "call_function" and \
                getattr(base.target, "overloadpacket", None) in _VIEW_OPS:
            base = base.args[0]
        if base is node or not isinstance(base, torch.fx.Node) or not isinstance(self.env.get(base), Computed):
            return None
        mine, theirs = node_meta(node), node_meta(base)
        if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and _kernel_readable(mine)
                and _kernel_readable(theirs) and theirs.is_contiguous()):
            return None
        view = (tuple(mine.shape), tuple(mine.stride()), mine.storage_offset() - theirs.storage_offset())
        return self.env[base], view

    def _copied_input(self, entry, node) -> bool:
        """Whether output ``node``, read from buffer ``entry.buf`` (an input's, or an eager
        step's), is in eager a tensor of its own rather than a view of that buffer's tensor."""
        if not isinstance(node, torch.fx.Node) or entry.buf not in self.input_storages:
            return False
        mine, theirs = _storage(node_meta(node)), self.input_storages[entry.buf]
        return mine is not None and theirs is not None and mine != theirs

    def _output_strides(self, i: int, node) -> tuple:
        """Output ``i``'s strides: eager's where capture knows them, else the trace's."""
        meta, known = node_meta(node), self.cap.output_strides
        eager = known[i] if known is not None and i < len(known) else None
        shape = tuple(meta.shape)
        if eager is not None and len(eager) == len(shape) and eager == dense_strides(shape, eager):
            return eager  # dense: no overlap, no gap
        return tuple(meta.stride())

    def _outputs(self, node):
        outs = []
        aliases = _aliased_outputs(node.args[0], self.env)
        for i, a in enumerate(node.args[0]):
            e = self.env[a] if isinstance(a, torch.fx.Node) else a
            if i in aliases:
                outs.append(("alias", *aliases[i]))
            elif isinstance(e, BufferView) and self._copied_input(e, a):
                # eager returns a tensor of its own (clone, contiguous, a *_copy op): so must we,
                # or a write to the result would change the input
                name = f"out_{i}"
                self.egraph.let(name, self.value(e))
                self.roots.append(name)
                outs.append(("value", name, e.shape, e.dtype, self._output_strides(i, a)))
            elif isinstance(e, BufferView):
                outs.append(("buffer", BufRef(e.buf, e.shape, e.strides, e.offset)))
            elif isinstance(e, Computed):
                name = f"out_{i}"
                self.egraph.let(name, e.term)
                self.roots.append(name)
                # Eager's strides: AOTAutograd rebuilds aliased outputs with them.
                strides = self._output_strides(i, a) if isinstance(a, torch.fx.Node) else None
                outs.append(("value", name, e.shape, e.dtype, strides))
            elif isinstance(e, _Opaque):
                outs.append(("opaque", e.name))
            else:
                outs.append(("const", e))
        return outs


_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# Ops whose result is a view of their first argument's tensor, in eager
_VIEW_OPS = {aten.permute, aten.transpose, aten.t, aten.view, aten._unsafe_view, aten.unsqueeze, aten.squeeze,
          aten.slice, aten.select, aten.expand, aten.alias}


def _storage(meta):
    """A key for the storage of a traced tensor (fake tensors of views share their base's), or None."""
    from torch.multiprocessing.reductions import StorageWeakRef
    try:
        return StorageWeakRef(meta.untyped_storage())
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _aliased_outputs(outputs, env) -> dict:
    """{i: (j, shape, strides)} for each graph output ``i`` that is output ``j`` (a computed
    value, not itself an alias) again, or a contiguous reshape of it: it is returned as a
    view of ``j``'s buffer instead of being stored a second time (a training forward
    returns the logits to the user and saves the product they are a view of for its
    backward: a second write of a gigabyte, which kept the product from cuBLAS)."""
    first = {}
    for j, a in enumerate(outputs):
        if isinstance(a, torch.fx.Node) and isinstance(env.get(a), Computed):
            first.setdefault(a, j)
    aliases = {}
    for i, a in enumerate(outputs):
        if not isinstance(a, torch.fx.Node) or not isinstance(env.get(a), Computed):
            continue
        base = a
        if first.get(a) == i:
            if a.target not in _RESHAPES or a.args[0] not in first:
                continue
            base = a.args[0]
        meta, base_meta = node_meta(a), node_meta(base)
        if not (isinstance(meta, torch.Tensor) and isinstance(base_meta, torch.Tensor)):
            continue
        if meta.is_contiguous() and base_meta.is_contiguous() and meta.numel() == base_meta.numel():
            aliases[i] = (first[base], tuple(meta.shape), tuple(meta.stride()))
    return {i: v for i, v in aliases.items() if v[0] not in aliases}


def dense_strides(shape, strides) -> tuple:
    """The strides of a dense tensor of ``shape`` whose dims lie in memory in the order
    ``strides`` gives them (largest stride outermost): ``[B, H, S, D]`` viewed from a
    ``[B, S, H, D]`` buffer has ``(S*H*D, D, H*D, 1)``."""
    order = sorted(range(len(shape)), key=lambda d: (-strides[d], d))
    out, acc = [0] * len(shape), 1
    for d in reversed(order):
        out[d] = acc
        acc *= max(int(shape[d]), 1)
    return tuple(out)


def _layout(meta) -> tuple | None:
    """(eager's strides, the dense strides in their order) of eager's value ``meta``;
    None where that order is the contiguous one, or ``meta`` is not a tensor kernels read
    (a complex one stays as eager made it, from eager step to eager step)."""
    if not isinstance(meta, torch.Tensor) or meta.dim() == 0 or not _kernel_readable(meta):
        return None
    if meta.dtype not in ops.DTYPE_NAMES:
        return None
    strides = dense_strides(tuple(meta.shape), tuple(meta.stride()))
    return None if strides == contiguous_strides(tuple(meta.shape)) else (tuple(meta.stride()), strides)


def _no_elements(meta) -> bool:
    """Whether ``meta`` is a tensor with no elements."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return isinstance(meta, torch.Tensor) and statically_known_true(meta.numel() == 0)


# Ops whose kernel form leaves out the parts with no elements
_SKIPS_EMPTY_PARTS = {aten.cat.default, aten.slice_scatter.default}


def _kernel_readable(meta) -> bool:
    """Whether kernels can read the tensor ``meta``: strided, with a shape known now."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    return meta.layout == torch.strided and not free_unbacked_symbols(meta)


def _check_kernel_operands(node) -> None:
    """Raise Unsupported where ``node``'s value cannot be computed by a kernel: it is not
    a strided tensor, its shape is known only at run time (boolean indexing, nonzero), or
    a kernel would read a tensor with no elements (kernels index every dim of what they
    read: a sum over an empty dim, a product over an empty K)."""
    values = node_meta(node)
    for v in values if isinstance(values, (tuple, list)) else (values,):
        if isinstance(v, torch.Tensor) and not _kernel_readable(v):
            raise Unsupported(_unreadable(v))
    for a in node.all_input_nodes:
        m = node_meta(a)
        if not isinstance(m, torch.Tensor):
            continue
        if not _kernel_readable(m):
            raise Unsupported(f"reads {a.name}, {_unreadable(m)}")
        if _no_elements(m) and node.target not in _SKIPS_EMPTY_PARTS:
            raise Unsupported(f"reads {a.name}, which has no elements (shape {tuple(m.shape)})")


def _unreadable(meta) -> str:
    if meta.layout != torch.strided:
        return f"a {meta.layout} tensor (eqfuse kernels take strided ones)"
    return "a tensor whose shape is known only at run time"


@dataclass(frozen=True)
class EagerCall:
    """An eager op run with the memory layouts it had in eager.

    Kernels materialise values contiguously, but some ops depend on their operands'
    layout beyond their values: cuDNN's attention backward computes wrong gradients
    (relative error 1.4, measured on an H100) when the output gradient or the forward
    output is contiguous while eager had them ``[B, S, H, D]`` in memory. So each tensor
    argument is given eager's layout (one copy where it differs), and each result is kept
    in eager's layout: the buffer is described with those strides, and the result is
    handed over as the dense view in memory order, which the runner's ``.contiguous()``
    leaves as it is."""
    target: Any
    args: tuple  # per positional argument: (eager's strides, dense strides in their order) or None
    kwargs: tuple  # (name, layout) pairs
    results: tuple  # per result: likewise

    @staticmethod
    def wrap(node, out_metas, target):
        """``target`` (``node``'s op or its substitute) run with eager's layouts where it needs them."""
        args = tuple(_layout(node_meta(a)) for a in node.args)
        kwargs = tuple((k, _layout(node_meta(a))) for k, a in node.kwargs.items())
        results = tuple(_layout(m) for m in out_metas)
        if not any(args) and not any(s for _, s in kwargs) and not any(results):
            return target
        return EagerCall(target, args, kwargs, results)

    def __call__(self, *args, **kwargs):
        args = [_relayout(a, s) for a, s in zip(args, self.args)] + list(args[len(self.args):])
        layouts = dict(self.kwargs)
        kwargs = {k: _relayout(v, layouts.get(k)) for k, v in kwargs.items()}
        out = self.target(*args, **kwargs)
        multi = isinstance(out, (list, tuple))
        outs = [_memory_order(o, layout) for o, layout in zip(out if multi else [out], self.results)]
        return type(out)(outs) if multi else outs[0]

    def __repr__(self):
        return f"{_op_name(underlying_op(self.target))} (with eager's memory layouts)"


def _relayout(x, layout):
    """``x`` as eager laid it out: as it is if it has eager's strides or the dense ones
    in their order, else a copy with the dense ones."""
    if layout is None or not isinstance(x, torch.Tensor) or tuple(x.stride()) in layout:
        return x
    return torch.empty_strided(x.shape, layout[1], dtype=x.dtype, device=x.device).copy_(x)


def _memory_order(x, layout):
    """A result in eager's layout as a dense view in memory order (contiguous)."""
    if layout is None or not isinstance(x, torch.Tensor):
        return x
    if tuple(x.stride()) != layout[1]:  # eager's own strides, not dense: make them dense
        x = torch.empty_strided(x.shape, layout[1], dtype=x.dtype, device=x.device).copy_(x)
    return x.permute(sorted(range(x.dim()), key=lambda d: (-layout[1][d], d)))


# Ops that allocate a tensor and leave its contents undefined: a step that allocates it
ALLOCATIONS = {aten.empty, aten.empty_like, aten.empty_permuted, aten.empty_strided, aten.new_empty,
               aten.new_empty_strided}


@dataclass(frozen=True)
class EmptyTensor:
    """The step for a value with no elements, or an allocation left as it is: a tensor of
    its shape, strides, dtype and device (no kernel, no data written)."""
    shape: tuple
    strides: tuple
    dtype: torch.dtype
    device: str

    def __call__(self):
        return torch.empty_strided(self.shape, self.strides, dtype=self.dtype, device=self.device)

    def __repr__(self):
        return f"an empty {str(self.dtype).removeprefix('torch.')} tensor of shape {self.shape}"


@dataclass
class _Opaque:
    """A non-tensor (or unsupported-dtype) result of an eager node."""
    name: str
    shape: tuple = ()
    dtype: str = "opaque"


def _no_kernel_form(target) -> str:
    """Why an op no handler takes runs in eager: it has no kernel form, or has one only
    within the bounds of its decomposition, which its arguments are outside."""
    from ..frontend.decompose import ADDED

    if target in ADDED:
        return (f"{_op_name(target)} is kernels only within its decomposition's bounds (frontend/decompose/: "
                f"CUMSUM_WORK comparisons, integers whose order of ties is open, or a case left to ATen), "
                f"and these arguments are outside them")
    return f"{_op_name(target)} has no kernel form in eqfuse yet"


def _op_name(target) -> str:
    return getattr(target, "__name__", None) or str(target)


def step_op(target) -> str:
    """The name of the op an eager step runs (its overload packet's: ``embedding``), or
    ``empty`` for a tensor with no elements."""
    if isinstance(target, EmptyTensor):
        return "empty"
    target = underlying_op(target)
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or _op_name(target)


def translate(captured, emulate_precision_casts: bool = False) -> Translation:
    """The graph's terms in a new e-graph; with ``emulate_precision_casts``, each op's
    narrow float result rounded to its dtype (``Translator.rounded``)."""
    return Translator(captured, emulate_precision_casts).run()
