"""Extraction: the saturated e-graph -> the cheapest legal plan, in Python.

1. Type every value e-class (shape, dtype) from its nodes.
2. Choose, for each e-class, its cheapest way to compute the value *inline* (ignoring the
   ``Load(Kernel(self))`` node, which is the option of storing it): strictly positive
   costs make these choices acyclic.
3. Decide which e-classes are materialised (get a kernel and a buffer); every other
   e-class is recomputed inside the kernels that use it. Graph outputs and the arguments
   of eager fallbacks must be materialised. Start from the most fused plan, repair
   kernels the code generator cannot schedule (legality is re-checked on the whole
   kernel, not trusted from a rule's guard), then improve greedily under the cost model.
4. Multi-output kernels: a materialised value may be stored by a kernel that computes it
   inline anyway (the residual in residual+LayerNorm), dropping its own kernel, when that
   is legal, keeps the plan acyclic and is cheaper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import networkx as nx

from ..codegen.kernel import generate
from ..errors import ExtractionError, Unschedulable
from ..schema import ops
from ..schema.plan import BufArg, Buffer, FallbackStep, KernelSpec, Plan, PNode, contiguous_strides
from ..schema.terms import bits_float, buffer_name, dtype_name
from .cost import Device, device_model, kernel_time_us
from .egraph_json import EGraphView, ENode

OP_COST = {"Load": 1.0, "LoadStrided": 1.0, "Const": 0.01, "Iota": 0.1, "Where": 1.0, "Cast": 0.5,
           "Reduce": 2.0, "Broadcast": 0.05, "Reshape": 0.05, "Permute": 0.05, "Slice": 0.05, "Cat": 1.0,
           "Dot": 2.0, "ExpDot": 3.0, "ExpSum": 2.0}
# A matmul kernel evaluates its operands once per output tile they meet: an operand of
# [M, K] is computed about N / DOT_TILE times. Work moves to the epilogue when that is cheaper.
DOT_TILE = 128


def node_cost(n: ENode) -> float:
    table = {"Unary": ops.UNARY, "Binary": ops.BINARY}.get(n.op)
    if table is not None:
        if n.args[0] not in table:
            raise ExtractionError(f"the e-graph holds an unknown {n.op.lower()} op {n.args[0]!r}", retry=True)
        return table[n.args[0]].cost
    return OP_COST.get(n.op, 1.0)


def _dtype(code) -> str:
    if not isinstance(code, int) or not 0 <= code < len(ops.DTYPES):
        raise ExtractionError(f"the e-graph holds an unknown dtype code {code!r}", retry=True)
    return dtype_name(code)


def _broadcast_shapes(*shapes):
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        dims = [s[k - rank + len(s)] for s in shapes if k - rank + len(s) >= 0]
        big = [d for d in dims if d != 1]
        out.append(big[0] if big else 1)
    return tuple(out)


class Extractor:
    def __init__(self, view: EGraphView, translation, device: Device | None = None):
        self.g = view
        self.tr = translation
        self.device = device or device_model()
        self.kernel_of: dict[str, str] = {}  # value class -> Tensor class holding Kernel(value)
        self.tensor_node: dict[str, ENode] = {}  # Tensor class -> its Kernel / Input node
        for cid, nodes in view.classes.items():
            for n in nodes:
                if n.op == "Kernel":
                    self.kernel_of.setdefault(n.args[0], cid)
                    self.tensor_node.setdefault(cid, n)
                elif n.op == "Input":
                    self.tensor_node[cid] = n
        self.types = self._infer_types()
        self.out_strides: dict[str, tuple] = {}
        for o in translation.outputs:
            if o[0] == "value" and o[4] is not None:
                self.out_strides.setdefault(view.lets[o[1]], tuple(o[4]))
        self._buffer_names: dict[str, str] = {}
        self._fx_names: dict[str, list[str]] = {}
        for name, cid in view.lets.items():
            if name.startswith("n_"):
                self._fx_names.setdefault(cid, []).append(name[2:])
        self.best = self._inline_choices()
        self._regions: dict[str, frozenset] = {}
        self._kernels: dict = {}  # (root, hosted, M within reach) -> (spec, inline, loads, reads)
        self._fallbacks: dict | None = None  # the eager steps, the same in every plan
        self._fallback_reads: dict = {}  # and the buffers each reads

    # --- 1. types ------------------------------------------------------------------------------
    def _type_of_node(self, n: ENode, types):
        a = n.args

        def t(c):
            return types.get(c)
        op = n.op
        if op == "LoadStrided":
            inp = self.tensor_node.get(a[0])
            return (tuple(a[1]), _dtype(inp.args[1])) if inp is not None and inp.op == "Input" else None
        if op == "Load":
            k = self.tensor_node.get(a[0])
            return t(k.args[0]) if k is not None and k.op == "Kernel" else None
        if op == "Const":
            return ((), _dtype(a[1]))
        if op == "Iota":
            return (tuple(a[0]), "int64")
        if op == "Unary":
            x = t(a[1])
            return x and (x[0], "bool" if a[0] in ops.BOOL_UNARY else x[1])
        if op == "Binary":
            x, y = t(a[1]), t(a[2])
            return x and y and (_broadcast_shapes(x[0], y[0]), "bool" if a[0] in ops.COMPARISONS else x[1])
        if op == "Where":
            c, x, y = t(a[0]), t(a[1]), t(a[2])
            return c and x and y and (_broadcast_shapes(c[0], x[0], y[0]), x[1])
        if op == "Cast":
            x = t(a[0])
            return x and (x[0], _dtype(a[1]))
        if op == "Reduce":
            x = t(a[1])
            return x and (x[0][:-1] + (1,), x[1])
        if op == "Dot":
            x, y = t(a[0]), t(a[1])
            return x and y and (x[0][:-1] + y[0][-1:], x[1])
        if op == "ExpDot":
            x, y = t(a[0]), t(a[1])
            return x and y and (x[0][:-1] + y[0][-1:], y[1])
        if op == "ExpSum":
            x = t(a[0])
            return x and (x[0][:-1] + (1,), x[1])
        if op in ("Broadcast", "Reshape"):
            x = t(a[0])
            return x and (tuple(a[1]), x[1])
        if op == "Permute":
            x = t(a[0])
            return x and (tuple(x[0][p] for p in a[1]), x[1])
        if op == "Slice":
            x = t(a[0])
            if not x:
                return None
            shape = list(x[0])
            shape[a[1]] = a[4]
            return (tuple(shape), x[1])
        if op == "Cat":
            x, y = t(a[0]), t(a[1])
            if not (x and y):
                return None
            shape = list(x[0])
            shape[a[2]] += y[0][a[2]]
            return (tuple(shape), x[1])
        return None

    def _infer_types(self):
        types: dict[str, tuple] = {}
        pending = [c for c in self.g.classes if self.g.is_value(c)]
        while pending:
            left = []
            for c in pending:
                for n in self.g.classes[c]:
                    ty = self._type_of_node(n, types)
                    if ty:
                        types[c] = ty
                        break
                else:
                    left.append(c)
            if len(left) == len(pending):
                break
            pending = left
        return types

    # --- 2. inline choices -------------------------------------------------------------------
    def is_self_load(self, n: ENode) -> bool:
        if n.op != "Load":
            return False
        k = self.tensor_node.get(n.args[0])
        return k is not None and k.op == "Kernel" and k.args[0] == n.eclass

    def value_children(self, n: ENode) -> list[str]:
        if n.op in ("Load", "LoadStrided"):
            return []
        return [a for a in n.args if isinstance(a, str) and self.g.is_value(a)]

    def _work(self, c, n: ENode) -> tuple[float, list[float]]:
        """Elements node ``n`` of class ``c`` computes, and how often each child is evaluated
        per use (more than once for a matmul operand)."""
        ty = self.types.get(c)
        shape = ty[0] if ty else ()
        size = max(1, math.prod(shape))
        kids = self.value_children(n)
        if n.op == "Dot" and len(shape) >= 2:
            m, nn = shape[-2], shape[-1]
            return size, [math.ceil(nn / DOT_TILE), math.ceil(m / DOT_TILE)]
        if n.op == "ExpDot" and len(shape) >= 2:  # scores once per row tile, values per row tile
            return size, [1.0, math.ceil(shape[-2] / DOT_TILE)]
        return size, [1.0] * len(kids)

    def _inline_choices(self) -> dict[str, ENode]:
        """Per class, its cheapest inline form: cost is work (op cost x elements) summed
        over the tree, so that among equal forms the one computing on fewer elements wins.

        A product whose operand holds a reduction cannot be one kernel with it (the
        operand's rows are needed whole before the product starts): such a form pays for
        the kernel it forces, so that a form without the split (attention's streamed
        softmax) wins even where it computes on more elements."""
        split = self.device.launch_us * self.device.ops_per_us
        cost = {c: math.inf for c in self.g.classes if self.g.is_value(c)}
        reduces: dict[str, bool] = {}  # whether the chosen form holds a reduction
        best: dict[str, ENode] = {}
        changed = True
        while changed:
            changed = False
            for c in cost:
                for n in self.g.classes[c]:
                    if self.is_self_load(n):
                        continue
                    kids = self.value_children(n)
                    size, reuse = self._work(c, n)
                    total = node_cost(n) * size + sum(cost[k] * r for k, r in zip(kids, reuse))
                    if n.op in ("Dot", "ExpDot") and any(reduces.get(k) for k in kids):
                        total += split
                    if total < cost[c] * (1 - 1e-9):
                        cost[c], best[c] = total, n
                        reduces[c] = n.op == "Reduce" or any(reduces.get(k) for k in kids)
                        changed = True
        return best

    # --- 3. plans ------------------------------------------------------------------------------
    def roots(self) -> list[str]:
        return list(dict.fromkeys(self.g.lets[name] for name in self.tr.roots))

    def reachable(self, roots) -> list[str]:
        seen, order = set(), []

        def go(c):
            if c in seen:
                return
            seen.add(c)
            n = self.best.get(c)
            if n is None:
                raise ExtractionError(f"no computable form for e-class {c} "
                                      f"({self.fx_names(c) or 'internal'})")
            for k in self.value_children(n):
                go(k)
            if n.op == "Load":  # a load of a kernel not fused (saturation stopped early)
                go(self.tensor_node[n.args[0]].args[0])
            order.append(c)
        for r in roots:
            go(r)
        return order

    def fx_names(self, c) -> list[str]:
        return self._fx_names.get(c, [])

    def extract(self) -> tuple[Plan, dict]:
        roots = self.roots()
        order = self.reachable(roots)
        forced = set(roots) | {self.tensor_node[self.best[c].args[0]].args[0]
                               for c in order if self.best[c].op == "Load"}
        candidates = [c for c in order if c in self.kernel_of and c not in forced]
        M, host = set(forced), {}
        memo: dict = {}

        def evaluate(M, host, base=None):
            return self._evaluate(order, M, host, memo, base)

        unfused = evaluate(set(forced) | set(candidates), {})
        state = evaluate(M, host)
        # Repair: materialise inside kernels the code generator cannot schedule.
        while state.invalid:
            bad = state.invalid[0]
            inside = [c for c in state.inline_sets[bad] if c in self.kernel_of and c not in M]
            if not inside:
                raise ExtractionError(f"kernel for {self.fx_names(bad) or bad} cannot be scheduled: "
                                      f"{state.reasons[bad]}")
            trials = [(evaluate(M | {c}, host, state), c) for c in inside]
            trials.sort(key=lambda t: (bad in t[0].invalid, len(t[0].invalid), t[0].cost))
            M = M | {trials[0][1]}
            state = trials[0][0]
        # Improve: materialise or fuse one value at a time while the modelled time drops.
        for _ in range(3):
            improved = False
            for c in candidates:
                trial_m = M - {c} if c in M else M | {c}
                trial = evaluate(trial_m, host, state)
                if not trial.invalid and trial.acyclic and trial.cost < state.cost - 1e-9:
                    M, state, improved = trial_m, trial, True
            if not improved:
                break
        # Multi-output kernels: store a materialised value from a kernel that computes it
        # anyway (a consumer), or from a sibling over the same inputs (horizontal fusion).
        for c in sorted(M, key=order.index):
            if c not in state.specs:
                continue
            reads = state.reads[c]
            siblings = [p for p in state.specs if reads & state.reads[p]]
            for p in dict.fromkeys(state.loaders.get(c, []) + siblings):
                p = host.get(p, p)  # the kernel that computes p
                if p == c or c in host:
                    continue
                # c's kernel, with everything it stores, moves into p's.
                trial_host = {k: (p if v == c else v) for k, v in host.items()}
                trial_host[c] = p
                trial = evaluate(M, trial_host, state)
                if not trial.invalid and trial.acyclic and trial.cost < state.cost - 1e-9:
                    host, state = trial_host, trial
                    break
        plan = self._assemble(state, M, host)
        plan.cost, plan.cost_unfused = state.cost, unfused.cost
        return plan, {"plan_cost_us": round(state.cost, 3), "unfused_cost_us": round(unfused.cost, 3),
                      "materialised": len(M), "kernels": len(plan.kernels)}

    def buffer_name(self, c) -> str:
        """A readable, unique name: after the FX node the buffer holds, where there is one."""
        if c not in self._buffer_names:
            names = self.fx_names(c)
            self._buffer_names[c] = f"buf_{names[0]}" if names else f"buf_{c.rsplit('-', 1)[-1]}"
        return self._buffer_names[c]

    def _evaluate(self, order, M, host, memo, base: _State | None = None) -> _State:
        """The plan that materialises ``M`` (with the values in ``host`` stored by the kernel
        named there), costed. Local search evaluates a thousand plans and more per graph, each
        one move away from ``base``: a kernel of ``base`` whose form the move cannot change
        (none of the classes its build looked at changed membership of ``M``, it stores the
        same values) is taken as it is, so that only the kernels around the move are built."""
        st = _State(M, host, self)
        hosted_by: dict[str, list[str]] = {}
        for c, p in host.items():
            hosted_by.setdefault(p, []).append(c)
        moved = M ^ base.M if base is not None else None  # host changes show in a kernel's extra
        buffers: dict = {}  # built at the first kernel that must be costed
        for c in order:
            if c not in M or c in host:
                continue
            extra = tuple(sorted(hosted_by.get(c, []), key=order.index))
            k = base.kernels.get(c) if base is not None else None
            if k is None or k.extra != extra or not k.looked_at.isdisjoint(moved):
                if not buffers:
                    buffers.update(self._buffers(M))
                k = self._kernel_eval(c, extra, M, memo, buffers)
            st.add(c, k)
        return st

    def _kernel_eval(self, c, extra: tuple, M, memo, buffers) -> _KernelEval:
        """The kernel computing ``c`` (and storing ``extra``) under ``M``, with its modelled
        time, or the reason the code generator cannot schedule it."""
        # A kernel depends on M only where M meets the values it could inline.
        region = frozenset().union(*(self._region(x) for x in (c, *extra)))
        kkey = (c, extra, frozenset(M & region))
        if kkey not in self._kernels:
            self._kernels[kkey] = self._kernel(c, M, list(extra))
        spec, inline, loads, reads = self._kernels[kkey]
        key = (c, extra, frozenset(inline), frozenset(loads))
        if key not in memo:
            memo[key] = self._kernel_time(spec, buffers)
        t, reason = memo[key]
        if loads & {c, *extra}:
            t, reason = math.inf, "reads a buffer it writes"
        return _KernelEval(extra, spec, inline, loads, reads, t, reason, frozenset(inline) | loads)

    def _kernel_time(self, spec, buffers) -> tuple[float, str | None]:
        """(modelled microseconds, None), or (inf, why) for a kernel the code generator
        cannot schedule. Generating its source is part of the check: the writer refuses
        forms the scheduler lets through."""
        try:
            _, sched, _, _ = generate(spec, buffers)
        except Unschedulable as e:
            return math.inf, str(e)
        passes = 1 if sched.kind == "pointwise" or sched.persistent else \
            1 + sum(1 for n in spec.walk() if n.op == "reduce")
        return kernel_time_us(spec, buffers, self.device, passes, sched), None

    def _acyclic(self, st: _State) -> bool:
        # Evaluated a thousand times and more per graph: the reads of each step are computed
        # once (with its kernel, or once for the eager steps), not walked again.
        fallbacks = self._fallback_steps()
        graph = _dependency_graph(st.specs, fallbacks, {**st.reads, **self._fallback_reads})
        return nx.is_directed_acyclic_graph(graph)

    def _region(self, c) -> frozenset:
        """The classes a kernel computing ``c`` could inline (its inline choices, transitively)."""
        if c not in self._regions:
            stack, seen = [c], {c}
            while stack:
                n = self.best.get(stack.pop())
                for k in self.value_children(n) if n is not None else ():
                    if k not in seen:
                        seen.add(k)
                        stack.append(k)
            self._regions[c] = frozenset(seen)
        return self._regions[c]

    def _fallback_steps(self) -> dict:
        if self._fallbacks is None:
            self._fallbacks = {f"f{j}": FallbackStep(fb.node, fb.target, _map_refs(fb.args, self),
                                                     _map_refs(fb.kwargs, self), fb.reason, fb.outputs, fb.multi)
                               for j, fb in enumerate(self.tr.fallbacks)}
            self._fallback_reads = {key: _reads(step) for key, step in self._fallbacks.items()}
        return self._fallbacks

    def _buffers(self, M) -> dict:
        buffers = {}
        for name, shape, dtype in self.tr.inputs:
            buffers[name] = Buffer(name, shape, dtype, "input")
        for fb in self.tr.fallbacks:
            for name, (shape, dtype) in zip(fb.outputs, fb.out_info):
                if dtype is not None:
                    buffers[name] = Buffer(name, shape, dtype, "external")
        for c in M:
            shape, dtype = self.types[c]
            buffers[self.buffer_name(c)] = Buffer(self.buffer_name(c), shape, dtype, "temp", self._strides(c))
        return buffers

    def _strides(self, c) -> tuple:
        strides = self.out_strides.get(c)
        return strides if strides is not None and strides != contiguous_strides(self.types[c][0]) else None

    def _kernel(self, root, M, extra):
        """The kernel computing ``root`` (and storing ``extra`` values it computes inline)."""
        memo: dict[str, PNode] = {}
        inline, loads = [], set()
        reads = set()  # buffer names the kernel loads (collected here: walking it again costs)
        here = {root, *extra}

        def build(c) -> PNode:
            if c in memo:
                return memo[c]
            shape, dtype = self.types[c]
            if c in M and c not in here:
                loads.add(c)
                strides = self._strides(c) or contiguous_strides(shape)
                p = PNode("load", (self.buffer_name(c), strides, 0), (), shape, dtype, c)
                reads.add(p.attrs[0])
                memo[c] = p
                return p
            n = self.best[c]
            inline.append(c)
            a = n.args
            if n.op == "LoadStrided":
                name = buffer_name(self.tensor_node[a[0]].args[0])
                p = PNode("load", (name, tuple(a[2]), a[3]), (), shape, dtype, c)
                reads.add(name)
            elif n.op == "Load":  # a kernel left unfused (saturation stopped early): read its buffer
                d = self.tensor_node[a[0]].args[0]
                loads.add(d)  # d in ``here`` (a kernel reading what it writes) is rejected by the caller
                strides = self._strides(d) or contiguous_strides(shape)
                p = PNode("load", (self.buffer_name(d), strides, 0), (), shape, dtype, c)
                reads.add(p.attrs[0])
            elif n.op == "Const":
                p = PNode("const", (bits_float(a[0]),), (), shape, dtype, c)
            elif n.op == "Iota":
                p = PNode("iota", (a[1],), (), shape, dtype, c)
            elif n.op in ("Unary", "Reduce"):
                p = PNode(n.op.lower(), (a[0],), (build(a[1]),), shape, dtype, c)
            elif n.op == "Binary":
                p = PNode("binary", (a[0],), (build(a[1]), build(a[2])), shape, dtype, c)
            elif n.op == "Where":
                p = PNode("where", (), tuple(build(x) for x in a), shape, dtype, c)
            elif n.op == "Cast":
                p = PNode("cast", (dtype,), (build(a[0]),), shape, dtype, c)
            elif n.op in ("Broadcast", "Reshape"):
                p = PNode(n.op.lower(), (), (build(a[0]),), shape, dtype, c)
            elif n.op == "Permute":
                p = PNode("permute", (tuple(a[1]),), (build(a[0]),), shape, dtype, c)
            elif n.op == "Slice":
                p = PNode("slice", (a[1], a[2], a[3]), (build(a[0]),), shape, dtype, c)
            elif n.op == "Cat":
                p = PNode("cat", (a[2],), (build(a[0]), build(a[1])), shape, dtype, c)
            elif n.op in ("Dot", "ExpDot"):
                p = PNode(n.op.lower(), (), (build(a[0]), build(a[1])), shape, dtype, c)
            elif n.op == "ExpSum":
                p = PNode("expsum", (), (build(a[0]),), shape, dtype, c)
            else:
                raise ExtractionError(f"unknown e-node {n.op}")
            memo[c] = p
            return p

        roots = [(build(c), self.buffer_name(c)) for c in [root, *extra]]
        names = []
        for c in inline:
            names += self.fx_names(c)
        label = (self.fx_names(root) or ["value"])[0]
        spec = KernelSpec(f"k_{label}", roots, list(dict.fromkeys(names)))
        return spec, inline, loads, reads

    # --- 4. the plan ---------------------------------------------------------------------------
    def _assemble(self, state, M, host) -> Plan:
        buffers = self._buffers(M)
        kernels = {f"k{i}": replace(spec) for i, spec in enumerate(state.specs.values())}
        steps = {**kernels, **self._fallback_steps()}
        g = _dependency_graph(kernels, self._fallback_steps())
        if not nx.is_directed_acyclic_graph(g):
            raise ExtractionError("the plan has a cycle")
        seq = list(nx.lexicographical_topological_sort(g, key=lambda k: (k[0] != "f", int(k[1:]))))
        ordered = [steps[k] for k in seq]
        for n, spec in enumerate(s for s in ordered if isinstance(s, KernelSpec)):
            spec.name = f"k{n}_{spec.name[2:]}"
        for name in buffers:
            if name.startswith("buf_"):
                buffers[name].kind = "temp"
        outputs = []
        for o in self.tr.outputs:
            if o[0] == "value":
                name = self.buffer_name(self.g.lets[o[1]])
                buffers[name].kind = "output"
                outputs.append(("buffer", name))
            elif o[0] == "buffer":
                outputs.append(("view", o[1]))
            else:
                outputs.append(o)
        inputs = [buffers[name] for name, _, _ in self.tr.inputs]
        return Plan(inputs, buffers, ordered, outputs)


def _dependency_graph(kernels: dict, fallbacks: dict, reads: dict | None = None) -> nx.DiGraph:
    """Steps (kernels and eager fallbacks, by key) with an edge from each buffer's writer
    to each of its readers (``reads``: step key -> the buffers it reads, where known)."""
    g = nx.DiGraph()
    writer: dict[str, str] = {}
    for key, spec in kernels.items():
        g.add_node(key)
        for _, b in spec.roots:
            writer[b] = key
    for key, step in fallbacks.items():
        g.add_node(key)
        for name in step.outputs:
            writer[name] = key
    for key, step in {**kernels, **fallbacks}.items():
        for b in (reads[key] if reads is not None else _reads(step)):
            if b in writer and writer[b] != key:
                g.add_edge(writer[b], key)
    return g


@dataclass(frozen=True)
class _KernelEval:
    """One kernel of a plan, costed."""
    extra: tuple  # the values it stores besides its root (multi-output)
    spec: KernelSpec
    inline: list  # the classes it computes
    loads: set  # the materialised classes it reads
    reads: set  # the buffer names it reads
    time: float  # modelled microseconds; inf where it cannot be scheduled
    reason: str | None  # why it cannot be scheduled
    looked_at: frozenset  # the classes whose membership of M decided its form


class _State:
    """A plan under evaluation: its kernels by root class, total cost, validity."""

    def __init__(self, M, host, extractor: Extractor):
        self.M, self.host = M, host
        self._extractor = extractor
        self.cost = 0.0
        self.kernels: dict[str, _KernelEval] = {}
        self.invalid: list[str] = []  # roots of kernels that cannot be scheduled, in order
        self.reasons: dict[str, str] = {}
        self.specs, self.reads, self.inline_sets = {}, {}, {}
        self.loaders: dict[str, list[str]] = {}  # materialised class -> the kernels reading it
        self._acyclic: bool | None = None

    def add(self, c, k: _KernelEval):
        self.kernels[c] = k
        if k.reason is not None:
            self.invalid.append(c)
            self.reasons[c] = k.reason
        self.cost += 0 if math.isinf(k.time) else k.time
        self.specs[c] = k.spec
        self.reads[c] = k.reads
        self.inline_sets[c] = k.inline
        for d in k.loads:
            self.loaders.setdefault(d, []).append(c)

    @property
    def acyclic(self) -> bool:
        """Whether the steps can be ordered; computed when first asked (most trial plans
        are rejected on cost or validity before it matters)."""
        if self._acyclic is None:
            self._acyclic = self._extractor._acyclic(self)
        return self._acyclic


def _map_refs(obj, ex: Extractor):
    from ..schema.from_fx import ArgRef
    if isinstance(obj, ArgRef):
        return BufArg(ex.buffer_name(ex.g.lets[obj.name]))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_refs(x, ex) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_refs(v, ex) for k, v in obj.items()}
    return obj


def _reads(step) -> set:
    from ..schema.from_fx import BufRef
    if isinstance(step, KernelSpec):
        return {n.attrs[0] for n in step.walk() if n.op == "load"}
    found = set()

    def go(o):
        if isinstance(o, BufRef):
            found.add(o.buf)
        elif isinstance(o, BufArg):
            found.add(o.name)
        elif isinstance(o, (list, tuple)):
            for x in o:
                go(x)
        elif isinstance(o, dict):
            for x in o.values():
                go(x)
    go(step.args)
    go(step.kwargs)
    return found
