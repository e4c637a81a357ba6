"""FX graph -> egglog terms.

Every computing FX node becomes its own kernel, ``Kernel(v)``, and its consumers read it
with ``Load(Kernel(v))``: the unfused plan, one kernel per op as in eager. Views of graph
inputs fold into strided loads (FakeTensor strides are exact for them); views of computed
values become index-map terms. Nodes the schema lacks are recorded as eager fallbacks,
each with a one-line reason; their computed arguments become roots that must be
materialised, and their results become ``Input`` buffers for the rest of the graph.

Let-names tie e-classes back to the graph: ``n_<fx name>`` on each node's value,
``out_<i>`` on each graph output, ``fb_<j>_<k>`` on each fallback argument.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import Unsupported
from ..frontend.writes import written_input
from . import ops
from .eager_steps import Flattened, leaves, nested, nested_as, substituted, underlying_op
from .ops import dtype_name
from .plan import BufArg, contiguous_strides

aten = torch.ops.aten
prims = torch.ops.prims


@dataclass
class BufferView:
    """A strided view of a buffer the kernels do not compute (input or eager result)."""
    buf: str
    shape: tuple
    strides: tuple
    offset: int
    dtype: str
    foldable: bool  # views of it may fold into its strides (inputs, eager steps' dense results)


@dataclass
class Computed:
    term: Any  # a Value term
    shape: tuple
    dtype: str


@dataclass
class Fallback:
    node: str
    target: Any
    args: Any  # args with FX nodes replaced by ArgRef / BufRef
    kwargs: Any
    reason: str
    outputs: list  # names of the external buffers it produces (one per tensor result)
    multi: bool
    out_info: list = field(default_factory=list)  # (shape, dtype) per output; dtype None if opaque
    writes: str | None = None  # the input buffer it writes in place (frontend/writes.py)


@dataclass(frozen=True)
class ArgRef:
    """A computed value, materialised under let-name ``name``, passed to an eager op;
    with ``view`` (shape, strides, offset), that view of its contiguous buffer."""
    name: str
    view: tuple | None = None


@dataclass(frozen=True)
class BufRef:
    """An input / external buffer viewed with (shape, strides, offset), passed to an eager op."""
    buf: str
    shape: tuple
    strides: tuple
    offset: int


@dataclass
class Translation:
    egraph: Any
    inputs: list[tuple[str, tuple, str]]  # (buffer name, shape, dtype) per placeholder
    # per flat output: ("value", let, shape, dtype, strides) | ("buffer", BufRef) | ("const", v)
    # | ("alias", j, shape, strides): output j's tensor again, viewed so (contiguous both)
    outputs: list
    fallbacks: list[Fallback]
    roots: list[str]  # let-names that must be materialised (outputs, fallback args)
    node_names: list[str] = field(default_factory=list)
    # fallback argument let-name -> the strides its buffer is written with: eager's layout
    # of the argument where that is not the contiguous one, so that the step takes the
    # buffer as it is (EagerCall) instead of a copy in that layout
    arg_strides: dict[str, tuple] = field(default_factory=dict)


def _meta(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


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
        v = _meta(node)
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
        handler = _handler(node.target)
        out = _meta(node)
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
                if (layout := _layout(_meta(a))) is not None:
                    self.arg_strides[name] = layout[1]
                return ArgRef(name)
            if isinstance(a, (list, tuple)):
                return type(a)(ref(x, f"{path}_{i}") for i, x in enumerate(a))
            return a

        args = tuple(ref(a, str(i)) for i, a in enumerate(node.args))
        kwargs = {k: ref(a, k) for k, a in node.kwargs.items()}
        out = _meta(node)
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
        mine, theirs = _meta(node), _meta(base)
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
        mine, theirs = _storage(_meta(node)), self.input_storages[entry.buf]
        return mine is not None and theirs is not None and mine != theirs

    def _output_strides(self, i: int, node) -> tuple:
        """Output ``i``'s strides: eager's where capture knows them, else the trace's."""
        meta, known = _meta(node), self.cap.output_strides
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
        meta, base_meta = _meta(a), _meta(base)
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
    values = _meta(node)
    for v in values if isinstance(values, (tuple, list)) else (values,):
        if isinstance(v, torch.Tensor) and not _kernel_readable(v):
            raise Unsupported(_unreadable(v))
    for a in node.all_input_nodes:
        m = _meta(a)
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
        args = tuple(_layout(_meta(a)) for a in node.args)
        kwargs = tuple((k, _layout(_meta(a))) for k, a in node.kwargs.items())
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
        return (f"{_op_name(target)} is kernels only within its decomposition's bounds (frontend/decompose.py: "
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


# --- op handlers -----------------------------------------------------------------------------
# Each handler gets the translator, the FX node (for its meta) and the resolved arguments,
# and returns a Computed value (or a BufferView, for views of inputs).

HANDLERS: dict[Any, Callable] = {}


def _handler(target) -> Callable | None:
    return HANDLERS.get(target) or HANDLERS.get(getattr(target, "overloadpacket", None))


def has_kernel_form(target) -> bool:
    """Whether eqfuse translates ``target`` into kernels (the rest runs in eager)."""
    return _handler(target) is not None


def handles(*targets):
    def deco(fn):
        for t in targets:
            HANDLERS[t] = fn
        return fn
    return deco


def _out(node):
    m = _meta(node)
    return tuple(m.shape), dtype_name(m.dtype)


def _entry_meta(arg):
    """A stand-in tensor for torch's type promotion."""
    if isinstance(arg, (BufferView, Computed)):
        return torch.empty((1,) * max(len(arg.shape), 1), dtype=ops.DTYPES[arg.dtype], device="meta") \
            if len(arg.shape) else torch.empty((), dtype=ops.DTYPES[arg.dtype], device="meta")
    return arg


UNARY_TARGETS = {
    aten.neg: "neg", aten.exp: "exp", aten.log: "log", aten.sqrt: "sqrt", aten.rsqrt: "rsqrt",
    aten.tanh: "tanh", aten.sigmoid: "sigmoid", aten.relu: "relu", aten.abs: "abs", aten.erf: "erf",
    aten.erfc: "erfc", aten.erfinv: "erfinv",
    aten.sin: "sin", aten.cos: "cos", aten.floor: "floor", aten.ceil: "ceil",
    aten.reciprocal: "reciprocal", aten.logical_not: "not", aten.log1p: "log1p", aten.expm1: "expm1",
    aten.isnan: "isnan", aten.isinf: "isinf", aten.log2: "log2", aten.exp2: "exp2", aten.log10: "log10",
    aten.trunc: "trunc", aten.sign: "sign", aten.sgn: "sign", aten.round: "round",
    aten.signbit: "signbit", prims.signbit: "signbit", aten.sinh: "sinh", aten.cosh: "cosh", aten.tan: "tan",
    aten.asinh: "asinh", aten.acosh: "acosh", aten.atanh: "atanh", aten.atan: "atan", aten.asin: "asin",
    aten.acos: "acos", aten.arcsinh: "asinh", aten.arccosh: "acosh", aten.arctanh: "atanh", aten.arctan: "atan",
    aten.arcsin: "asin", aten.arccos: "acos",
}


def _unary(tr, node, x, *rest, **kw):
    op = UNARY_TARGETS[node.target.overloadpacket]
    shape, dt = _out(node)
    if op == "round" and (rest or kw.get("decimals") or dt == "float64"):
        raise Unsupported("round to decimals, or of float64")
    if op == "signbit" and x.dtype != "float32":
        raise Unsupported(f"signbit of {x.dtype} (its kernel form reads float32's bits)")
    if op in ops.BOOL_UNARY:
        v = tr.operand(x, shape, x.dtype)
        return Computed(tr.mk(tr.t.Unary(op, v), "bool", shape), shape, "bool")
    if not ops.is_float(dt) and op not in ("neg", "abs", "relu"):
        raise Unsupported(f"{op} on {dt}")
    v = tr.operand(x, shape, dt)
    return Computed(tr.mk(tr.t.Unary(op, v), dt, shape), shape, dt)


handles(*UNARY_TARGETS)(_unary)


@handles(aten.bitwise_not)
def _bitwise_not(tr, node, x):
    if x.dtype != "bool":
        raise Unsupported("bitwise_not on integers")
    shape, _ = _out(node)
    return Computed(tr.mk(tr.t.Unary("not", tr.operand(x, shape, "bool")), "bool", shape), shape, "bool")


BINARY_TARGETS = {
    aten.add: "add", aten.sub: "sub", aten.mul: "mul", aten.div: "div", aten.maximum: "maximum",
    aten.minimum: "minimum", aten.eq: "eq", aten.ne: "ne", aten.lt: "lt", aten.le: "le",
    aten.gt: "gt", aten.ge: "ge", aten.logical_and: "and", aten.logical_or: "or",
    aten.logical_xor: "xor", aten.bitwise_and: "and", aten.bitwise_or: "or", aten.bitwise_xor: "xor",
    prims.div: "div", aten.pow: "pow", aten.fmax: "fmax", aten.fmin: "fmin", aten.atan2: "atan2",
    aten.arctan2: "atan2", aten.hypot: "hypot",
    aten.bitwise_right_shift: "rshift", aten.__rshift__: "rshift",
    aten.bitwise_left_shift: "lshift", aten.__lshift__: "lshift",
}


def _binary(tr, node, a, b, *rest, alpha=None, rounding_mode=None, **kw):
    op = BINARY_TARGETS[node.target.overloadpacket]
    shape, dt = _out(node)
    if op == "div" and rounding_mode is not None and not ops.is_float(dt):
        return _int_division(tr, node, a, b, "floor" if rounding_mode == "floor" else "trunc")
    if rounding_mode == "floor":
        return _float_division(tr, node, a, b, "floordiv")
    if rounding_mode is not None and not (rounding_mode == "trunc" and ops.is_float(dt)):
        raise Unsupported(f"div with rounding_mode={rounding_mode!r}")
    if op == "pow" and isinstance(a, (int, float)) and not isinstance(b, (int, float)) and ops.is_float(dt):
        return _scalar_to_a_power(tr, a, b, shape, dt)
    if op == "pow" and not (isinstance(b, (int, float)) and ops.is_float(dt)):
        raise Unsupported("pow is supported on floats with a scalar exponent or a positive scalar base")
    if op in ("and", "or", "xor") and dt != "bool":
        op = "bit" + op  # bitwise on integers, logical on bools
    if op.startswith("bit") or op.endswith("shift"):
        if ops.is_float(dt):
            raise Unsupported(f"{op} on {dt}")
    if op in ops.COMPARISONS:
        compute = dtype_name(torch.result_type(_entry_meta(a), _entry_meta(b)))
        if op in ("and", "or", "xor"):
            compute = "bool"
    else:
        compute = dt
        if op == "div" and not ops.is_float(dt):
            raise Unsupported("integer division")
    va, vb = tr.operand(a, shape, compute), tr.operand(b, shape, compute)
    if alpha is not None and alpha != 1:
        vb = tr.mk(tr.t.Binary("mul", vb, tr.const(alpha, compute)), compute, shape)
    v = tr.mk(tr.t.Binary(op, va, vb), dt, shape)
    if rounding_mode == "trunc":  # a float quotient rounded toward zero, as torch computes it
        v = tr.mk(tr.t.Unary("trunc", v), dt, shape)
    return Computed(v, shape, dt)


handles(*BINARY_TARGETS)(_binary)


def _scalar_to_a_power(tr, base, exponent, shape, dt):
    """``base ** exponent`` for a positive scalar base other than 1: exp2(exponent *
    log2(base)), which is exp2 itself for base 2 (as ``ldexp`` spells it: exact at integer
    exponents) and within a few ulps of eager's powf elsewhere (the product's rounding
    times the result's exponent; validation judges it). NaN, infinities and zeros of the
    exponent come out as pow's. Base 1 (1 whatever the exponent, NaN included) and bases
    of zero or below (signs, exact zeros) stay eager. The base is first rounded to ``dt``
    (eager's common dtype: 3.14159 ** x in bfloat16 is 3.140625 ** x); the rest is computed
    in float32 and rounded once to ``dt``."""
    rounded = torch.tensor(base, dtype=ops.DTYPES[dt]).item()
    if not (rounded > 0 and rounded != 1 and math.isfinite(rounded)):
        raise Unsupported(f"pow of the scalar base {base} to a tensor exponent")
    base = rounded
    wide = "float64" if dt == "float64" else "float32"
    v = tr.operand(exponent, shape, wide)
    if base != 2:
        v = tr.mk(tr.t.Binary("mul", v, tr.const(math.log2(base), wide)), wide, shape)
    return Computed(tr.cast(tr.mk(tr.t.Unary("exp2", v), wide, shape), wide, dt, shape), shape, dt)


@handles(aten.floor_divide)
def _floor_divide(tr, node, a, b):
    if ops.is_float(_out(node)[1]):
        return _float_division(tr, node, a, b, "floordiv")
    return _int_division(tr, node, a, b, "floor")


@handles(aten.remainder, aten.fmod)
def _remainder(tr, node, a, b):
    kind = "fmod" if node.target.overloadpacket is aten.fmod else "remainder"
    if ops.is_float(_out(node)[1]):
        return _float_division(tr, node, a, b, kind)
    return _int_division(tr, node, a, b, kind)


def _float_division(tr, node, a, b, op: str):
    """Floats' ``fmod``, ``remainder`` or ``floordiv`` (a division rounded down), exact as
    torch's (schema/ops.py: the significands' long division), for float32 and the narrower
    floats, which are exact in float32."""
    shape, dt = _out(node)
    if dt == "float64":
        raise Unsupported(f"{op} on float64 (its kernel form divides float32's significands)")
    va, vb = tr.operand(a, shape, dt), tr.operand(b, shape, dt)
    return Computed(tr.mk(tr.t.Binary(op, va, vb), dt, shape), shape, dt)


def _int_division(tr, node, a, b, kind: str):
    """Integer ``a`` divided by a nonzero integer constant ``b``: the quotient rounded toward
    zero (``trunc``) or down (``floor``), the remainder of a's sign (``fmod``) or of b's
    (``remainder``, Python's), as torch computes them, from C's quotient and remainder
    (Triton's // and %). A divisor that is a tensor stays eager: at a zero, eager raises
    on the CPU, where a kernel would hand back a number. Floats: ``_float_division``."""
    shape, dt = _out(node)
    if dt == "bool":
        raise Unsupported(f"{kind} on bool")
    if isinstance(b, bool) or not isinstance(b, int) or b == 0:
        raise Unsupported(f"{kind} by {'a tensor' if not isinstance(b, (int, float)) else repr(b)}: integer "
                          "division by a nonzero constant only (at a zero divisor eager raises)")
    va, vb, zero = tr.operand(a, shape, dt), tr.const(b, dt), tr.const(0, dt)

    def mk(term):
        return tr.mk(term, dt, shape)

    if b == -1:  # C's quotient by -1 overflows at the smallest integer; torch's wraps, as a product does
        q, r = mk(tr.t.Binary("mul", va, vb)), mk(tr.t.Binary("mul", va, zero))
    else:
        q, r = mk(tr.t.Binary("idiv", va, vb)), mk(tr.t.Binary("irem", va, vb))
    # a nonzero remainder of the other sign than b: floor is one below C's quotient, and
    # Python's remainder b more than C's
    off = tr.mk(tr.t.Binary("lt" if b > 0 else "gt", r, zero), "bool", shape)
    if kind == "trunc":
        v = q
    elif kind == "fmod":
        v = r
    elif kind == "floor":
        v = mk(tr.t.Where(off, mk(tr.t.Binary("sub", q, tr.const(1, dt))), q))
    else:
        v = mk(tr.t.Where(off, mk(tr.t.Binary("add", r, vb)), r))
    return Computed(v, shape, dt)


@handles(aten.where)
def _where(tr, node, c, a, b):
    shape, dt = _out(node)
    vc = tr.operand(c, shape, "bool")
    return Computed(tr.mk(tr.t.Where(vc, tr.operand(a, shape, dt), tr.operand(b, shape, dt)), dt, shape),
                    shape, dt)


@handles(aten.nextafter)
def _nextafter(tr, node, a, b):
    """The float next to a toward b, by its bits (float32: a narrower float's next is its own)."""
    shape, dt = _out(node)
    if dt != "float32":
        raise Unsupported(f"nextafter on {dt} (its kernel form steps float32's bits)")
    return Computed(tr.mk(tr.t.Binary("nextafter", tr.operand(a, shape, dt), tr.operand(b, shape, dt)), dt, shape),
                    shape, dt)


@handles(aten.copysign)
def _copysign(tr, node, a, b):
    """|a| with b's sign bit (-0.0 and a NaN carrying it count as negative), by the bits."""
    shape, dt = _out(node)
    if isinstance(a, (int, float)):
        raise Unsupported("copysign of a number")
    dtypes = [a.dtype] + ([] if isinstance(b, (int, float)) else [b.dtype])
    if any(d != "float32" for d in (dt, *dtypes)):
        raise Unsupported(f"copysign of {', '.join(dtypes)} (its kernel form reads float32's bits)")
    v = tr.t.Binary("copysign", tr.operand(a, shape, dt), tr.operand(b, shape, dt))
    return Computed(tr.mk(v, dt, shape), shape, dt)


@handles(aten.clamp, aten.clamp_min, aten.clamp_max)
def _clamp(tr, node, x, lo=None, hi=None, **kw):
    shape, dt = _out(node)
    if node.target.overloadpacket is aten.clamp_max:
        lo, hi = None, lo
    v = tr.operand(x, shape, dt)
    if lo is not None:
        v = tr.mk(tr.t.Binary("maximum", v, tr.operand(lo, shape, dt)), dt, shape)
    if hi is not None:
        v = tr.mk(tr.t.Binary("minimum", v, tr.operand(hi, shape, dt)), dt, shape)
    return Computed(v, shape, dt)


@handles(aten._to_copy, prims.convert_element_type, aten.to)
def _to_copy(tr, node, x, *args, **kw):
    shape, dt = _out(node)
    literal = tr.literal(x)
    if literal is not None:
        # A literal of the code moved to the device (a sliding-window cache's window size,
        # made on the CPU): its value in the new dtype, which no kernel then reads from the CPU
        value = torch.tensor(literal, dtype=ops.DTYPES[x.dtype]).to(ops.DTYPES[dt]).item()
        return Computed(tr.operand(value, shape, dt), shape, dt)
    m = _meta(node)
    if isinstance(x, (BufferView, Computed)) and str(m.device) != str(_meta(node.args[0]).device):
        raise Unsupported("a copy between devices")
    return Computed(tr.cast(tr.value(x), x.dtype, dt, shape), shape, dt)


@handles(aten.copy)
def _copy_into(tr, node, dst, src, non_blocking=False):
    """``aten.copy(dst, src)``, a functionalised ``dst.copy_(src)`` (T5 shifting its labels
    right): ``src``'s values broadcast to ``dst``'s shape, in ``dst``'s dtype."""
    shape, dt = _out(node)
    if tr.literal(src) is not None:
        src = tr.literal(src)  # a literal of the code, on the CPU: its value (T5's start token)
    if isinstance(src, (BufferView, Computed)) and str(_meta(node.args[1]).device) != str(_meta(node).device):
        raise Unsupported("a copy between devices")
    v = tr.operand(src, shape, dt)
    if not isinstance(src, (BufferView, Computed)) and shape:
        v = tr.mk(tr.t.Broadcast(v, tr.ivec(shape)), dt, shape)
    return Computed(v, shape, dt)


@handles(aten.alias, aten.detach)
def _identity(tr, node, x, *args, **kw):
    return x


@handles(aten.clone, aten.lift_fresh_copy, aten.contiguous)
def _copy(tr, node, x, *args, **kw):
    """A copy has the values of ``x`` in a fresh, contiguous layout: views of it no
    longer fold into the strides of ``x``'s buffer."""
    if isinstance(x, BufferView):
        return BufferView(x.buf, x.shape, x.strides, x.offset, x.dtype, foldable=False)
    return x


@handles(aten.full, aten.scalar_tensor, aten.full_like, aten.zeros_like, aten.ones_like)
def _full(tr, node, *args, **kw):
    shape, dt = _out(node)
    pk = node.target.overloadpacket
    value = {aten.full: lambda: args[1], aten.scalar_tensor: lambda: args[0],
             aten.full_like: lambda: args[1], aten.zeros_like: lambda: 0,
             aten.ones_like: lambda: 1}[pk]()
    return _filled(tr, value, shape, dt)


@handles(aten.arange)
def _arange(tr, node, *args, **kw):
    shape, dt = _out(node)
    nums = [a for a in args if isinstance(a, (int, float))]
    start, step = (0, 1)
    if len(nums) >= 2:
        start = nums[0]
    if len(nums) >= 3:
        step = nums[2]
    v = tr.mk(tr.t.Iota(tr.ivec(shape), 0), "int64", shape)
    v = tr.cast(v, "int64", dt, shape)
    if step != 1:
        v = tr.mk(tr.t.Binary("mul", v, tr.const(step, dt)), dt, shape)
    if start != 0:
        v = tr.mk(tr.t.Binary("add", v, tr.const(start, dt)), dt, shape)
    return Computed(v, shape, dt)


# --- reductions ------------------------------------------------------------------------------

def _reduce(tr, x, dims, keepdim: bool, op: str, out_dtype: str, out_shape):
    """Reduce ``x`` over ``dims``: permute the reduced dims last, flatten them, reduce the last axis."""
    t = tr.t
    shape = tuple(x.shape)
    rank = len(shape)
    dims = sorted({d % rank for d in dims}) if rank and dims else list(range(rank))
    v = tr.cast(tr.value(x), x.dtype, out_dtype, shape)
    if rank == 0:
        v = tr.mk(t.Reshape(v, tr.ivec((1, 1))), out_dtype, (1, 1))
        kept, red = [], [1]
    else:
        kept = [d for d in range(rank) if d not in dims]
        perm = kept + dims
        if perm != list(range(rank)):
            v = tr.mk(t.Permute(v, tr.ivec(perm)), out_dtype, tuple(shape[d] for d in perm))
        red_n = math.prod(shape[d] for d in dims)
        flat = tuple(shape[d] for d in kept) + (red_n,)
        if not kept:
            flat = (1, red_n)
        if flat != tuple(shape[d] for d in perm):
            v = tr.mk(t.Reshape(v, tr.ivec(flat)), out_dtype, flat)
        red = [red_n]
    reduced_shape = tuple(shape[d] for d in kept) + (1,) if kept else (1, 1)
    r = tr.mk(t.Reduce(op, v), out_dtype, reduced_shape)
    if tuple(out_shape) != reduced_shape:
        r = tr.mk(t.Reshape(r, tr.ivec(out_shape)), out_dtype, out_shape)
    return Computed(r, tuple(out_shape), out_dtype), red[0]


def _reduce_args(node, x, dims=None, keepdim=False, **kw):
    if dims is None:
        dims = []
    if isinstance(dims, int):
        dims = [dims]
    return list(dims), bool(keepdim)


@handles(aten.sum, prims.sum)
def _sum(tr, node, x, dims=None, keepdim=False, dtype=None, **kw):
    shape, dt = _out(node)
    dims, keepdim = _reduce_args(node, x, dims, keepdim)
    return _reduce(tr, x, dims, keepdim, "sum", dt, shape)[0]


@handles(aten.amax, aten.amin)
def _amax(tr, node, x, dims=None, keepdim=False):
    shape, dt = _out(node)
    dims, keepdim = _reduce_args(node, x, dims, keepdim)
    op = "max" if node.target.overloadpacket is aten.amax else "min"
    return _reduce(tr, x, dims, keepdim, op, dt, shape)[0]


@handles(aten.prod)
def _prod(tr, node, x, dim=None, keepdim=False, dtype=None):
    shape, dt = _out(node)
    if not ops.is_float(dt):
        raise Unsupported("prod of integers (a float32 product of partial rows would round them)")
    dims, keepdim = _reduce_args(node, x, dim, keepdim)
    return _reduce(tr, x, dims, keepdim, "prod", dt, shape)[0]


@handles(aten.any, aten.all)
def _any_all(tr, node, x, dims=None, keepdim=False):
    """any: the count of nonzero elements is nonzero; all: the count of zeros is zero.
    Counted in float32 (exact to 2^24, and a count never returns to 0), so that a NaN is
    true, as in torch, and a reduction over no elements gives any False and all True
    (a max of flags would give -inf there)."""
    shape, _ = _out(node)
    dims, keepdim = _reduce_args(node, x, dims, keepdim)
    t = tr.t
    test = "ne" if node.target.overloadpacket is aten.any else "eq"
    flags = tr.mk(t.Binary(test, tr.operand(x, x.shape, "float32"), tr.const(0, "float32")), "bool", tuple(x.shape))
    count, _ = _reduce(tr, Computed(flags, tuple(x.shape), "bool"), dims, keepdim, "sum", "float32", shape)
    return Computed(tr.mk(t.Binary(test, count.term, tr.const(0, "float32")), "bool", shape), shape, "bool")


@handles(aten.mean)
def _mean(tr, node, x, dims=None, keepdim=False, dtype=None):
    shape, dt = _out(node)
    if not ops.is_float(dt):
        raise Unsupported("mean of integers")
    dims, keepdim = _reduce_args(node, x, dims, keepdim)
    s, n = _reduce(tr, x, dims, keepdim, "sum", dt, shape)
    return Computed(tr.mk(tr.t.Binary("div", s.term, tr.const(n, dt)), dt, shape), shape, dt)


@handles(prims.var)
def _var(tr, node, x, dims, correction=0.0, **kw):
    """Two-pass variance: mean first, then the mean of squared deviations (stable)."""
    shape, dt = _out(node)
    t = tr.t
    rank = len(x.shape)
    keep_shape = tuple(1 if (d in [e % rank for e in dims]) else s for d, s in enumerate(x.shape))
    s, n = _reduce(tr, x, dims, True, "sum", dt, keep_shape)
    mean = tr.mk(t.Binary("div", s.term, tr.const(n, dt)), dt, keep_shape)
    xv = tr.cast(tr.value(x), x.dtype, dt, x.shape)
    dev = tr.mk(t.Binary("sub", xv, tr.mk(t.Broadcast(mean, tr.ivec(x.shape)), dt, x.shape)), dt, x.shape)
    sq = tr.mk(t.Binary("mul", dev, dev), dt, x.shape)
    ss, _ = _reduce(tr, Computed(sq, tuple(x.shape), dt), dims, False, "sum", dt, shape)
    return Computed(tr.mk(t.Binary("div", ss.term, tr.const(max(n - correction, 0), dt)), dt, shape), shape, dt)


# --- views -----------------------------------------------------------------------------------

def _view(tr, node, x, make_term):
    """A view: folds into the strides of an input buffer, else an index-map term."""
    shape, dt = _out(node)
    m = _meta(node)
    if isinstance(x, BufferView) and x.foldable:
        base = _meta(node.args[0])
        offset = x.offset + (m.storage_offset() - base.storage_offset())
        return BufferView(x.buf, shape, tuple(m.stride()), offset, dt, True)
    v = tr.value(x)
    return Computed(tr.mk(make_term(v, shape), dt, shape), shape, dt)


def _reshape_term(tr):
    return lambda v, shape: tr.t.Reshape(v, tr.ivec(shape))


@handles(aten.view, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze, aten.flatten,
         aten.unflatten)
def _reshape(tr, node, x, *args, **kw):
    return _view(tr, node, x, _reshape_term(tr))


@handles(aten.diagonal)
def _diagonal(tr, node, x, *args, **kw):
    """A diagonal of an input buffer: a view, folded into its strides as any view is (of a
    computed value, no index map of the schema reads one)."""
    if isinstance(x, BufferView) and x.foldable:
        return _view(tr, node, x, None)
    raise Unsupported("diagonal of a computed value")


@handles(aten.as_strided)
def _as_strided(tr, node, x, size, stride, storage_offset=None):
    """A view at given strides: folded into an input buffer's strides, as any view is; of
    a computed value, only where it reads the value's elements in their order from the
    start (the strides of ``size`` laid out contiguously, over every element of a value
    laid out so): a reshape. Group norm's decomposition on the CPU views its per-channel
    scales so."""
    base = _meta(node.args[0])
    offset = base.storage_offset() if storage_offset is None else storage_offset
    in_order = (base.is_contiguous() and offset == base.storage_offset() and math.prod(size) == base.numel()
                and tuple(stride) == contiguous_strides(tuple(size)))
    if not (in_order or (isinstance(x, BufferView) and x.foldable)):
        raise Unsupported("as_strided of a computed value other than as a reshape")
    return _view(tr, node, x, _reshape_term(tr))  # folds where it can


@handles(aten.expand)
def _expand(tr, node, x, *args, **kw):
    return _view(tr, node, x, lambda v, shape: tr.t.Broadcast(v, tr.ivec(shape)))


@handles(prims.broadcast_in_dim)
def _broadcast_in_dim(tr, node, x, shape, bdims):
    # Insert the missing dims as size 1, then broadcast.
    inter = [1] * len(shape)
    for src, d in enumerate(bdims):
        inter[d] = x.shape[src]
    t = tr.t
    v = tr.value(x)
    if tuple(inter) != tuple(x.shape):
        v = tr.mk(t.Reshape(v, tr.ivec(inter)), x.dtype, tuple(inter))
    if tuple(inter) != tuple(shape):
        v = tr.mk(t.Broadcast(v, tr.ivec(shape)), x.dtype, tuple(shape))
    return Computed(v, tuple(shape), x.dtype)


@handles(aten.permute, aten.transpose, aten.t, aten.numpy_T)
def _permute(tr, node, x, *args, **kw):
    rank = len(x.shape)
    pk = node.target.overloadpacket
    if pk is aten.permute:
        perm = [d % rank for d in args[0]]
    elif pk is aten.transpose:
        perm = list(range(rank))
        a, b = args[0] % rank, args[1] % rank
        perm[a], perm[b] = perm[b], perm[a]
    else:
        perm = list(reversed(range(rank)))
    return _view(tr, node, x, lambda v, shape: tr.t.Permute(v, tr.ivec(perm)))


def _norm_start(start, size):
    if start is None:
        return 0
    if start < 0:
        start += size
    return min(max(start, 0), size)


@handles(aten.slice)
def _slice(tr, node, x, dim=0, start=None, end=None, step=1):
    dim = dim % len(x.shape)
    s0 = _norm_start(start, x.shape[dim])
    shape, _ = _out(node)
    return _view(tr, node, x, lambda v, sh: tr.t.Slice(v, dim, s0, step, shape[dim]))


@handles(aten.select)
def _select(tr, node, x, dim, index):
    dim = dim % len(x.shape)
    index = index % x.shape[dim]
    t = tr.t

    def term(v, shape):
        sliced_shape = tuple(1 if d == dim else s for d, s in enumerate(x.shape))
        sliced = tr.mk(t.Slice(v, dim, index, 1, 1), x.dtype, sliced_shape)
        return t.Reshape(sliced, tr.ivec(shape))
    return _view(tr, node, x, term)


def _concat(tr, parts, dim: int, dt: str) -> Computed:
    """``parts`` (entries of one rank) joined along ``dim``, cast to ``dt``."""
    v = tr.cast(tr.value(parts[0]), parts[0].dtype, dt, parts[0].shape)
    sofar = list(parts[0].shape)
    for p in parts[1:]:
        sofar[dim] += p.shape[dim]
        v = tr.mk(tr.t.Cat(v, tr.cast(tr.value(p), p.dtype, dt, p.shape), dim), dt, tuple(sofar))
    return Computed(v, tuple(sofar), dt)


@handles(aten.cat)
def _cat(tr, node, tensors, dim=0):
    shape, dt = _out(node)
    parts = [p for p in tensors if math.prod(p.shape) > 0 or len(p.shape) == len(shape)]
    parts = [p for p in parts if len(p.shape) == len(shape)]
    dim = dim % len(shape)
    if not parts:
        raise Unsupported("cat of nothing")
    return _concat(tr, parts, dim, dt)


def _part(tr, x, dim: int, start: int, size: int):
    """``x`` narrowed to ``[start, start + size)`` along ``dim``: a strided view of an
    input buffer, else a ``Slice`` term."""
    sub_shape = list(x.shape)
    sub_shape[dim] = size
    if isinstance(x, BufferView) and x.foldable:
        offset = x.offset + start * x.strides[dim]
        return BufferView(x.buf, tuple(sub_shape), x.strides, offset, x.dtype, True)
    term = tr.mk(tr.t.Slice(tr.value(x), dim, start, 1, size), x.dtype, tuple(sub_shape))
    return Computed(term, tuple(sub_shape), x.dtype)


# --- indexing: reads at indices the kernel loads ----------------------------------------------

def _index_entry(index) -> None:
    if not isinstance(index, (BufferView, Computed)) or not ops.is_int(index.dtype):
        raise Unsupported("an index that is not an integer tensor")


def _take(tr, x, dim: int, index) -> Computed:
    """``x``'s slices along ``dim`` at the values of ``index`` (any shape, flattened), as
    ``index_select``."""
    _index_entry(index)
    if not x.shape:  # a scalar's index_select: the scalar as one element
        x = _shaped(tr, Computed(tr.value(x), (), x.dtype), (1,))
    n = math.prod(index.shape)
    t = tr.t
    iv = tr.value(index)
    if tuple(index.shape) != (n,):
        iv = tr.mk(t.Reshape(iv, tr.ivec((n,))), index.dtype, (n,))
    shape = tuple(n if d == dim else s for d, s in enumerate(x.shape))
    lined = tuple(n if d == dim else 1 for d in range(len(shape)))
    if lined != (n,):
        iv = tr.mk(t.Reshape(iv, tr.ivec(lined)), index.dtype, lined)
    if lined != shape:
        iv = tr.mk(t.Broadcast(iv, tr.ivec(shape)), index.dtype, shape)
    return Computed(tr.mk(t.Gather(tr.value(x), iv, dim), x.dtype, shape), shape, x.dtype)


def _shaped(tr, entry: Computed, shape) -> Computed:
    shape = tuple(shape)
    if tuple(entry.shape) == shape:
        return entry
    return Computed(tr.mk(tr.t.Reshape(entry.term, tr.ivec(shape)), entry.dtype, shape), shape, entry.dtype)


@handles(aten.index_select)
def _index_select(tr, node, x, dim, index):
    return _shaped(tr, _take(tr, x, dim % max(1, len(x.shape)), index), _out(node)[0])


@handles(aten.embedding)
def _embedding(tr, node, weight, indices, *args, **kw):
    """A table's rows at the indices (padding_idx and the rest change only the backward)."""
    return _shaped(tr, _take(tr, weight, 0, indices), _out(node)[0])


@handles(aten.index)
def _index(tr, node, x, indices):
    """``x[..., i, j, ...]``: integer index tensors at adjacent dims after full slices
    (``None`` entries), broadcast together: one index into those dims merged (an index
    outside its dim reads NaN, as one outside the table does). Apart (their result's
    dims move to the front) or a mask: eager."""
    given = [d for d, i in enumerate(indices) if i is not None]
    if not given or given != list(range(given[0], given[-1] + 1)):
        raise Unsupported(f"indexing with {len(given)} index tensors apart")
    for i in (indices[d] for d in given):
        _index_entry(i)
    merged = _merged_index(tr, x, given, [indices[d] for d in given])
    k, sizes = given[0], [x.shape[d] for d in given]
    flat_shape = tuple(x.shape[:k]) + (math.prod(sizes),) + tuple(x.shape[given[-1] + 1:])
    flat = _shaped(tr, Computed(tr.value(x), tuple(x.shape), x.dtype), flat_shape)
    return _shaped(tr, _take(tr, flat, k, merged), _out(node)[0])


def _merged_index(tr, x, dims: list, indices: list) -> Computed:
    """The index into ``x``'s ``dims`` merged (row-major) of the index tensors
    ``indices``, broadcast together; -1 (outside) where one is outside its dim."""
    t = tr.t
    shape = tuple(torch.broadcast_shapes(*[tuple(i.shape) for i in indices]))
    merged = inside = None
    for d, index in zip(dims, indices):
        n = x.shape[d]
        v = tr.operand(_ranked(tr, index, len(shape)), shape, "int64")
        negative = tr.mk(t.Binary("lt", v, tr.const(0, "int64")), "bool", shape)
        v = tr.mk(t.Where(negative, tr.mk(t.Binary("add", v, tr.const(n, "int64")), "int64", shape), v), "int64", shape)
        ok = tr.mk(t.Binary("and", tr.mk(t.Binary("ge", v, tr.const(0, "int64")), "bool", shape),
                            tr.mk(t.Binary("lt", v, tr.const(n, "int64")), "bool", shape)), "bool", shape)
        inside = ok if inside is None else tr.mk(t.Binary("and", inside, ok), "bool", shape)
        if merged is not None:
            merged = tr.mk(t.Binary("mul", merged, tr.const(n, "int64")), "int64", shape)
            v = tr.mk(t.Binary("add", merged, v), "int64", shape)
        merged = v
    merged = tr.mk(t.Where(inside, merged, tr.const(-1, "int64")), "int64", shape)
    return Computed(merged, shape, "int64")


def _ranked(tr, entry, rank: int):
    """``entry`` with leading dims of 1 up to ``rank`` (broadcasting aligns from the right)."""
    if len(entry.shape) == rank:
        return entry
    shape = (1,) * (rank - len(entry.shape)) + tuple(entry.shape)
    return Computed(tr.mk(tr.t.Reshape(tr.value(entry), tr.ivec(shape)), entry.dtype, shape), shape, entry.dtype)


def _gathered(tr, x, dim: int, index) -> Computed:
    """``torch.gather``: ``x`` (narrowed to ``index``'s extent in the other dims) read
    along ``dim`` at ``index``."""
    _index_entry(index)
    if len(index.shape) != len(x.shape) or not x.shape:
        raise Unsupported("gather of a scalar or across ranks")
    for d, size in enumerate(index.shape):
        if d != dim and size != x.shape[d]:
            x = _part(tr, x, d, 0, size)
    shape = tuple(index.shape)
    return Computed(tr.mk(tr.t.Gather(tr.value(x), tr.value(index), dim), x.dtype, shape), shape, x.dtype)


@handles(aten.constant_pad_nd)
def _constant_pad_nd(tr, node, x, pad, value=0):
    """``F.pad(x, pad, value=value)``: along each dim ``pad`` names (the last dim first, a
    (before, after) pair each), ``x`` narrowed where a pad is negative and joined between
    blocks of ``value`` where it is positive."""
    shape, dt = _out(node)
    if not math.prod(shape) or not math.prod(x.shape):
        raise Unsupported("a pad to or of an empty tensor")
    out = x
    for i in range(len(pad) // 2):
        dim = len(x.shape) - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        start = max(-before, 0)
        size = out.shape[dim] - start - max(-after, 0)
        if size <= 0:
            raise Unsupported("a pad that cuts a dim away")
        if size != out.shape[dim]:
            out = _part(tr, out, dim, start, size)
        if before > 0 or after > 0:
            blocks = [_filled(tr, value, tuple(w if d == dim else n for d, n in enumerate(out.shape)), dt)
                      for w in (before, after)]
            parts = [blocks[0]] * (before > 0) + [out] + [blocks[1]] * (after > 0)
            out = _concat(tr, parts, dim, dt)
    return Computed(tr.cast(tr.value(out), out.dtype, dt, shape), shape, dt)


def _filled(tr, value, shape, dt: str) -> Computed:
    """``value`` broadcast to ``shape``, in ``dt``."""
    v = tr.const(value, dt)
    return Computed(tr.mk(tr.t.Broadcast(v, tr.ivec(shape)), dt, shape) if shape else v, shape, dt)


@handles(aten.split, aten.split_with_sizes)
def _split(tr, node, x, sizes, dim=0):
    dim = dim % len(x.shape)
    n = x.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)] or [0]
    out, start = [], 0
    for size in sizes:
        out.append(_part(tr, x, dim, start, size))
        start += size
    return out


