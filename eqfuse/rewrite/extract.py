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
   A thousand trial plans and more are weighed per graph: each reuses the kernels of the
   plan one move before that the move cannot change, and kernel sources are written only
   for the trials whose validity decides a step (tests/test_extract.py checks that these
   shortcuts choose what the plain search chooses).
4. Multi-output kernels: a materialised value may be stored by a kernel that computes it
   inline anyway (the residual in residual+LayerNorm), dropping its own kernel, when that
   is legal, keeps the plan acyclic and is cheaper.
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace

import networkx as nx
import torch

from ..codegen.kernel import generate
from ..codegen.schedules import looped_passes, schedule_of
from ..errors import ExtractionError, Unschedulable
from ..schema import ops
from ..schema.eager_steps import underlying_op
from ..schema.plan import BufArg, Buffer, FallbackStep, KernelSpec, Plan, PNode, contiguous_strides, step_reads
from ..schema.terms import bits_float, buffer_name, dtype_name
from ..schema.values import BufRef
from .cost import Device, device_model, kernel_time_us
from .egraph_json import EGraphView, ENode

OP_COST = {"Load": 1.0, "LoadStrided": 1.0, "Const": 0.01, "Iota": 0.1, "Where": 1.0, "Cast": 0.5,
           "Reduce": 2.0, "Broadcast": 0.05, "Reshape": 0.05, "Permute": 0.05, "Slice": 0.05, "Cat": 1.0,
           "Gather": 1.0,
           "Dot": 2.0, "ExpDot": 3.0, "ExpSum": 2.0}
