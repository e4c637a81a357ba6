"""Translation validation: run the extracted plan with PyTorch ops (the reference meaning
of every plan node) on the example inputs, and compare with the captured graph run in
eager. A plan that computes something else is never used.

This guards the whole middle of the pipeline — rules, extraction, and the e-graph library
itself (egglog 13.2 was seen to hand back an e-node whose string argument belonged to
another term; see rules.rulesets). The check is loose enough for rounding (kernels
compute narrow floats in float32, eager rounds after every op) and tight enough for any
wrong operator.
"""

from __future__ import annotations

import math
import operator
import re
import warnings
from contextlib import contextmanager

import torch

from ..frontend.writes import cloned, written_positions
from ..schema import ops
from ..schema.plan import BufArg, KernelSpec, Plan, PNode, last_uses, returned_buffers
from .wide_reference import WideReference

# Memory bound of the check. A kernel whose nodes hold more elements than this is
# evaluated in chunks along one dim of each root (the query rows of attention: the
# score matrix of a Llama layer at batch 8 x 2048 tokens x 32 heads is 4 GiB in float32,
# and a streamed-attention kernel has several such nodes), so that each intermediate
# holds about this many elements. Outputs are compared in pieces of this size.
CHUNK_ELEMENTS = 1 << 24


def _compute_dtype(dtype: str) -> torch.dtype:
    return torch.float32 if dtype in ops.NARROW_FLOATS else ops.DTYPES[dtype]


def _apply(node: PNode, a: list, shape: tuple, device) -> torch.Tensor:
    """The value of ``node`` given its arguments' values ``a``; ``shape`` is the node's
    shape, or a narrowing of it (then ``a`` are narrowed to match)."""
    op, at = node.op, node.attrs
    if op == "const":  # filled on the device: torch.tensor would copy it there, waiting for the GPU
        return torch.full((), at[0], dtype=_compute_dtype(node.dtype), device=device)
    if op == "unary":
        return ops.UNARY[at[0]].torch_fn(a[0])
    if op == "binary":
        return ops.BINARY[at[0]].torch_fn(a[0], a[1])
    if op == "where":
        return torch.where(a[0], a[1], a[2])
    if op == "cast":
        return a[0].to(ops.DTYPES[node.dtype]).to(_compute_dtype(node.dtype))
    if op == "reduce":
        return ops.REDUCE[at[0]][0](a[0])
    if op == "broadcast":
        return a[0].broadcast_to(shape)
    if op == "reshape":
        return a[0].reshape(shape)
    if op == "permute":
        return a[0].permute(at[0])
    if op == "slice":
        dim, start, step = at
        index = [slice(None)] * a[0].dim()
        index[dim] = slice(start, start + step * shape[dim], step)
        return a[0][tuple(index)]
    if op == "cat":
        return torch.cat([a[0], a[1]], at[0])
    if op == "gather":  # as the kernel reads: NaN (0) outside the table, where eager raises
        dim = at[0]
        n = node.args[0].shape[dim]
        inside = (a[1] >= 0) & (a[1] < n)
        got = torch.gather(a[0], dim, torch.where(inside, a[1], 0).to(torch.int64))
        return torch.where(inside, got, torch.nan if got.is_floating_point() else 0)
    if op == "dot":
        return _product(a[0], a[1], node.args)
    if op == "expdot":  # the weights are rounded to the values' dtype, as the kernel multiplies them
        weights = torch.exp(a[0] - a[0].amax(-1, keepdim=True)).to(ops.DTYPES[node.args[1].dtype])
        return _product(weights.to(a[1].dtype), a[1], node.args[1:])
    if op == "expsum":
        return torch.exp(a[0] - a[0].amax(-1, keepdim=True)).sum(-1, keepdim=True)
    raise AssertionError(op)  # pragma: no cover - every plan op is listed above