@handles(aten.slice_scatter)
def _slice_scatter(tr, node, base, src, dim=0, start=None, end=None, step=1):
    """``base`` with ``src`` written over ``base[start:end]`` along ``dim``: with step 1 it
    is ``cat(base[:start], src, base[end:])`` (the backward of slicing and of split, where
    ``base`` is zeros). Empty parts are left out."""
    if step != 1:
        raise Unsupported(f"slice_scatter with step {step} (only step 1 is a concatenation)")
    shape, dt = _out(node)
    dim = dim % len(shape)
    return _written_over(tr, base, src, dim, _norm_start(start, shape[dim]), dt)


@handles(aten.select_scatter)
def _select_scatter(tr, node, base, src, dim, index):
    """``base`` with ``src`` written over ``base.select(dim, index)``: a slice_scatter of
    ``src`` with ``dim`` put back as size 1."""
    shape, dt = _out(node)
    dim = dim % len(shape)
    if not isinstance(src, (BufferView, Computed)):
        raise Unsupported("select_scatter of a non-tensor")
    one = (*shape[:dim], 1, *shape[dim + 1:])
    row = Computed(tr.mk(tr.t.Reshape(tr.value(src), tr.ivec(one)), src.dtype, one), one, src.dtype)
    return _written_over(tr, base, row, dim, index % shape[dim], dt)