# The ops a value computed from indices and constants alone is made of (see _from_indices).
INDEX_OPS = {"Iota", "Const", "Unary", "Binary", "Where", "Cast", "Broadcast", "Reshape", "Permute", "Slice"}
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
    def __init__(self, view: EGraphView, translation, device: Device | None = None, library: bool = False):
        """``library``: the plan's plain products will be cuBLAS calls (codegen/library.py),
        which the costs weigh: a product with work fused around it stays generated."""
        self.g = view
        self.tr = translation
        self.device = device or device_model()
        self.library = library
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
        for name, strides in translation.arg_strides.items():  # an eager step's argument
            self.out_strides.setdefault(view.lets[name], strides)
        self._buffer_names: dict[str, str] = {}
        self._fx_names: dict[str, list[str]] = {}
        for name, cid in view.lets.items():
            if name.startswith("n_"):
                self._fx_names.setdefault(cid, []).append(name[2:])
        self.ill_typed: dict[str, str] = {}  # class -> its first ill-typed form, in words
        self.best = self._inline_choices()
        self._regions: dict[str, frozenset] = {}
        self._kernels: dict = {}  # (root, hosted, M within reach) -> (spec, inline, loads, reads)
        self._fallbacks: dict | None = None  # the eager steps, the same in every plan
        self._fallback_reads: dict = {}  # and the buffers each reads
        self._recipes: dict[str, tuple] = {}  # class -> how a kernel computes it (see _recipe)
        self._stored_loads: dict[str, tuple] = {}  # class -> how a kernel reads its buffer
        self._index_only: dict[str, bool] = {}  # class -> computed from indices and constants alone
        self._fixed_buffers: dict | None = None  # inputs and eager steps' outputs, for trial plans
        self._temp_buffers: dict[str, Buffer] = {}  # class -> its buffer, for trial plans

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
        if op == "Gather":
            x, index = t(a[0]), t(a[1])
            return x and index and (index[0], x[1])
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
        if n.op == "Gather":  # the table only where it is read
            table = self.types.get(kids[0])
            return size, [size / max(1, math.prod(table[0])) if table else 1.0, 1.0]
        return size, [1.0] * len(kids)

    def _well_typed(self, c, n: ENode) -> bool:
        """Whether ``n``'s operands fit it: a product's contracted dims agree, an elementwise
        op's operands broadcast to its class's shape. egglog 13.2 at times hands a term back
        with another vector in place of its own (egraph_json mends the shapes its analysis
        names); a form built on such a term is never chosen, and a class left with none is
        an ExtractionError naming it (``ill_typed``), not a kernel the writer refuses: the
        graph is built once more from scratch, as for egglog's other mix-ups, then runs in
        eager with that reason."""
        ty = self.types.get(c)
        kids = [self.types.get(k) for k in self.value_children(n)]
        if ty is None or None in kids:
            return True  # nothing to check against
        shapes = [k[0] for k in kids]
        if n.op in ("Dot", "ExpDot"):
            ok = len(shapes[0]) >= 2 and len(shapes[1]) >= 2 and shapes[0][-1] == shapes[1][-2]
        elif n.op in ("Binary", "Where"):
            ok = all(all(d in (1, out) for d, out in zip(reversed(s), reversed(ty[0]))) and len(s) <= len(ty[0])
                     for s in shapes)
        else:
            return True
        if not ok:
            self.ill_typed.setdefault(c, f"{n.op} of {' and '.join(str(list(s)) for s in shapes)}")
        return ok

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
        # A worklist: a class is weighed again when one of its children got cheaper (sweeps
        # over every class until none changed took one sweep per level of a deep graph: a
        # chain of 500 ops, 7.8 s)
        forms = {c: [(n, self.value_children(n), self._work(c, n)) for n in self.g.classes[c]
                     if not self.is_self_load(n) and self._well_typed(c, n)] for c in cost}
        parents: dict[str, list[str]] = {}
        for c, ns in forms.items():
            for _, kids, _ in ns:
                for k in kids:
                    parents.setdefault(k, []).append(c)
        queue, queued = deque(cost), set(cost)
        while queue:
            c = queue.popleft()
            queued.discard(c)
            improved = False
            for n, kids, (size, reuse) in forms[c]:
                total = node_cost(n) * size + sum(cost[k] * r for k, r in zip(kids, reuse))
                if n.op in ("Dot", "ExpDot") and any(reduces.get(k) for k in kids):
                    total += split
                if total < cost[c] * (1 - 1e-9):
                    cost[c], best[c] = total, n
                    reduces[c] = n.op == "Reduce" or any(reduces.get(k) for k in kids)
                    improved = True
            if improved:
                for p in parents.get(c, ()):
                    if p not in queued:
                        queue.append(p)
                        queued.add(p)
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
                formless = [k for k in self.ill_typed if k not in self.best]
                if formless:  # what the graph needs is built on a term egglog mixed up
                    raise ExtractionError(f"egglog returned only ill-typed forms for "
                                          f"{self.fx_names(formless[0]) or 'a value'}: "
                                          f"{self.ill_typed[formless[0]]}", retry=True)
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

    def extract(self, deadline: float | None = None) -> tuple[Plan, dict]:
        """The plan, and a report. Past ``deadline`` (``time.perf_counter()``), the search
        stops where it is: an unschedulable plan becomes the one that stores every value
        (when that one can be scheduled), and no more fusions are weighed."""
        with _collector_paused():
            try:
                return self._extract(deadline)
            finally:
                # The kernels weighed and dropped, freed before the collector resumes (it
                # would walk them all once, as young objects, to find no garbage).
                self._kernels.clear()

    def _extract(self, deadline: float | None) -> tuple[Plan, dict]:
        spent = {"at": None}  # the step at which the budget ran out

        def over(step: str) -> bool:
            if spent["at"] is None and deadline is not None and time.perf_counter() > deadline:
                spent["at"] = step
            return spent["at"] is not None

        roots = self.roots()
        order = self.reachable(roots)
        forced = set(roots) | {self.tensor_node[self.best[c].args[0]].args[0]
                               for c in order if self.best[c].op == "Load"}
        candidates = [c for c in order if c in self.kernel_of and c not in forced]
        M, host = set(forced), {}
        memo: dict = {}

        def evaluate(M, host, base=None):
            return self._evaluate(order, M, host, memo, base)

        def acceptable(trial) -> _State | None:
            """The trial, checked, if it is a valid plan and cheaper than ``state``."""
            if trial.invalid or not trial.acyclic or trial.cost >= state.cost - 1e-9:
                return None
            trial = self._checked(trial, memo)
            return None if trial.invalid else trial

        unfused = evaluate(set(forced) | set(candidates), {})
        state = self._checked(evaluate(M, host), memo)
        # Repair: materialise inside kernels the code generator cannot schedule.
        stored = None  # the all-stored plan, checked once the budget has run out
        while state.invalid:
            if stored is None and over("repair"):
                stored = self._checked(unfused, memo)
                if not stored.invalid:
                    M, host, state = set(forced) | set(candidates), {}, stored
                    break
            bad = state.invalid[0]
            inside = [c for c in state.inline_sets[bad] if c in self.kernel_of and c not in M and self._storable(c)]
            if not inside:
                def trial():
                    memo.clear()  # every kernel is built again from the new forms
                    return self._checked(evaluate(M, host), memo)
                rerouted = self._reroute(bad, state.inline_sets[bad], set(order), M, trial)
                if rerouted is None:
                    raise ExtractionError(f"kernel for {self.fx_names(bad) or bad} cannot be scheduled: "
                                          f"{state.reasons[bad]}")
                state = rerouted
                unfused = evaluate(set(forced) | set(candidates), {})
                continue
            trials = [(evaluate(M | {c}, host, state), c) for c in self._repair_candidates(state.reasons[bad], inside)]
            state, c = self._repair_choice(trials, bad, memo)
            M = M | {c}
        # Improve: materialise or fuse one value at a time while the modelled time drops.
        for _ in range(3):
            improved = False
            for c in filter(self._storable, candidates):
                if over("fusion"):
                    break
                trial_m = M - {c} if c in M else M | {c}
                trial = acceptable(evaluate(trial_m, host, state))
                if trial is not None:
                    M, state, improved = trial_m, trial, True
            if not improved:
                break
        # A product cuBLAS would run once its computed operands are stored (a widening cast,
        # a scale): one move stores them all, which storing one at a time never weighs (the
        # product stays generated while the other is computed in it)
        if self.library:
            for k in list(state.specs):  # a kernel a taken move merged away is in the state no more
                operands = self._product_operands(state.inline_sets.get(k, ()), M)
                if not operands or over("library operands"):
                    continue
                trial = acceptable(evaluate(M | operands, host, state))
                if trial is not None:
                    M, state = M | operands, trial
        # Multi-output kernels: store a materialised value from a kernel that computes it
        # anyway (a consumer), or from a sibling over the same inputs (horizontal fusion).
        for c in sorted(M, key=order.index):
            if c not in state.specs or over("multi-output kernels"):
                continue
            reads = state.reads[c]
            siblings = [p for p in state.specs if reads & state.reads[p]]
            for p in dict.fromkeys(state.loaders.get(c, []) + siblings):
                p = host.get(p, p)  # the kernel that computes p
                if p == c or c in host:
                    continue
                trial = acceptable(evaluate(M, _moved(host, [c], p), state))
                if trial is not None:
                    host, state = _moved(host, [c], p), trial
                    # Its other siblings at once: one at a time, each trial writes the
                    # growing kernel again (a graph of 400 outputs from one product: 402
                    # kernels written, 22 s of extraction)
                    rest = [d for d in sorted(M, key=order.index) if d in state.specs and d != p and d not in host
                            and state.reads[d] & state.reads[p]]
                    together = acceptable(evaluate(M, _moved(host, rest, p), state)) if len(rest) > 1 else None
                    if together is not None:
                        host, state = _moved(host, rest, p), together
                    break
        unfused = self._checked(unfused, memo)
        plan = self._assemble(state, M, host)
        plan.cost, plan.cost_unfused = state.cost, unfused.cost
        report = {"plan_cost_us": round(state.cost, 3), "unfused_cost_us": round(unfused.cost, 3),
                  "materialised": len(M), "kernels": len(plan.kernels)}
        if spent["at"] is not None:
            report["budget_spent"] = spent["at"]
        return plan, report

    def _reroute(self, bad, inline, reachable: set, M, trial) -> _State | None:
        """For a kernel that cannot be scheduled and inlines no value it could store instead:
        compute one of its inlined classes through another e-node of the class, the first
        with which the kernel can be scheduled, or inlines a value the repair can store.
        The rewrites may have taken forms that leave no way out: x.sum(0).softmax(-1) had
        the row max read the column sums' reduction past every storable value, and a
        product over a concatenated K was split into products of K 8 and 9, which one
        kernel cannot hold (found by random graphs; the whole graph ran in eager). The
        plan ``trial()`` makes with the new form, or None (the forms as they were)."""
        for c in inline:
            old = self.best[c]
            for n in self.g.classes[c]:
                if n is old or self.is_self_load(n):
                    continue
                kids = self.value_children(n)
                if not all(k in reachable and k in self.best for k in kids):
                    continue
                if any(c in self._region(k) for k in kids):  # it would compute c from itself
                    continue
                self._choose(c, n)
                st = trial()
                if bad not in st.invalid or any(k in self.kernel_of and k not in M for k in st.inline_sets[bad]):
                    return st
            self._choose(c, old)
        return None

    def _choose(self, c, n) -> None:
        """Class ``c`` computed by e-node ``n`` from now on; what was worked out from its old form is forgotten."""
        self.best[c] = n
        self._regions.clear()
        self._recipes.clear()
        self._index_only.clear()
        self._kernels.clear()

    def _repair_candidates(self, reason: Unschedulable, inside: list) -> list:
        """The values a repair tries to store, of those ``inside`` an unschedulable kernel:
        those the code generator names (a matmul kernel's reductions and where its operands
        leave them, an attention kernel's computed keys, where a product or a projection
        leaves attention), else all of them. Trying every value each round made T5's
        training backward weigh 244 trial plans a round, round after round (20 GB of
        kernels); a tiny 8-layer Llama's extraction took 42.8 s on this machine's CPU, 11.8
        with the projections and norms named."""
        named = [c for c in inside if c in reason.store]
        return named or inside

    def _repair_choice(self, trials: list, bad, memo) -> tuple[_State, str]:
        """Of the trial plans (each with the class it materialises), the one where the kernel
        ``bad`` can be scheduled, then with the fewest unschedulable kernels, then the
        cheapest; the first in order among equals. Trials are ranked before their sources are
        written; writing can only raise a trial's rank (a refused kernel turns invalid), so
        the first in rank whose sources all pass is the one ranking checked trials gives."""
        def rank(i):
            t = trials[i][0]
            return (bad in t.invalid, len(t.invalid), t.cost, i)
        while True:
            i = min(range(len(trials)), key=rank)
            trial, c = trials[i]
            checked = self._checked(trial, memo)
            if len(checked.invalid) == len(trial.invalid):
                return checked, c
            trials[i] = (checked, c)

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
                    buffers.update(self._trial_buffers(M))
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
        t, reason, checked = memo[key]
        if loads & {c, *extra}:
            t, reason, checked = math.inf, Unschedulable("reads a buffer it writes"), True
        return _KernelEval(extra, spec, inline, loads, reads, t, reason, frozenset(inline) | loads, key, checked)

    def _kernel_time(self, spec, buffers) -> tuple[float, Unschedulable | None, bool]:
        """(modelled microseconds, None, False) for a kernel the scheduler takes, or (inf,
        why, True) for one it refuses. The third item says whether the verdict is final:
        the source writer refuses some forms the scheduler takes, and writing is costly, so
        it is left to ``_checked``, for the plans whose validity decides a step."""
        try:
            sched = schedule_of(spec)
        except Unschedulable as e:
            return math.inf, _kept(e), True
        passes = 1 if sched.kind == "pointwise" or sched.persistent else looped_passes(spec)
        library = self.library and sched.kind == "matmul" and _library_product(spec, buffers)
        return kernel_time_us(spec, buffers, self.device, passes, sched, library), None, False

    def _checked(self, st: _State, memo) -> _State:
        """``st`` with the source of each kernel written, and the kernels the writer refuses
        invalid. A refusal only adds to a plan's invalid kernels, so a plan that looks
        acceptable before this check is acceptable after it, or rejected: never better."""
        if all(k.checked for k in st.kernels.values()):
            return st
        buffers = self._trial_buffers(st.M)
        out = _State(st.M, st.host, self)
        for c, k in st.kernels.items():
            if not k.checked:
                t, reason, checked = memo[k.key]
                if not checked:
                    try:
                        generate(k.spec, buffers)
                    except Unschedulable as e:
                        t, reason = math.inf, _kept(e)
                    memo[k.key] = (t, reason, True)
                k = replace(k, time=t, reason=reason, checked=True)
            out.add(c, k)
        return out

    def _acyclic(self, st: _State) -> bool:
        # Evaluated a thousand times and more per graph: the reads of each step are computed
        # once (with its kernel, or once for the eager steps), not walked again.
        fallbacks = self._fallback_steps()
        edges = _dependencies(st.specs, fallbacks, {**st.reads, **self._fallback_reads})
        return _is_acyclic([*st.specs, *fallbacks], edges)

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
                                                     _map_refs(fb.kwargs, self), fb.reason, fb.outputs, fb.multi,
                                                     fb.writes)
                               for j, fb in enumerate(self.tr.fallbacks)}
            self._fallback_reads = {key: step_reads(step) for key, step in self._fallbacks.items()}
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

    def _trial_buffers(self, M) -> dict:
        """``_buffers(M)`` for costing trial plans, from Buffer objects made once per class
        (the code generator and the cost model only read them; the plan gets its own)."""
        if self._fixed_buffers is None:
            self._fixed_buffers = self._buffers(())
        buffers = dict(self._fixed_buffers)
        for c in M:
            b = self._temp_buffers.get(c)
            if b is None:
                shape, dtype = self.types[c]
                b = self._temp_buffers[c] = Buffer(self.buffer_name(c), shape, dtype, "temp", self._strides(c))
            buffers[b.name] = b
        return buffers

    def _strides(self, c) -> tuple:
        strides = self.out_strides.get(c)
        return strides if strides is not None and strides != contiguous_strides(self.types[c][0]) else None

    def _kernel(self, root, M, extra):
        """The kernel computing ``root`` (and storing ``extra`` values it computes inline)."""
        memo: dict[str, PNode] = {}
        inline, loads = [], set()
        reads = set()  # buffer names the kernel loads (collected here: walking it again costs)
        nodes = []  # in the order they are made, children first: the kernel's walk
        here = {root, *extra}

        def build(top) -> PNode:
            """Depth first, children in order, as a recursion would (a chain of thousands
            of ops is deeper than Python's stack): each class is visited on the way down
            (a load, or its recipe) and made once its children are."""
            stack = [[top, None]]
            while stack:
                entry = stack[-1]
                c, recipe = entry
                if c in memo:
                    stack.pop()
                    continue
                if recipe is None:
                    if c in M and c not in here and not self._from_indices(c):
                        loads.add(c)
                        attrs, shape, dtype = self._stored_load(c)
                        p = memo[c] = PNode("load", attrs, (), shape, dtype, c)
                        reads.add(attrs[0])
                        nodes.append(p)
                        stack.pop()
                        continue
                    inline.append(c)
                    recipe = entry[1] = self._recipe(c)
                    _, _, kids, _, _, read, loaded = recipe
                    if read is not None:
                        reads.add(read)
                    if loaded is not None:  # d in ``here`` (a kernel reading what it writes) is rejected by the caller
                        loads.add(loaded)
                    stack.extend([k, None] for k in reversed(kids) if k not in memo)
                    continue
                op, attrs, kids, shape, dtype, _, _ = recipe
                p = memo[c] = PNode(op, attrs, tuple(memo[k] for k in kids), shape, dtype, c)
                nodes.append(p)
                stack.pop()
            return memo[top]

        roots = [(build(c), self.buffer_name(c)) for c in [root, *extra]]
        names = [name for c in inline for name in self._fx_names.get(c, ())]
        label = (self.fx_names(root) or ["value"])[0]
        spec = KernelSpec(f"k_{label}", roots, list(dict.fromkeys(names))).known_walk(nodes)
        return spec, inline, loads, reads

    def _product_operands(self, inline, M) -> set:
        """The values a kernel's products compute their operands from, under the operands'
        views (permutes, reshapes), that the search could store: each computed in the
        kernel (``inline``), not stored yet."""
        found = set()
        for c in inline:
            n = self.best.get(c)
            if n is None or n.op != "Dot":
                continue
            for kid in self.value_children(n):
                while kid in inline and self.best[kid].op in ("Permute", "Reshape"):
                    kid = self.value_children(self.best[kid])[0]
                if kid in inline and kid in self.kernel_of and kid not in M and self._storable(kid):
                    found.add(kid)
        return found

    def _storable(self, c) -> bool:
        """Whether the search tries storing ``c``. Not a value computed from indices alone:
        every kernel that needs it recomputes it (_from_indices), so storing it only adds a
        kernel whose buffer nobody reads (GPT-2's and Llama's masks and positions took a
        third of the repair's rounds, each weighing every class of the kernel repaired).
        Asked as the search goes: a reroute may change a class's form."""
        return not self._from_indices(c)

    def _from_indices(self, c) -> bool:
        """Whether ``c`` is computed from indices and constants alone (a causal mask): a
        kernel that needs it recomputes it rather than loading it, even where it is stored
        for someone else (a training forward hands the mask to the backward). A load in a
        matmul's epilogue costs that kernel its TMA form (H100, Llama's q @ k^T with a
        causal where: 1493 us with the mask loaded, 916 recomputed)."""
        known = self._index_only.get(c)
        if known is None:
            n = self.best[c]
            known = n.op in INDEX_OPS and all(self._from_indices(k) for k in self.value_children(n))
            self._index_only[c] = known
        return known

    def _stored_load(self, c) -> tuple:
        """(load attrs, shape, dtype) of a kernel reading materialised ``c`` from its buffer."""
        if c not in self._stored_loads:
            shape, dtype = self.types[c]
            strides = self._strides(c) or contiguous_strides(shape)
            self._stored_loads[c] = ((self.buffer_name(c), strides, 0), shape, dtype)
        return self._stored_loads[c]

    def _recipe(self, c) -> tuple:
        """How a kernel computes ``c`` inline, worked out once per class (kernels are built
        thousands of times): (op, attrs, child classes, shape, dtype, the buffer it reads
        or None, the class whose buffer it loads or None)."""
        if c not in self._recipes:
            self._recipes[c] = self._make_recipe(c)
        return self._recipes[c]

    def _make_recipe(self, c) -> tuple:
        shape, dtype = self.types[c]
        n = self.best[c]
        a, op = n.args, n.op
        read = loaded = None
        if op == "LoadStrided":
            read = buffer_name(self.tensor_node[a[0]].args[0])
            op, attrs, kids = "load", (read, tuple(a[2]), a[3]), ()
        elif op == "Load":  # a kernel left unfused (saturation stopped early): read its buffer
            loaded = self.tensor_node[a[0]].args[0]
            read = self.buffer_name(loaded)
            op, attrs, kids = "load", (read, self._strides(loaded) or contiguous_strides(shape), 0), ()
        elif op == "Const":
            op, attrs, kids = "const", (bits_float(a[0]),), ()
        elif op == "Iota":
            op, attrs, kids = "iota", (a[1],), ()
        elif op in ("Unary", "Reduce"):
            op, attrs, kids = op.lower(), (a[0],), (a[1],)
        elif op == "Binary":
            op, attrs, kids = "binary", (a[0],), (a[1], a[2])
        elif op == "Where":
            op, attrs, kids = "where", (), tuple(a)
        elif op == "Cast":
            op, attrs, kids = "cast", (dtype,), (a[0],)
        elif op in ("Broadcast", "Reshape", "ExpSum"):
            op, attrs, kids = op.lower(), (), (a[0],)
        elif op == "Permute":
            op, attrs, kids = "permute", (tuple(a[1]),), (a[0],)
        elif op == "Slice":
            op, attrs, kids = "slice", (a[1], a[2], a[3]), (a[0],)
        elif op == "Cat":
            op, attrs, kids = "cat", (a[2],), (a[0], a[1])
        elif op == "Gather":
            op, attrs, kids = "gather", (a[2],), (a[0], a[1])
        elif op in ("Dot", "ExpDot"):
            op, attrs, kids = op.lower(), (), (a[0], a[1])
        else:
            raise ExtractionError(f"unknown e-node {op}")
        return op, attrs, kids, shape, dtype, read, loaded

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
            elif o[0] == "alias":
                _, j, shape, strides = o
                base = self.buffer_name(self.g.lets[self.tr.outputs[j][1]])
                outputs.append(("view", BufRef(base, shape, strides, 0)))
            else:
                outputs.append(o)
        inputs = [buffers[name] for name, _, _ in self.tr.inputs]
        return Plan(inputs, buffers, ordered, outputs)