def _product(a: torch.Tensor, b: torch.Tensor, operands) -> torch.Tensor:
    """``a @ b`` in float32, for a product of the plan nodes ``operands``. Where they are
    half precision, on TF32 tensor cores: the kernel rounds them to 10 mantissa bits (fp16) or
    7 (bf16), which TF32 holds, so each product is exact and only the float32 sum's order
    differs, as it does between any two kernels. In IEEE float32 they run at a tenth of
    the rate or less, and a Llama layer's check is part of its cold compile. A float32
    product keeps the user's setting (the kernel's and eager's too)."""
    if all(x.dtype in ops.NARROW_FLOATS for x in operands):
        with _tf32():
            return torch.matmul(a, b)
    return torch.matmul(a, b)


@contextmanager
def _tf32():
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


class _KernelEvaluator:
    """Evaluates the nodes of one kernel with PyTorch ops, whole (``full``) or narrowed
    to a range along one dim (``narrow``). A narrowed node asks its arguments only for
    the part it reads; where that part is not a range of one dim (a reshape that
    scatters the range), the argument is evaluated whole, once, and narrowed after."""

    def __init__(self, buffers: dict, device):
        self.buffers, self.device = buffers, device
        self.memo: dict = {}  # id(node) -> whole value, for the whole kernel

    def full(self, node: PNode) -> torch.Tensor:
        v = self.memo.get(id(node))
        if v is None:
            if node.op == "load":
                v = self._view(node).to(_compute_dtype(node.dtype))
            elif node.op == "iota":
                v = self._iota(node)
            elif node.op == "dot" and _inner_step(node):
                v = self._dot_by_inner_chunks(node, _inner_step(node))
            else:
                v = _apply(node, [self.full(x) for x in node.args], node.shape, self.device)
            self.memo[id(node)] = v
        return v

    def _dot_by_inner_chunks(self, node: PNode, step: int) -> torch.Tensor:
        """A product whose operands are large (a weight gradient: [hidden, tokens] @
        [tokens, hidden]) as a sum of products over chunks of the inner dim, each
        operand evaluated only for the chunk."""
        a, b = node.args
        out = None
        for k0 in range(0, a.shape[-1], step):
            k1 = min(a.shape[-1], k0 + step)
            memo: dict = {}
            part = _product(self.narrow(a, len(a.shape) - 1, k0, k1, memo),
                            self.narrow(b, len(b.shape) - 2, k0, k1, memo), node.args)
            out = part if out is None else out.add_(part)
        return out

    def _view(self, node: PNode) -> torch.Tensor:
        base = self.buffers[node.attrs[0]]
        return torch.as_strided(base, node.shape, node.attrs[1], base.storage_offset() + node.attrs[2])

    def _iota(self, node: PNode) -> torch.Tensor:
        dim = node.attrs[0]
        shape = [1] * len(node.shape)
        shape[dim] = node.shape[dim]
        return torch.arange(node.shape[dim], device=self.device).reshape(shape).expand(node.shape)

    def narrow(self, node: PNode, dim: int, lo: int, hi: int, memo: dict) -> torch.Tensor:
        """``node``'s value narrowed to ``[lo, hi)`` along ``dim``; ``memo`` holds the
        narrowed values of one chunk."""
        if lo == 0 and hi == node.shape[dim]:
            return self.full(node)
        key = (id(node), dim, lo, hi)
        if key not in memo:
            memo[key] = self._narrow(node, dim, lo, hi, memo)
        return memo[key]

    def _narrow(self, node: PNode, dim: int, lo: int, hi: int, memo: dict) -> torch.Tensor:
        op = node.op
        shape = node.shape[:dim] + (hi - lo,) + node.shape[dim + 1:]
        if op == "load":  # a view first: only the chunk is converted
            return self._view(node).narrow(dim, lo, hi - lo).to(_compute_dtype(node.dtype))
        if op in ("iota", "const"):  # cheap whole (an expanded arange, a scalar)
            return self.full(node).narrow(dim, lo, hi - lo) if node.shape else self.full(node)
        if op == "slice" and node.attrs[0] == dim:
            _, start, step = node.attrs
            part = self.narrow(node.args[0], dim, start + lo * step, start + (hi - 1) * step + 1, memo)
            return part[(slice(None),) * dim + (slice(None, None, step),)]
        if op == "cat" and node.attrs[0] == dim:
            return self._narrow_cat(node, dim, lo, hi, memo)
        if op == "reshape":
            return self._narrow_reshape(node, dim, lo, hi, memo)
        args = [self._narrow_arg(x, d, lo, hi, memo) for x, d in zip(node.args, _arg_dims(node, dim))]
        v = _apply(node, args, shape, self.device)
        if tuple(v.shape) != shape:  # no argument carried the range: computed whole
            assert tuple(v.shape) == tuple(node.shape), (node, v.shape)
            v = v.narrow(dim, lo, hi - lo)
        return v

    def _narrow_arg(self, arg: PNode, dim, lo, hi, memo):
        """An argument narrowed along ``dim`` if it has that range there (not broadcast), else whole."""
        if dim is None or arg.shape[dim] == 1:
            return self.full(arg)
        return self.narrow(arg, dim, lo, hi, memo)

    def _narrow_cat(self, node, dim, lo, hi, memo):
        first, second = node.args
        n0 = first.shape[dim]
        parts = []
        if lo < n0:
            parts.append(self.narrow(first, dim, lo, min(hi, n0), memo))
        if hi > n0:
            parts.append(self.narrow(second, dim, max(lo, n0) - n0, hi - n0, memo))
        return torch.cat(parts, dim) if len(parts) > 1 else parts[0]

    def _narrow_reshape(self, node, dim, lo, hi, memo):
        """A range of an output dim of a reshape is a range of the flat index within
        each block of the dims before it; where the dims before it match a prefix of the
        input's dims, it is a range of the input's next dim (rounded out to whole
        elements of it, and trimmed after the reshape)."""
        arg = node.args[0]
        out, inp = node.shape, arg.shape
        prefix = math.prod(out[:dim])
        in_dim = next((i for i in range(len(inp) - 1, -1, -1) if math.prod(inp[:i]) == prefix), None)
        if in_dim is None:
            return self.full(node).narrow(dim, lo, hi - lo)
        block = math.prod(out[dim:])  # elements of one prefix index
        out_inner, in_inner = block // out[dim], block // max(inp[in_dim], 1)
        a, b = lo * out_inner // in_inner, -(-hi * out_inner // in_inner)
        if (a * in_inner) % out_inner or (b * in_inner) % out_inner:
            return self.full(node).narrow(dim, lo, hi - lo)  # the input's range splits output rows
        part = self.narrow(arg, in_dim, a, b, memo)
        v = part.reshape(out[:dim] + ((b - a) * in_inner // out_inner,) + out[dim + 1:])
        return v.narrow(dim, lo - a * in_inner // out_inner, hi - lo)


def _inner_step(node: PNode) -> int | None:
    """For a product with an operand larger than ``CHUNK_ELEMENTS``: the length of the
    chunks of its inner dim that keep each operand's chunk about that size; else None."""
    a, b = node.args
    if min(len(a.shape), len(b.shape)) < 2:
        return None
    inner, big = a.shape[-1], max(a.numel, b.numel)
    step = max(1, inner * CHUNK_ELEMENTS // max(big, 1))
    return step if big > CHUNK_ELEMENTS and step < inner else None


def _arg_dims(node: PNode, dim: int) -> list:
    """For a node narrowed along ``dim``: the dim of each argument to narrow likewise
    (None: the argument is needed whole)."""
    op, rank = node.op, len(node.shape)
    if op == "permute":
        return [node.attrs[0][dim]]
    if op in ("dot", "expdot"):
        a, b = node.args
        if min(len(a.shape), len(b.shape)) < 2:
            return [None, None]
        if dim == rank - 2:
            return [len(a.shape) - 2, None]
        if dim == rank - 1:
            return [None, len(b.shape) - 1]
    if op == "expsum" and dim == rank - 1:
        return [None]
    if op == "reduce" and dim == rank - 1:
        return [None]
    if op == "gather":  # the table whole along its dim, else both alike
        return [None if dim == node.attrs[0] else dim, dim]
    # Pointwise ops, broadcasts, batch dims of products, reductions over the last dim, a
    # slice or cat along another dim: arguments line up from the right.
    dims = []
    for x in node.args:
        d = dim - (rank - len(x.shape))
        dims.append(d if d >= 0 and x.shape[d] == node.shape[dim] else None)
    return dims


class _Probe(_KernelEvaluator):
    """An evaluator on meta tensors (no data, no time) that records the largest value
    it had to compute whole. Loads are not counted: a whole load is a view of a buffer
    that exists anyway (converted to float32 at most), as the values of attention are."""

    def __init__(self, buffers: dict):
        meta = {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                for k, v in buffers.items() if isinstance(v, torch.Tensor)}
        super().__init__(meta, torch.device("meta"))
        self.largest = 0

    def full(self, node: PNode) -> torch.Tensor:
        v = super().full(node)
        if node.op not in ("const", "iota", "load") or node.dtype in ops.NARROW_FLOATS:
            self.largest = max(self.largest, v.numel())
        return v


def _largest_whole(root: PNode, buffers: dict, dim) -> float:
    """The largest value evaluating ``root`` computes whole: narrowed to one row along
    ``dim``, or whole where ``dim`` is None (on meta tensors)."""
    probe = _Probe(buffers)
    try:
        probe.full(root) if dim is None else probe.narrow(root, dim, 0, 1, {})
    except Exception:  # noqa: BLE001 - an op meta tensors lack: not this way
        return math.inf
    return probe.largest


def _chunk_dim(root: PNode, buffers: dict) -> int | None:
    """The dim to evaluate ``root`` in chunks along: the longest, the last one last,
    whose one-row chunk needs no large value computed whole (a reshape that splits the
    dim across others makes its argument whole: the longest dim of a ``[B, S, H]`` view
    of a ``[B * S, H]`` product is S, which cannot be narrowed there, but B can). None:
    evaluate it whole, its products summed over chunks of their inner dim (a weight
    gradient, smaller than the activations it sums over)."""
    rank = len(root.shape)
    dims = sorted(range(rank - 1), key=lambda d: -root.shape[d]) + [rank - 1]
    candidates = [d for d in dims if root.shape[d] > 1] + [None]
    best, best_largest = None, math.inf
    for d in candidates:
        largest = _largest_whole(root, buffers, d)
        if largest <= CHUNK_ELEMENTS:
            return d
        if largest < best_largest:
            best, best_largest = d, largest
    return best


def _eval_kernel(step: KernelSpec, plan: Plan, buffers: dict, device) -> None:
    ev = _KernelEvaluator(buffers, device)
    for root, buf in step.roots:
        b = plan.buffers[buf]
        out = _stored(plan, buffers, b, device)
        biggest = max(n.numel for n in root.walk())
        if biggest <= CHUNK_ELEMENTS or tuple(root.shape) != tuple(b.shape) or not root.shape:
            _write(out, ev.full(root).broadcast_to(b.shape))
        elif (dim := _chunk_dim(root, buffers)) is None:
            _write(out, ev.full(root))
        else:
            rows = root.shape[dim]
            step_rows = max(1, rows * CHUNK_ELEMENTS // biggest)
            for lo in range(0, rows, step_rows):
                hi = min(rows, lo + step_rows)
                _write(out.narrow(dim, lo, hi - lo), ev.narrow(root, dim, lo, hi, {}))
        buffers[buf] = out


def _stored(plan: Plan, buffers: dict, b, device) -> torch.Tensor:
    """The tensor a kernel stores buffer ``b`` into: a new one, or for a view of another
    buffer (a concatenation's part, codegen/concat.py) that view, the other buffer made
    first where no part of it was stored yet."""
    if b.view_of is None:
        return torch.empty_strided(b.shape, b.layout, dtype=ops.DTYPES[b.dtype], device=device)
    base, offset = b.view_of
    if base not in buffers:
        buffers[base] = _stored(plan, buffers, plan.buffers[base], device)
    return torch.as_strided(buffers[base], b.shape, b.layout, offset)


def _write(out: torch.Tensor, value: torch.Tensor) -> None:
    """``out.copy_(value)``, also where ``out`` has a stride of 0 (a graph output kept
    in eager's layout, an expanded gradient): the kernel writes its equal values over one
    another there; torch refuses to, so the first of them is written (found by random
    graphs: such a backward failed this check and ran in eager)."""
    for d, (size, stride) in enumerate(zip(out.shape, out.stride())):
        if stride == 0 and size > 1:
            out, value = out.narrow(d, 0, 1), value.broadcast_to(out.shape).narrow(d, 0, 1)
    out.copy_(value)


def evaluate(plan: Plan, inputs, fallback_runner) -> list:
    """The plan's flat outputs, computed with PyTorch ops. Buffers no output needs are
    dropped after their last use, as the generated module drops them."""
    device = inputs[0].device if inputs else torch.device("cpu")
    buffers = {b.name: x for b, x in zip(plan.inputs, inputs)}
    kept = returned_buffers(plan)
    last = last_uses(plan)
    for i, step in enumerate(plan.steps):
        if isinstance(step, KernelSpec):
            _eval_kernel(step, plan, buffers, device)
        else:
            outs = fallback_runner(step)(buffers)
            buffers.update(zip(step.outputs, outs))
        for name in [n for n, j in last.items() if j == i and n not in kept]:
            buffers.pop(name, None)
    result = []
    for o in plan.outputs:
        if o[0] == "buffer":
            result.append(buffers[o[1]])
        elif o[0] == "view":
            r = o[1]
            base = buffers[r.buf]
            result.append(torch.as_strided(base, r.shape, r.strides, base.storage_offset() + r.offset))
        elif o[0] == "opaque":
            result.append(buffers[o[1]])
        else:
            result.append(o[1])
    return result


RANDOM_SEED = 0


@contextmanager
def _drawing_from(seed: int):
    """torch's generators seeded with ``seed``, and given back as they were after. A random
    op (dropout, rand_like) runs in eager in the plan as in the graph, in the same order:
    both runs of the check draw the same numbers, and the caller's stream is left alone."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def mismatch(plan: Plan, captured, fallback_runner, inputs=None) -> str | None:
    """None if the plan computes what the captured graph computes on ``inputs`` (the
    graph's placeholders' tensors: by default the example inputs, which must be real),
    else a one-line description of the first difference."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    inputs = list(captured.example_tensors if inputs is None else inputs)
    written = written_positions(captured.gm)
    with torch.no_grad(), warnings.catch_warnings(), unset_fake_temporarily():
        warnings.simplefilter("ignore")  # the user saw eager's warnings when tracing
        # The original function, not the decomposed trace: a decomposition is checked too.
        # Each run writes its own copies of the inputs the graph writes, which are compared after.
        theirs, mine = cloned(inputs, written), cloned(inputs, written)
        with _drawing_from(RANDOM_SEED):
            expected = captured.reference_outputs(theirs[:captured.num_user_inputs])
        with _drawing_from(RANDOM_SEED):
            got = evaluate(plan, mine, fallback_runner)
        # (the reference writes a module's own buffers, not the copies: the user's inputs only)
        users = [i for i in written if i < captured.num_user_inputs]
        problem = _first_difference([mine[i] for i in users], [theirs[i] for i in users])
        if problem:
            return f"an input it writes: {problem}"
        # An eager op's own outputs are not eqfuse's to check, and may differ run to run
        # (the random-state outputs of attention on CUDA).
        eager = {i for i, o in enumerate(plan.outputs)
                 if o[0] == "opaque" or (o[0] == "view" and o[1].buf.startswith("ext"))}
        rtols = output_rtols(captured.gm)
        problem = _first_difference(got, expected, eager, rtols)
        if problem and (ops_of_eager := captured.undecomposed()) is not None:
            eager |= order_dependent_outputs(ops_of_eager)
            problem = _first_difference(got, expected, eager, rtols)
        if problem and any(rtol in NARROW_BY_RTOL for rtol in rtols):  # computed from half precision
            exact = _wide_outputs(captured, cloned(inputs, written))
            if exact is not None:
                problem = _first_worse(got, expected, exact, eager, rtols)
        return problem and _naming_the_node(problem, captured.gm)


aten = torch.ops.aten
# Ops that decide an order over their input's values, and the one of their results that
# holds the decision (the positions; None: the op's only result)
ORDER_DECISIONS = {aten.sort.default: 1, aten.sort.stable: 1, aten.topk.default: 1, aten.kthvalue.default: 1,
                   aten.median.dim: 1, aten.mode.default: 1, aten.max.dim: 1, aten.min.dim: 1,
                   aten.argsort.default: None, aten.argsort.stable: None, aten.argmax.default: None,
                   aten.argmin.default: None}
# Ops that read (or write) data at positions an index tensor names: (the data's argument,
# the index's argument, the written tensor's argument or None)
INDEXED = {aten.index.Tensor: (0, 1, None), aten.index_select.default: (0, 2, None), aten.gather.default: (0, 2, None),
           aten.take.default: (0, 1, None), aten.embedding.default: (0, 1, None),
           aten.index_put.default: (2, 1, 0), aten.index_put_.default: (2, 1, 0), aten.index_add.default: (3, 2, 0),
           aten.index_copy.default: (3, 2, 0), aten.scatter.src: (3, 2, 0), aten.scatter_add.default: (3, 2, 0),
           aten.scatter_reduce.two: (3, 2, 0)}


def order_dependent_outputs(gm: torch.fx.GraphModule) -> set:
    """Positions of the graph's outputs laid out by an order decision: the top-k experts
    of each token in a mixture of experts, the permutation sorting its tokens by expert,
    the tokens gathered in that order and what is computed from them before they are put
    back. Where values tie or, rounded otherwise than eager's, near-tie, the plan may
    decide otherwise (one token of a small Mixtral routed the other way shifted 17 of
    its sort's 256 indices) and both are the graph's answer; these outputs are not
    compared. What is put back in the tokens' own order is (a gather by the inverse
    permutation, a scatter by the permutation: an index op whose index and data are both
    in the decided order), within its tolerance, as is the loss. A decision over the
    graph's inputs is not open (their ties are the user's, exactly: eqfuse orders them as
    eager does or falls back). The decision kernels are checked exactly against torch's
    on their own (OpInfo, ties included)."""
    decided: set = set()

    def arg(node, i):
        flat = node.args[i] if i < len(node.args) else None
        return [a for a in (flat if isinstance(flat, (list, tuple)) else [flat]) if isinstance(a, torch.fx.Node)]

    def open_decision(node):  # over values the graph computes: the user's own are ordered as eager orders them
        return node.args[0].op != "placeholder"

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and node.args[0].target in ORDER_DECISIONS:
            if (node.args[1] == ORDER_DECISIONS[node.args[0].target] and open_decision(node.args[0])) \
                    or node.args[0] in decided:
                decided.add(node)  # (the values sorted are the same whatever the ties' order)
        elif ORDER_DECISIONS.get(node.target, 0) is None and open_decision(node):
            decided.add(node)
        elif node.target in INDEXED:
            data, index, written = INDEXED[node.target]
            # the data in the decided order read by positions in its own, or the other way round
            permuted = any(a in decided for a in arg(node, data)) != any(a in decided for a in arg(node, index))
            if permuted or (written is not None and any(a in decided for a in arg(node, written))):
                decided.add(node)
        elif any(a in decided for a in node.all_input_nodes):
            decided.add(node)  # (a sort of decided values: which ones it holds was decided)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return {i for i, a in enumerate(out) if a in decided}


def _naming_the_node(problem: str, gm: torch.fx.GraphModule) -> str:
    """``problem`` ("output 38: values differ") with the FX node of that output named, so
    that a reader can find it in the graph ("output 38 (getitem_5 = topk): ...")."""
    found = re.match(r"output (\d+): ", problem)
    outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    if not found or int(found[1]) >= len(outputs) or not isinstance(outputs[int(found[1])], torch.fx.Node):
        return problem
    node = outputs[int(found[1])]
    made_by = node.args[0] if node.target is operator.getitem else node
    what = made_by.target if isinstance(made_by.target, str) else getattr(made_by.target, "__name__", made_by.target)
    return f"output {found[1]} ({node.name} = {what}): {problem[found.end():]}"


NARROW = (torch.float16, torch.bfloat16)
# Rounding of one value to each dtype, relative: how far from exact a plan may be where eager is exact
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def _wide_outputs(captured, inputs) -> list | None:
    """The graph's outputs with its floating inputs in float64 (its own casts still round
    where it makes them), else in float32 where an op has no float64, or None where
    neither runs (attention with dropout). Fused attention kernels and grouped products,
    of half precision only, compute as exact math (``wide_reference``)."""
    for dtype in (torch.float64, torch.float32):
        wide = [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
        try:
            with _drawing_from(RANDOM_SEED), WideReference(dtype):
                return captured.reference_outputs(wide[:captured.num_user_inputs])
        except Exception:  # noqa: BLE001,PERF203 - no such reference: try the next, then the first verdict stands
            continue
    return None


def _first_worse(got, expected, exact, skip=frozenset(), rtols=None) -> str | None:
    """The first output computed from half-precision values where the plan is further from
    the wide ``exact`` than twice eager's distance from it, plus one rounding (as Inductor's
    accuracy check judges with an fp64 reference): in half precision, a gradient that is
    zero in exact arithmetic (a key bias's: softmax ignores a shift of a row's scores) is
    rounding noise in eager and in the plan alike, and a mixture of experts sends the
    tokens whose router scores tie within a rounding to other experts (Mixtral's layers
    after the first): no relative tolerance tells them apart. Other outputs, and NaN or
    infinities in other places, are judged as before."""
    for i, (g, e, x) in enumerate(zip(got, expected, exact)):
        if not isinstance(e, torch.Tensor) or i in skip or not e.dtype.is_floating_point:
            continue
        source = e.dtype if e.dtype in NARROW else NARROW_BY_RTOL.get(rtols[i] if rtols else None)
        if source is None:
            problem = _first_difference([g], [e], rtols=rtols and [rtols[i]])
        else:
            problem = _compare(g, e, float("inf"))  # NaN and infinities in the same places
            if not problem:
                g64, e64, x64 = g.double(), e.double(), x.double()
                finite = torch.isfinite(g64) & torch.isfinite(x64)
                mine, theirs, scale = (torch.linalg.vector_norm(torch.where(finite, v, 0)).item()
                                       for v in (g64 - x64, e64 - x64, x64))
                if mine > 2 * theirs + UNIT_ROUNDOFF[source] * scale + 1e-6 * e.numel() ** 0.5:
                    problem = (f"{mine / (scale + 1e-30):.2e} from a {x.dtype} evaluation "
                               f"(eager {theirs / (scale + 1e-30):.2e})")
        if problem:
            return f"output {i}: {problem}"
    return None


# Relative tolerance of the check by the precision of the data an output is computed from.
RTOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2}
RTOL_DEFAULT = 1e-4
NARROW_BY_RTOL = {RTOL[t]: t for t in NARROW}


def output_rtols(gm: torch.fx.GraphModule) -> list:
    """Per graph output, the tolerance of the least precise float the graph computes it
    from. An output in float32 computed from float16 values carries their rounding:
    kernels round a fused chain once where eager rounds each op, so float16 values differ
    by about 4e-4 relative, and a float32 LayerNorm mean of them, where the sum cancels,
    by 1.4e-3 (GPT-2 block on an H100): float16's tolerance, not float32's, applies."""
    rtol: dict = {}
    for node in gm.graph.nodes:
        meta = node.meta.get("val")
        metas = meta if isinstance(meta, (list, tuple)) else [meta]
        own = [RTOL.get(m.dtype, RTOL_DEFAULT) for m in metas
               if isinstance(m, torch.Tensor) and m.dtype.is_floating_point]
        rtol[node] = max(own + [rtol[a] for a in node.all_input_nodes if a in rtol], default=RTOL_DEFAULT)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return [rtol.get(a, RTOL_DEFAULT) if isinstance(a, torch.fx.Node) else RTOL_DEFAULT for a in out.args[0]]


def _pieces(t: torch.Tensor, limit: int):
    """``t`` in flat pieces of at most about ``limit`` elements, cut by its shape alone
    (two tensors of one shape give matching pieces, whatever their strides)."""
    if t.numel() <= limit or t.dim() == 0:
        yield t.reshape(-1)
        return
    row = t.numel() // t.shape[0]
    for part in t.split(max(1, limit // max(row, 1))):
        if part.numel() <= limit or part.dim() == 1:
            yield part.reshape(-1)
        else:
            for r in part:
                yield from _pieces(r, limit)


def _first_difference(got, expected, skip=frozenset(), rtols=None) -> str | None:
    """The first output that differs, in words. ``rtols``: per output, the relative
    tolerance (by default that of its own dtype)."""
    for i, (g, e) in enumerate(zip(got, expected)):
        if not isinstance(e, torch.Tensor) or i in skip:
            continue
        if g.shape != e.shape or g.dtype != e.dtype:
            return f"output {i}: {tuple(g.shape)} {g.dtype} instead of {tuple(e.shape)} {e.dtype}"
        rtol = max(rtols[i], RTOL.get(e.dtype, RTOL_DEFAULT)) if rtols else RTOL.get(e.dtype, RTOL_DEFAULT)
        problem = _compare(g, e, rtol) if e.dtype.is_floating_point else \
            next(("values differ" for gp, ep in zip(_pieces(g, CHUNK_ELEMENTS), _pieces(e, CHUNK_ELEMENTS))
                  if not torch.equal(gp, ep)), None)
        if problem:
            return f"output {i}: {problem}"
    return None


def _compare(g: torch.Tensor, e: torch.Tensor, rtol: float) -> str | None:
    """Float outputs: NaN and infinities in the same places, and the norm of the
    difference over the finite elements within a dtype tolerance of the norm of eager's
    values. Computed piece by piece (narrow floats in float32, sums of squares in
    float64), the verdict read back once: a Llama layer's training forward compares
    twenty outputs of up to 180M elements, and waiting on each piece (four times, in
    float64 copies) took half a second of its cold compile on an H100."""
    flags, err2, scale2 = [], [], []  # per piece, on the device
    for gp, ep in zip(_pieces(g, CHUNK_ELEMENTS), _pieces(e, CHUNK_ELEMENTS)):
        gp, ep = (gp.float(), ep.float()) if e.dtype in (torch.float16, torch.bfloat16) else (gp, ep)
        g_nan, e_nan = torch.isnan(gp), torch.isnan(ep)
        finite = torch.isfinite(gp) & torch.isfinite(ep)
        flags.append(torch.stack([(g_nan != e_nan).any(), (~finite & ~(g_nan & e_nan) & (gp != ep)).any()]))
        err2.append(torch.linalg.vector_norm(torch.where(finite, gp - ep, 0), dtype=torch.float64) ** 2)
        scale2.append(torch.linalg.vector_norm(torch.where(finite, ep, 0), dtype=torch.float64) ** 2)
    sums = torch.stack([torch.stack(err2).sum(), torch.stack(scale2).sum()])
    nan, inf, err2, scale2 = torch.cat([torch.stack(flags).any(0).double(), sums]).tolist()  # one wait
    if nan:
        return "NaN in different places"
    if inf:
        return "infinities differ"
    err, scale = err2 ** 0.5, scale2 ** 0.5 + 1e-30
    if err > rtol * scale and err > 1e-6 * e.numel() ** 0.5:
        return f"relative error {err / scale:.2e}"
    return None


__all__ = ["BufArg", "evaluate", "mismatch"]