def _written_over(tr, base, src, dim: int, lo: int, dt: str) -> Computed:
    """``base`` with ``src`` over ``[lo, lo + len)`` along ``dim``: the concatenation of
    ``base``'s parts around it and ``src``, empty parts left out."""
    for x in (base, src):
        if not isinstance(x, (BufferView, Computed)):
            raise Unsupported("a scatter of a non-tensor")
    hi = lo + src.shape[dim]  # src has exactly the sliced extent (torch checks it)
    parts = [_part(tr, base, dim, 0, lo), src, _part(tr, base, dim, hi, base.shape[dim] - hi)]
    parts = [p for p in parts if p.shape[dim] > 0]
    if not parts:  # an empty tensor: any part states it
        parts = [src]
    return _concat(tr, parts, dim, dt)


# --- matrix products -------------------------------------------------------------------------
# Capture decomposes matmul, @, linear and einsum into mm / bmm / addmm with views around
# them; a transpose of an input folds into the strides the kernel reads it with.

MATMUL_DTYPES = ("float32", "float16", "bfloat16")


def _dot(tr, node, a, b, shape=None) -> Computed:
    dt = _out(node)[1]
    shape = shape or _out(node)[0]
    for x in (a, b):
        if not isinstance(x, (BufferView, Computed)):
            raise Unsupported("matmul of a non-tensor")
    if a.dtype != b.dtype:
        raise Unsupported(f"matmul of {a.dtype} by {b.dtype}")
    if dt not in MATMUL_DTYPES:
        raise Unsupported(f"matmul of {dt} (eqfuse kernels take {', '.join(MATMUL_DTYPES)})")
    if a.shape[-1] == 0:
        raise Unsupported("matmul over an empty dimension")
    return Computed(tr.mk(tr.t.Dot(tr.value(a), tr.value(b)), dt, shape), shape, dt)