def _kept(e: Unschedulable) -> Unschedulable:
    """``e`` without its traceback, to be kept with a kernel's verdict: the traceback's
    frames hold the search's state (its memo of verdicts, every kernel built), a cycle
    through which the kernels weighed and dropped stayed alive to the end of extraction
    (365 000 objects in GPT-NeoX's training backward, freed by the collector after)."""
    e.__context__ = None
    return e.with_traceback(None)


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while extraction runs, back on after (if it
    was on). Extraction makes and keeps plan nodes by the hundred thousand, and each burst
    of allocation set off full collections that walk the whole heap, torch's included: on
    the Llama layer's graphs 3-5 per graph at 0.2-0.5 s each, most of extraction's time.
    Extraction makes no reference cycles to collect (its garbage goes by reference count)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _library_product(spec: KernelSpec, buffers: dict) -> bool:
    """Whether ``spec`` is a product the plan will hand to cuBLAS (codegen/library.py)."""
    from ..codegen.library import library_call
    try:
        return library_call(spec, buffers) is not None
    except KeyError:  # a buffer this trial plan does not store
        return False


def _dependency_graph(kernels: dict, fallbacks: dict, reads: dict | None = None) -> nx.DiGraph:
    """Steps (kernels and eager fallbacks, by key) with an edge from each buffer's writer
    to each of its readers (``reads``: step key -> the buffers it reads, where known)."""
    g = nx.DiGraph()
    g.add_nodes_from([*kernels, *fallbacks])
    g.add_edges_from(_dependencies(kernels, fallbacks, reads))
    return g


