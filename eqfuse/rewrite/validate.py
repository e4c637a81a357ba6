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

import warnings

import torch

from ..schema import ops
from ..schema.plan import BufArg, KernelSpec, Plan, PNode


def _compute_dtype(dtype: str) -> torch.dtype:
    return torch.float32 if dtype in ops.NARROW_FLOATS else ops.DTYPES[dtype]


def _eval(node: PNode, buffers: dict, memo: dict, device) -> torch.Tensor:
    if id(node) in memo:
        return memo[id(node)]
    a = [_eval(x, buffers, memo, device) for x in node.args]
    op, at = node.op, node.attrs
    if op == "load":
        base = buffers[at[0]]
        v = torch.as_strided(base, node.shape, at[1], base.storage_offset() + at[2])
        v = v.to(_compute_dtype(node.dtype))
    elif op == "const":
        v = torch.tensor(at[0], dtype=_compute_dtype(node.dtype), device=device)
    elif op == "iota":
        shape = [1] * len(node.shape)
        shape[at[0]] = node.shape[at[0]]
        v = torch.arange(node.shape[at[0]], device=device).reshape(shape).expand(node.shape)
    elif op == "unary":
        v = ops.UNARY[at[0]].torch_fn(a[0])
    elif op == "binary":
        v = ops.BINARY[at[0]].torch_fn(a[0], a[1])
    elif op == "where":
        v = torch.where(a[0], a[1], a[2])
    elif op == "cast":
        v = a[0].to(ops.DTYPES[node.dtype]).to(_compute_dtype(node.dtype))
    elif op == "reduce":
        v = ops.REDUCE[at[0]][0](a[0])
    elif op == "broadcast":
        v = a[0].broadcast_to(node.shape)
    elif op == "reshape":
        v = a[0].reshape(node.shape)
    elif op == "permute":
        v = a[0].permute(at[0])
    elif op == "slice":
        dim, start, step = at
        index = [slice(None)] * a[0].dim()
        index[dim] = slice(start, start + step * node.shape[dim], step)
        v = a[0][tuple(index)]
    elif op == "cat":
        v = torch.cat([a[0], a[1]], at[0])
    elif op == "dot":
        v = torch.matmul(a[0], a[1])
    elif op == "expdot":
        weights = torch.exp(a[0] - a[0].amax(-1, keepdim=True)).to(ops.DTYPES[node.args[1].dtype])
        v = torch.matmul(weights.to(a[1].dtype), a[1])
    elif op == "expsum":
        v = torch.exp(a[0] - a[0].amax(-1, keepdim=True)).sum(-1, keepdim=True)
    else:  # pragma: no cover - every plan op is listed above
        raise AssertionError(op)
    memo[id(node)] = v
    return v


def evaluate(plan: Plan, inputs, fallback_runner) -> list:
    """The plan's flat outputs, computed with PyTorch ops."""
    device = inputs[0].device if inputs else torch.device("cpu")
    buffers = {b.name: x for b, x in zip(plan.inputs, inputs)}
    for step in plan.steps:
        if isinstance(step, KernelSpec):
            memo: dict = {}
            for root, buf in step.roots:
                b = plan.buffers[buf]
                v = _eval(root, buffers, memo, device)
                out = torch.empty_strided(b.shape, b.layout, dtype=ops.DTYPES[b.dtype], device=device)
                buffers[buf] = out.copy_(v.broadcast_to(b.shape))
        else:
            outs = fallback_runner(step)(buffers)
            buffers.update(zip(step.outputs, outs))
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


def mismatch(plan: Plan, captured, fallback_runner) -> str | None:
    """None if the plan computes what the captured graph computes on the example inputs,
    else a one-line description of the first difference."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ..frontend.capture import real_examples

    inputs = real_examples(captured.example_tensors)
    with torch.no_grad(), warnings.catch_warnings(), unset_fake_temporarily():
        warnings.simplefilter("ignore")  # the user saw eager's warnings when tracing
        # The original function, not the decomposed trace: a decomposition is checked too.
        expected = captured.reference_outputs(inputs[:captured.num_user_inputs])
        got = evaluate(plan, inputs, fallback_runner)
        # An eager op's own outputs are not eqfuse's to check, and may differ run to run
        # (the random-state outputs of attention on CUDA).
        eager = {i for i, o in enumerate(plan.outputs)
                 if o[0] == "opaque" or (o[0] == "view" and o[1].buf.startswith("ext"))}
        return _first_difference(got, expected, eager)


def _first_difference(got, expected, skip=frozenset()) -> str | None:
    for i, (g, e) in enumerate(zip(got, expected)):
        if not isinstance(e, torch.Tensor) or i in skip:
            continue
        if g.shape != e.shape or g.dtype != e.dtype:
            return f"output {i}: {tuple(g.shape)} {g.dtype} instead of {tuple(e.shape)} {e.dtype}"
        if not e.dtype.is_floating_point:
            if not torch.equal(g, e):
                return f"output {i}: values differ"
            continue
        g64, e64 = g.double(), e.double()
        if not torch.equal(torch.isnan(g64), torch.isnan(e64)):
            return f"output {i}: NaN in different places"
        finite = torch.isfinite(e64) & torch.isfinite(g64)
        if not torch.equal(g64[~finite].nan_to_num(), e64[~finite].nan_to_num()):
            return f"output {i}: infinities differ"
        err = (g64[finite] - e64[finite]).norm()
        scale = e64[finite].norm() + 1e-30
        rtol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(e.dtype, 1e-4)
        if err > rtol * scale and err > 1e-6 * g64.numel() ** 0.5:
            return f"output {i}: relative error {float(err / scale):.2e}"
    return None


__all__ = ["BufArg", "evaluate", "mismatch"]