@handles(aten.mm, aten.bmm)
def _mm(tr, node, a, b):
    batched = _unflattened_batch(tr, node)
    if batched is None:
        return _dot(tr, node, a, b)
    # torch's matmul flattens the batch dims of both operands into one for bmm and views
    # the result back: the product is stated over the batch dims themselves, so that rules
    # meet the operands as computed (the softmax feeding attention's second product).
    a4, b4 = batched
    d = _dot(tr, node, a4, b4, a4.shape[:-1] + b4.shape[-1:])
    shape, dt = _out(node)
    return Computed(tr.mk(tr.t.Reshape(d.term, tr.ivec(shape)), dt, shape), shape, dt)


_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def _unflattened_batch(tr, node):
    """For ``bmm(view(a), view(b))`` where both views only merge the batch dims of a and b
    (same batch shape, rank > 3): the entries of a and b. None otherwise."""
    if node.target is not aten.bmm.default:
        return None
    sources = []
    for arg in node.args[:2]:
        if not (isinstance(arg, torch.fx.Node) and arg.target in _VIEWS):
            return None
        src = arg.args[0]
        inner, outer = _meta(src), _meta(arg)
        if inner is None or inner.dim() <= 3 or tuple(inner.shape[-2:]) != tuple(outer.shape[-2:]):
            return None
        sources.append(src)
    a, b = (_meta(s) for s in sources)
    if tuple(a.shape[:-2]) != tuple(b.shape[:-2]):
        return None
    return tuple(tr.env[s] for s in sources)