def _moved(host: dict, kernels: list, p: str) -> dict:
    """``host`` with each of ``kernels``, and everything it stores, moved into ``p``'s kernel."""
    moved = set(kernels)
    out = {k: (p if v in moved else v) for k, v in host.items()}
    out.update(dict.fromkeys(kernels, p))
    return out

def _dependencies(kernels: dict, fallbacks: dict, reads: dict | None = None):
    """(writer, reader) per buffer a step reads that another step writes; (earlier, later)
    for the eager steps that draw random numbers, in the graph's order: each draws from the
    generator where the one before it left it, as in eager (T5's training forward, five
    dropouts, drew in another order and failed the check against eager); and (reader,
    updater) for each input an eager step writes in place, whose old value every other
    reader must see (frontend/writes.py), the updates of one input in the graph's order."""
    def in_order(keys):
        return sorted(keys, key=lambda k: int(k[1:]))
    draws = in_order(k for k, step in fallbacks.items() if draws_random_numbers(step.target))
    yield from zip(draws, draws[1:])
    writer: dict[str, str] = {}
    for key, spec in kernels.items():
        for _, b in spec.roots:
            writer[b] = key
    for key, step in fallbacks.items():
        for name in step.outputs:
            writer[name] = key
    updaters: dict[str, list] = {}
    for key in in_order(k for k, step in fallbacks.items() if step.writes is not None):
        updaters.setdefault(fallbacks[key].writes, []).append(key)
    for keys in updaters.values():
        yield from zip(keys, keys[1:])
    for key, step in {**kernels, **fallbacks}.items():
        for b in (reads[key] if reads is not None else step_reads(step)):
            if b in writer and writer[b] != key:
                yield writer[b], key
            for updater in updaters.get(b, ()):
                if updater != key:
                    yield key, updater