@handles(aten.addmm, aten.baddbmm)
def _addmm(tr, node, bias, a, b, beta=1, alpha=1):
    """beta * bias + alpha * (a @ b); a zero beta ignores the bias (NaN included), as torch does."""
    d = _dot(tr, node, a, b)
    shape, dt = d.shape, d.dtype
    v = d.term
    if alpha != 1:
        v = tr.mk(tr.t.Binary("mul", v, tr.const(alpha, dt)), dt, shape)
    if beta != 0:
        bv = tr.operand(bias, shape, dt)
        if beta != 1:
            bv = tr.mk(tr.t.Binary("mul", bv, tr.const(beta, dt)), dt, shape)
        v = tr.mk(tr.t.Binary("add", v, bv), dt, shape)
    return Computed(v, shape, dt)


# --- one element per row along a dim: gather and scatter as selects ------------------------
# Where the index has one element along ``dim`` (cross-entropy's target: nll_loss reads
# -logp[i, target[i]] with gather, and its backward writes into zeros with scatter), the
# op is a select against the iota along ``dim``: pointwise (scatter) or a row sum (gather),
# which fuse into the kernels around them (the log-softmax's, its backward's) instead of
# running in eager over a vocabulary-wide tensor.

def _one_per_row(x, index, dim: int) -> int | None:
    """``dim`` (normalised) where ``index`` has one element along it and ``x``'s sizes
    along the others; None otherwise."""
    if not isinstance(index, (BufferView, Computed)) or not isinstance(x, (BufferView, Computed)):
        return None
    if len(index.shape) != len(x.shape) or not x.shape:
        return None
    dim %= len(x.shape)
    same = all(i == s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != dim)
    return dim if same and index.shape[dim] == 1 and index.dtype in ("int64", "int32") else None