def draws_random_numbers(target) -> bool:
    """Whether the op an eager step runs draws from torch's random generator (dropout,
    rand_like, bernoulli: ops tagged ``nondeterministic_seeded``)."""
    op = underlying_op(target)
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def _is_acyclic(steps, edges) -> bool:
    """Whether the directed graph has no cycle (Kahn's algorithm: every step can be
    ordered). A plain loop, not networkx: trial plans are checked by the hundred."""
    after: dict = {k: set() for k in steps}
    waiting = dict.fromkeys(steps, 0)
    for a, b in edges:
        if b not in after[a]:
            after[a].add(b)
            waiting[b] += 1
    ready = [k for k, n in waiting.items() if n == 0]
    done = 0
    while ready:
        done += 1
        for b in after[ready.pop()]:
            waiting[b] -= 1
            if waiting[b] == 0:
                ready.append(b)
    return done == len(waiting)


@dataclass(frozen=True)
class _KernelEval:
    """One kernel of a plan, costed."""
    extra: tuple  # the values it stores besides its root (multi-output)
    spec: KernelSpec
    inline: list  # the classes it computes
    loads: set  # the materialised classes it reads
    reads: set  # the buffer names it reads
    time: float  # modelled microseconds; inf where it cannot be scheduled
    reason: Unschedulable | None  # why it cannot be scheduled
    looked_at: frozenset  # the classes whose membership of M decided its form
    key: tuple  # its entry in the extraction's memo of kernel costs
    checked: bool  # whether ``reason`` is final (its source was written, or it was refused)


class _State:
    """A plan under evaluation: its kernels by root class, total cost, validity."""

    def __init__(self, M, host, extractor: Extractor):
        self.M, self.host = M, host
        self._extractor = extractor
        self.cost = 0.0
        self.kernels: dict[str, _KernelEval] = {}
        self.invalid: list[str] = []  # roots of kernels that cannot be scheduled, in order
        self.reasons: dict[str, Unschedulable] = {}
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
    from ..schema.values import ArgRef
    if isinstance(obj, ArgRef):
        value = ex.g.lets[obj.name]
        if obj.view is None:
            return BufArg(ex.buffer_name(value))
        if ex._strides(value) is not None:
            raise ExtractionError("an eager step's argument is a view of a value the plan lays out otherwise")
        return BufRef(ex.buffer_name(value), *obj.view)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_refs(x, ex) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_refs(v, ex) for k, v in obj.items()}
    return obj