def _is_index(tr, x, index, dim: int):
    """A bool Value of ``x``'s shape: True where the position along ``dim`` is ``index``'s."""
    shape = tuple(x.shape)
    iota = tr.mk(tr.t.Iota(tr.ivec(shape), dim), "int64", shape)
    return tr.mk(tr.t.Binary("eq", iota, tr.operand(index, shape, "int64")), "bool", shape)


_ZERO = {True: -0.0, False: 0}  # the sum's identity: -0.0 + x is x, the sign of a zero too


@handles(aten.gather)
def _gather(tr, node, x, dim, index, sparse_grad=False):
    """``x.gather(dim, index)`` with one index per row: the row's sum of ``x`` where the
    position is the index, -0.0 elsewhere (exact: one value and zeros; NaN or inf elsewhere
    in the row are not selected), which fuses into the row's other reductions (a
    cross-entropy's log-softmax). A -0.0 selected comes back +0.0, as from every sum of
    eqfuse's kernels (their reductions start at +0.0). Otherwise an indirect read (``_gathered``)."""
    one = _one_per_row(x, index, dim)
    shape, dt = _out(node)
    if one is None or not (ops.is_float(dt) or dt in ("int64", "int32")):
        return _gathered(tr, x, dim % max(1, len(x.shape)), index)
    dim = one
    fill = tr.const(_ZERO[ops.is_float(dt)], dt)
    picked = tr.mk(tr.t.Where(_is_index(tr, x, index, dim), tr.operand(x, x.shape, dt), fill), dt, tuple(x.shape))
    return _reduce(tr, Computed(picked, tuple(x.shape), dt), [dim], True, "sum", dt, shape)[0]


@handles(aten.scatter)
def _scatter(tr, node, base, dim, index, src, reduce=None):
    """``base.scatter(dim, index, src)`` with one index per row (src a scalar, or shaped
    as the index): ``src`` where the position along ``dim`` is the index, ``base`` elsewhere."""
    dim = _one_per_row(base, index, dim)
    shape, dt = _out(node)
    if reduce is not None or dim is None:
        raise Unsupported("scatter with more than one index per row, past CUMSUM_WORK comparisons of positions "
                          "with indices (frontend/decompose.py), or of bools")
    if isinstance(src, (BufferView, Computed)) and tuple(src.shape) != tuple(index.shape):
        raise Unsupported("scatter of a source larger than its index")
    value = tr.operand(src, shape, dt)
    return Computed(tr.mk(tr.t.Where(_is_index(tr, base, index, dim), value, tr.operand(base, shape, dt)), dt, shape),
                    shape, dt)


@handles(aten.index_put)
def _index_put(tr, node, x, indices, values, accumulate=False):
    """``x.index_put(indices, values)`` at one position along one dim (a static cache's
    update at a decode step's position, ``index_copy`` decomposed): ``values`` there, ``x``
    elsewhere (``x`` plus them where accumulating), pointwise. A position outside ``x``
    (eager raises) gives NaN throughout. Several positions along one dim arrive here only
    where frontend/decompose.py declined them, and run in eager."""
    given = [d for d, i in enumerate(indices) if i is not None]
    shape, dt = _out(node)
    if len(given) != 1 or len(indices[given[0]].shape) > 1 or math.prod(indices[given[0]].shape) != 1:
        raise Unsupported("index_put at several positions that no kernel form takes (a boolean mask, index tensors "
                          "at several dims or of several dims, or more positions times indices than CUMSUM_WORK)")
    (dim,) = given
    index = indices[dim]
    _index_entry(index)
    t = tr.t
    slot = tuple(1 if d == dim else s for d, s in enumerate(shape))
    if not isinstance(values, (BufferView, Computed)) or len(values.shape) > len(slot) or not _broadcastable_to(
            values.shape, slot):
        raise Unsupported("index_put of values shaped otherwise than the position they fill")
    v = tr.operand(_ranked(tr, values, len(slot)), slot, dt)
    if slot != shape:
        v = tr.mk(t.Broadcast(v, tr.ivec(shape)), dt, shape)
    ones = (1,) * len(shape)
    position = _merged_index(tr, x, [dim], [index])  # -1 where outside
    p = tr.mk(t.Broadcast(tr.mk(t.Reshape(position.term, tr.ivec(ones)), "int64", ones), tr.ivec(shape)),
              "int64", shape)
    here = tr.mk(t.Binary("eq", tr.mk(t.Iota(tr.ivec(shape), dim), "int64", shape), p), "bool", shape)
    base = tr.operand(x, shape, dt)
    new = tr.mk(t.Binary("add", base, v), dt, shape) if accumulate else v
    out = tr.mk(t.Where(here, new, base), dt, shape)
    if ops.is_float(dt):
        outside = tr.mk(t.Binary("lt", p, tr.const(0, "int64")), "bool", shape)
        out = tr.mk(t.Where(outside, tr.const(math.nan, dt), out), dt, shape)
    return Computed(out, shape, dt)


def _broadcastable_to(shape, target) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (aligned from the right)."""
    return all(s in (1, g) for s, g in zip(reversed(tuple(shape)), reversed(tuple(target))))


# Handlers that only move values (views, copies, concatenations): under
# emulate_precision_casts their results need no rounding, their operands having had theirs,
# and a rounding left out keeps the views rules free to compose them.
MOVES = frozenset({_reshape, _expand, _broadcast_in_dim, _permute, _slice, _select, _cat, _identity, _copy})
